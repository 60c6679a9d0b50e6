"""The one attention backend of our forwards (target and draft models, EAGLE heads).

On a GPU: the Triton kernel over the paged cache (specsplit/kernels/paged_attention.py), one
launch per layer for the whole ragged batch, capturable in a CUDA graph. On the CPU: the
plain-torch reference beside that kernel, with its per-sequence plan (slots and dense masks)
built once per forward and reused by every layer.
"""

from __future__ import annotations

import torch

from specsplit.kernels.paged_attention import paged_attention
from specsplit.kernels.paged_attention import warm_up as warm_up_kernels
from specsplit.kernels.paged_attention_reference import paged_attention_with_plan
from specsplit.kv_cache import KVCache
from specsplit.model.batch import ForwardBatch


def attend(
    q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], this step's K/V written
    v_cache: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """[T, num_heads, head_dim] attention output of every query token."""
    scale = q.shape[-1] ** -0.5
    if q.is_cuda:
        return paged_attention(
            q,
            k_cache,
            v_cache,
            batch.cu_seqlens_q,
            batch.kv_lens,
            batch.prefix_lens,
            batch.block_table,
            batch.page_size,
            batch.tree_mask,
            batch.max_q_len,
            scale,
        )
    return paged_attention_with_plan(q, k_cache, v_cache, batch.reference_plan(), scale)


def warm_up_attention(kv: KVCache, num_heads: int) -> None:
    """On a GPU, build every paged-attention kernel variant this KV's layout can take
    (specsplit.kernels.paged_attention.warm_up), so that no request waits for one; nothing on
    the CPU."""
    if kv.device.type == "cuda":
        warm_up_kernels(kv.k[0], kv.v[0], num_heads, kv.page_size, kv.data.dtype)
