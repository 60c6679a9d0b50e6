"""The pointwise parts of a decoder layer, each one kernel on a GPU.

Unfused, a layer's RMSNorms, residual adds, RoPE, K/V stores and SiLU-and-mul are ~30 small
kernels; at batch 1 their launches and tails cost more than the weights take to read (SmolLM2
on an H100: 1,155 kernels and 2.4 ms of GPU time per step for a 0.1 ms floor). On a GPU each
function below runs as one Triton kernel made by torch.compile (nano-vllm does the same),
captured with the rest of the step in its CUDA graph; on the CPU it runs as written, the
reference. `SPECSPLIT_TORCH_COMPILE=0` turns compilation off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from specsplit.model.rope import apply_rotary

F_ = TypeVar("F_", bound=Callable[..., Any])
COMPILE = os.environ.get("SPECSPLIT_TORCH_COMPILE", "1") != "0"
# compiled variants per function (dtype, eps, weights as parameters or plain tensors: a target,
# a draft model and an EAGLE head in one process each add theirs); past the limit torch.compile
# fails outright (fullgraph), so keep room for every model a process (or a test run) loads
RECOMPILE_LIMIT = 64


def _on_gpu(fn: F_) -> F_:
    """fn, compiled (dynamic shapes) for CUDA tensors in inference, as written elsewhere
    (the CPU, and training, where autograd needs it)."""
    compiled: list[Callable[..., Any]] = []

    def dispatch(x: torch.Tensor, *args: Any) -> Any:
        if not (COMPILE and x.is_cuda and not torch.is_grad_enabled()):
            return fn(x, *args)
        if not compiled:
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        return compiled[0](x, *args)

    dispatch.__doc__ = fn.__doc__
    return dispatch  # type: ignore[return-value]


@_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32, as transformers computes it."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@_on_gpu
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm(residual + x)): a residual add and the next norm, [T, hidden]."""
    hidden = residual + x
    x32 = hidden.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return hidden, weight * x32.to(hidden.dtype)


@_on_gpu
def rope_and_store(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    """RoPE on q and k, k and v written to the cache at slot_mapping; returns the rotated q."""
    k = apply_rotary(k, cos, sin)
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return apply_rotary(q, cos, sin)


@_on_gpu
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] -> silu(gate) * up, [T, inter]."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up
