"""Our forward for the Llama family over a ragged batch and the paged KV cache.

Weights are transformers' weights under our names; q/k/v and gate/up are fused into one
matmul each. HF name (model.layers.{i}. prefix omitted) -> ours:

    model.embed_tokens.weight                 -> embed_tokens.weight
    input_layernorm.weight                    -> layers.{i}.input_layernorm.weight
    self_attn.{q,k,v}_proj.{weight,bias}      -> layers.{i}.qkv_proj.{weight,bias} (cat)
    self_attn.{q,k}_norm.weight  (Qwen3)      -> layers.{i}.{q,k}_norm.weight
    self_attn.o_proj.{weight,bias}            -> layers.{i}.o_proj.{weight,bias}
    post_attention_layernorm.weight           -> layers.{i}.post_attention_layernorm.weight
    mlp.{gate,up}_proj.{weight,bias}          -> layers.{i}.gate_up_proj.{weight,bias} (cat)
    mlp.down_proj.{weight,bias}               -> layers.{i}.down_proj.{weight,bias}
    model.norm.weight                         -> norm.weight
    lm_head.weight  (absent when tied)        -> lm_head.weight
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from specsplit.kernels.small_linear import (
    RopeStore,
    linear_residual,
    norm_linear,
    norm_linear_rope_store,
    norm_linear_silu_mul,
)
from specsplit.kernels.small_linear_tiles import MAX_ROWS
from specsplit.kv_cache import KVCache, kv_bytes_per_token
from specsplit.model import cpu_layer
from specsplit.model.attention import attend
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.config import ModelConfig
from specsplit.model.fused import (
    TRITON_ROPE,
    add_rms_norm,
    rms_norm,
    rope_and_store,
    silu_and_mul,
)
from specsplit.model.linear import linear
from specsplit.model.rope import rope_cos_sin, rope_inv_freq

_META = torch.device("meta")
# Steps of a few tokens on a GPU run each layer as 5 kernels, 6 with split-KV attention
# (DecoderLayer.forward_small: the projections with their norms, residual adds, SiLU-and-mul, and
# RoPE + K/V store fused in, specsplit/kernels/small_linear.py; one more where q/k norms keep RoPE
# out of the qkv kernel) where `forward` takes 9 (10), when every layer weight is at most
# SMALL_LINEAR_MAX_WEIGHT_BYTES: a projection that reads that little is bound by launches and
# latency, which the fusion saves; a larger one (1B-class and up) is bound by bandwidth, where
# cuBLAS is hard to beat and launches matter less. SMALL_LINEAR_ROWS is the most tokens a step may
# have: the kernels' broadcast path up to 4 rows (launched with programmatic dependent launch:
# SmolLM2 decode at batch 1 0.52 ms on an H200, 0.69 without, 1.20 unfused on an H100), their
# tensor-core path at 5-16 rows (decode at batch 8 on an H200: 0.94x / 0.91x the unfused step,
# alternating in one process, bench/step_ab.py; slower than cuBLAS on an H100 before RoPE was
# fused in). `SPECSPLIT_SMALL_LINEAR=0` turns the path off; a missing triton too.
# `SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS=8` (16, 32) moves the broadcast path's limit (slower
# above 4 rows: 1.17 / 2.62 / 8.12 ms a decode step at batch 8 / 16 / 32 against 1.02 / 1.08 / 1.15
# unfused on an H200); `SPECSPLIT_SMALL_LINEAR_DOT_ROWS=32` lets the tensor-core path take 17-32
# rows (within the spread at batch 32).
_SMALL_LINEAR_ENV = os.environ.get("SPECSPLIT_SMALL_LINEAR", "1")
SMALL_LINEAR = _SMALL_LINEAR_ENV != "0" and importlib.util.find_spec("triton") is not None
SMALL_LINEAR_ROWS = MAX_ROWS
SMALL_LINEAR_MAX_WEIGHT_BYTES = 16 << 20


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str = _META) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]

        def weights(n_in: int, n_out: int, bias: bool) -> nn.Linear:
            return nn.Linear(n_in, n_out, bias=bias, device=_META)

        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.qkv_proj = weights(config.hidden_size, q_size + 2 * kv_size, config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, eps) if config.qk_norm else None
        self.o_proj = weights(q_size, config.hidden_size, config.o_proj_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.gate_up_proj = weights(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias
        )
        self.down_proj = weights(config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden] the residual stream
        normed: torch.Tensor,  # [T, hidden] input_layernorm(hidden)
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        batch: ForwardBatch,
        kv: KVCache,
        next_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output (the residual stream) and, with `next_norm` (the next layer's
        input_layernorm), that norm of it, fused with the last residual add."""
        attn = self._attention(_project(self.qkv_proj, normed), cos, sin, batch, kv)
        attn = _project(self.o_proj, attn)
        norm = self.post_attention_layernorm
        hidden, normed = add_rms_norm(attn, hidden, norm.weight, norm.eps)
        mlp = _project(self.down_proj, silu_and_mul(_project(self.gate_up_proj, normed)))
        if next_norm is None:
            return hidden + mlp, None
        return add_rms_norm(mlp, hidden, next_norm.weight, next_norm.eps)

    def forward_small(
        self,
        hidden: torch.Tensor,  # [T <= MAX_ROWS, hidden] the residual stream
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        """`forward`'s arithmetic for a few tokens, each projection one kernel with its
        neighbours fused in (the input norm, the residual adds, the post-attention norm and
        SiLU-and-mul; RoPE and the K/V store in the qkv kernel where no q/k norm comes between
        and the cache holds the activation dtype): the layer's output, [T, hidden]."""
        norm, qkv_proj = self.input_layernorm, self.qkv_proj
        if self.q_norm is None and TRITON_ROPE and kv.data.dtype == hidden.dtype:
            # the projection, RoPE and the K/V store as one kernel
            k_cache, v_cache = kv.k[self.layer_index], kv.v[self.layer_index]
            rope = RopeStore(cos, sin, k_cache, v_cache, batch.slot_mapping, self.num_heads)
            q = norm_linear_rope_store(
                hidden, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias, rope
            )
            attn = self._attend(q.view(q.shape[0], self.num_heads, self.head_dim), batch, kv)
        else:
            qkv = norm_linear(hidden, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias)
            attn = self._attention(qkv, cos, sin, batch, kv)
        hidden = linear_residual(attn, self.o_proj.weight, self.o_proj.bias, hidden)
        norm, gate_up = self.post_attention_layernorm, self.gate_up_proj
        act = norm_linear_silu_mul(hidden, norm.weight, norm.eps, gate_up.weight, gate_up.bias)
        return linear_residual(act, self.down_proj.weight, self.down_proj.bias, hidden)

    def _attention(
        self,
        qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim], projected
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        """[T, num_heads * head_dim] attention output, before o_proj."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        k_cache = kv.k[self.layer_index]  # [num_slots, num_kv_heads, head_dim]
        v_cache = kv.v[self.layer_index]
        q = rope_and_store(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping)
        return self._attend(q, batch, kv)

    def _attend(self, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """[T, num_heads * head_dim] attention of q [T, num_heads, head_dim] (RoPE applied, this
        step's K/V in the cache)."""
        k_cache, v_cache = kv.k[self.layer_index], kv.v[self.layer_index]
        out = attend(q, k_cache, v_cache, batch)  # [T, num_heads, head_dim]
        return out.view(q.shape[0], self.num_heads * self.head_dim)


def _project(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, layer.weight, layer.bias)


class LlamaModel(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder. Parameters start on the meta device: build
    one with `LlamaModel.from_state_dict` (the loader does) or `truncated`."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        shape = (config.vocab_size, config.hidden_size)  # (given: a meta normal_ costs ~0.9 s)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape, device=_META))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, device=_META
            )
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        layer: DecoderLayer = self.layers[0]  # type: ignore[assignment]
        projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        self.max_layer_weight_numel = max(proj.weight.numel() for proj in projections)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        device: torch.device | str,
    ) -> LlamaModel:
        """Adopt tensors named as in this module's docstring (no copy: they are assigned)."""
        model = cls(config, device)
        model.load_state_dict(state_dict, strict=True, assign=True)
        model.requires_grad_(False)
        return model.eval()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def uses_small_linear(self, num_tokens: int, device: torch.device) -> bool:
        """Whether a step of `num_tokens` runs the layers' `forward_small` (see SMALL_LINEAR):
        on a GPU, at most SMALL_LINEAR_ROWS tokens, every layer weight at most
        SMALL_LINEAR_MAX_WEIGHT_BYTES. The CPU always runs `forward`, the reference."""
        weight_bytes = self.max_layer_weight_numel * self.dtype.itemsize
        return (
            SMALL_LINEAR
            and device.type == "cuda"
            and 0 < num_tokens <= SMALL_LINEAR_ROWS
            and weight_bytes <= SMALL_LINEAR_MAX_WEIGHT_BYTES
        )

    def truncated(self, num_layers: int) -> LlamaModel:
        """The first `num_layers` decoder layers + final norm + lm_head, sharing weights (a cheap
        self-draft). It needs its own KVCache (make_kv_cache with its config)."""
        assert 0 < num_layers <= self.config.num_layers, (num_layers, self.config.num_layers)
        model = LlamaModel(replace(self.config, num_layers=num_layers), self.inv_freq.device)
        model.embed_tokens = self.embed_tokens
        model.layers = nn.ModuleList(self.layers[:num_layers])
        model.norm = self.norm
        model.lm_head = self.lm_head
        return model.eval()

    def _torch_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        kv: KVCache, small: bool, aux_layers: tuple[int, ...], aux: dict[int, torch.Tensor],
        hidden_rows: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """`hidden` through the decoder layers in torch (the fused small-linear path where
        `small`), each asked layer's `hidden_rows` put in `aux`."""
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        normed = None if small else layers[0].input_layernorm(hidden)
        for index, decoder_layer in enumerate(layers):
            if small:
                hidden = decoder_layer.forward_small(hidden, cos, sin, batch, kv)
            else:
                next_norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else None
                assert normed is not None
                hidden, normed = decoder_layer(hidden, normed, cos, sin, batch, kv, next_norm)
            if index in aux_layers:
                aux[index] = hidden[hidden_rows]
        return hidden

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, aux_layers: tuple[int, ...] = ()
    ) -> ForwardOutput:
        """Write this step's K/V into `kv` at `batch.slot_mapping` and return float32 logits
        [L, vocab] for rows `batch.logit_indices`, plus, when `aux_layers` is given, those
        hidden states concatenated for rows `batch.hidden_indices` (default: the logit rows):
        [H, len(aux_layers) * hidden]. Index i < num_layers is
        decoder layer i's output (pre final norm); i == num_layers is the last hidden state after
        the final norm (what lm_head reads; EAGLE-1/2 heads draft from it)."""
        assert len(kv.k) >= len(self.layers), (len(kv.k), len(self.layers))
        for layer in aux_layers:
            assert 0 <= layer <= len(self.layers), (layer, len(self.layers))
        hidden = self.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, hidden.dtype)
        aux: dict[int, torch.Tensor] = {}
        hidden_rows = batch.logit_indices if batch.hidden_indices is None else batch.hidden_indices
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        small = self.uses_small_linear(hidden.shape[0], hidden.device)
        if not small and layers and cpu_layer.usable(hidden, kv.data.dtype, self.config.head_dim):
            # the CPU's layers in C, a run of them a call (model/cpu_layer.py)
            on_cpu = cpu_layer.CpuStep(batch, cos, sin, layers[0], kv.k[0])
            hidden = hidden.contiguous()
            for start, stop in cpu_layer.layer_runs(len(layers), aux_layers):
                on_cpu.run(layers[start:stop], hidden, kv.k[start:stop], kv.v[start:stop])
                if stop - 1 in aux_layers:
                    aux[stop - 1] = hidden[hidden_rows]
        else:
            hidden = self._torch_layers(
                hidden, cos, sin, batch, kv, small, aux_layers, aux, hidden_rows
            )
        last = self.norm(hidden[batch.logit_indices])  # [L, hidden]
        if len(self.layers) in aux_layers:
            aux[len(self.layers)] = (
                last if hidden_rows is batch.logit_indices else self.norm(hidden[hidden_rows])
            )
        logits = linear(last, self.lm_head_weight).float()  # [L, vocab]
        hidden_states = torch.cat([aux[i] for i in aux_layers], dim=-1) if aux_layers else None
        return ForwardOutput(logits=logits, hidden_states=hidden_states)


def state_dict_from_hf(
    config: ModelConfig,
    hf_state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Rename (and fuse) a transformers CausalLM state dict into ours, cast to `dtype` on
    `device`. Layers at index >= config.num_layers are skipped (truncated loading)."""

    def take(name: str) -> torch.Tensor:
        return hf_state_dict[name].detach().to(device=device, dtype=dtype)

    def fuse(names: list[str]) -> torch.Tensor:
        return torch.cat([take(name) for name in names], dim=0)

    ours = {"embed_tokens.weight": take("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        hf, mine = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        suffixes = ["weight", "bias"] if config.attention_bias else ["weight"]
        for suffix in suffixes:
            ours[mine + "qkv_proj." + suffix] = fuse([f"{attn}{p}_proj.{suffix}" for p in "qkv"])
        suffixes = ["weight", "bias"] if config.o_proj_bias else ["weight"]
        for suffix in suffixes:
            ours[mine + "o_proj." + suffix] = take(f"{attn}o_proj.{suffix}")
        if config.qk_norm:
            ours[mine + "q_norm.weight"] = take(attn + "q_norm.weight")
            ours[mine + "k_norm.weight"] = take(attn + "k_norm.weight")
        suffixes = ["weight", "bias"] if config.mlp_bias else ["weight"]
        for suffix in suffixes:
            gate_up = [f"{mlp}gate_proj.{suffix}", f"{mlp}up_proj.{suffix}"]
            ours[mine + "gate_up_proj." + suffix] = fuse(gate_up)
            ours[mine + "down_proj." + suffix] = take(f"{mlp}down_proj.{suffix}")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            ours[f"{mine}{norm}.weight"] = take(f"{hf}{norm}.weight")
    ours["norm.weight"] = take("model.norm.weight")
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = take("lm_head.weight")
    return ours


def make_kv_cache(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    heads_outer: bool | None = None,
) -> KVCache:
    """A paged cache shaped for `config` (its num_layers: a truncated model's cache is smaller).
    Memory: 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim * dtype size.
    `heads_outer`: KVCache's (default: on the CPU)."""
    return KVCache(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_pages=num_pages,
        page_size=page_size,
        dtype=dtype,
        device=device,
        heads_outer=heads_outer,
    )


def kv_cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V per cached token over all layers (for sizing num_pages)."""
    return kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
