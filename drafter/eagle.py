"""An EAGLE draft head (EAGLE-3, or EAGLE-1/2) run on our paged KV cache: its forward and its
loading from a checkpoint (layouts and their formulas: drafter/eagle_checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from drafter.eagle_checkpoint import (
    HEAD_LAYER,
    Eagle3Config,
    check_weights,
    detect_layout,
    layer_names,
    read_tensors,
)
from drafter.expansion_maps import in_vocab
from specsplit.kv_cache import KVCache, kv_bytes_per_token
from specsplit.model import cpu_quant
from specsplit.model.attention import attend
from specsplit.model.batch import ForwardBatch
from specsplit.model.fused import (
    add_rms_norm,
    norm_embed_and_cat,
    rms_norm,
    rope_and_store,
    silu_and_mul,
)
from specsplit.model.linear import linear
from specsplit.model.llama import LlamaModel
from specsplit.model.loader import load_embeddings, packs_weights
from specsplit.model.rope import RopeTable, rope_inv_freq

# positions past the longest context the RoPE table covers: a draft tree's nodes and
# draft-ahead's chain, bonus and tree past a sequence's last token (TreeLimits: 32 steps each)
ROPE_TABLE_MARGIN = 256


class Eagle3Head:
    """An EAGLE head of either layout. Weights as plain tensors named as in the module docstring
    (the layer under `midlayer.`, lm_head.weight always present); no nn.Module: nothing trains."""

    def __init__(
        self,
        config: Eagle3Config,
        weights: dict[str, torch.Tensor],
        embed: torch.Tensor,
        target_context: int = 0,
    ) -> None:
        """target_context: the target's longest context (its max_position_embeddings), which
        the drafter's sequences can reach where it is longer than the head's."""
        self.config = config
        self.w = weights
        self.embed = embed  # [V, H]
        check_weights(config, weights, embed)
        self.d2t = weights.get("d2t")  # [Vd] int64 or None (same vocabulary)
        # [Vd] each draft token's target id, made once (a draft round maps its roots' logits)
        self.target_ids = None
        if self.d2t is not None:
            self.target_ids = self.to_target_ids(
                torch.arange(len(self.d2t), device=self.d2t.device)
            )
        c = config
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(embed.device)
        num_positions = max(c.max_position_embeddings, target_context) + ROPE_TABLE_MARGIN
        self.rope = RopeTable(self.inv_freq, num_positions, self.dtype)
        # q, k and v as one projection, gate and up as another (one GEMM each); the named
        # weights become views of them (the same values, no second copy)
        self.qkv_weight = self._fuse_rows(
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        )
        self.gate_up_weight = self._fuse_rows(["mlp.gate_proj", "mlp.up_proj"])

    def _fuse_rows(self, names: list[str]) -> torch.Tensor:
        """The layer's weights `names` stacked by rows into one tensor, each name now a view."""
        keys = [f"{HEAD_LAYER}{name}.weight" for name in names]
        fused = torch.cat([self.w[key] for key in keys])
        row = 0
        for key in keys:
            rows = self.w[key].shape[0]
            self.w[key] = fused[row : row + rows]
            row += rows
        return fused

    def matrices(self) -> list[torch.Tensor]:
        """The weights the head multiplies by (`linear`'s), fused ones as fused."""
        names = ["fc.weight", HEAD_LAYER + "self_attn.o_proj.weight", "lm_head.weight"]
        names.append(HEAD_LAYER + "mlp.down_proj.weight")
        return [self.qkv_weight, self.gate_up_weight, *(self.w[n] for n in names if n in self.w)]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[T, feature_width] target rows -> [T, H] features: fc over the aux layers (EAGLE-3);
        the last hidden state as it is (EAGLE-1/2: fc takes it with the embedding in forward)."""
        x = target_features.to(self.dtype)
        if self.config.layout == "eagle":
            return x
        return linear(x, self.w["fc.weight"], self.w.get("fc.bias"))

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        features: torch.Tensor,  # [T, H] per query token: fused target rows or the head's outputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's K/V; returns float32 logits [L, Vd] and the layer outputs [L, H] (the
        next step's features) at batch.logit_indices."""
        c, w, p = self.config, self.w, HEAD_LAYER
        eps = c.rms_norm_eps
        x, residual = self._layer_input(batch.input_ids, features)
        attn = self._attention(x, batch, kv)
        h, y = add_rms_norm(attn, residual, w[p + "post_attention_layernorm.weight"], eps)
        act = silu_and_mul(linear(y, self.gate_up_weight))
        out = h + linear(act, w[p + "mlp.down_proj.weight"])  # [T, H]
        last = out[batch.logit_indices]  # [L, H]
        normed = rms_norm(last, w["norm.weight"], eps) if c.layout == "eagle3" else last
        return linear(normed, w["lm_head.weight"]).float(), last

    def _layer_input(
        self, input_ids: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens [T] and features [T, H] -> the attention's input ([T, 2H] EAGLE-3, [T, H]
        EAGLE-1/2) and the residual [T, H]."""
        c, w, p = self.config, self.w, HEAD_LAYER
        eps = c.rms_norm_eps
        if c.layout == "eagle3":
            x, hidden = norm_embed_and_cat(
                features,
                input_ids,
                self.embed,
                w[p + "input_layernorm.weight"],
                w[p + "hidden_norm.weight"],
                eps,
            )
            return x, hidden if c.norm_before_residual else features
        emb = self.embed[input_ids]
        fused = linear(torch.cat([emb, features], dim=-1), w["fc.weight"], w.get("fc.bias"))
        norm = w.get(p + "input_layernorm.weight")
        return (fused if norm is None else rms_norm(fused, norm, eps)), fused

    def _attention(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        c, p = self.config, HEAD_LAYER + "self_attn."
        t = x.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = linear(x, self.qkv_weight).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, c.num_heads, c.head_dim)
        k, v = k.view(t, c.num_kv_heads, c.head_dim), v.view(t, c.num_kv_heads, c.head_dim)
        cos, sin = self.rope.cos_sin(batch.positions)
        q = rope_and_store(q, k, v, cos, sin, kv.k[0], kv.v[0], batch.slot_mapping)
        out = attend(q, kv.k[0], kv.v[0], batch)  # [T, heads, D]
        return linear(out.view(t, -1), self.w[p + "o_proj.weight"])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[L, Vd] -> [L, V]: draft logits scattered to target ids, -inf elsewhere."""
        if self.target_ids is None:
            return logits
        return in_vocab(logits, self.target_ids, self.config.vocab_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in the head's one layer."""
        return kv_bytes_per_token(1, self.config.num_kv_heads, self.config.head_dim, self.dtype)

    def make_kv_cache(self, num_pages: int, page_size: int) -> KVCache:
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, num_pages, page_size, self.dtype, self.device)


def load_eagle3(
    head_path: str,
    target_path: str | None,
    dtype: torch.dtype,
    device: str | torch.device,
    target: LlamaModel | None = None,
) -> Eagle3Head:
    """The head at `head_path`, EAGLE-3 or EAGLE-1/2 (detect_layout); the token embedding and
    lm_head are the target's (`target`, else loaded from `target_path`) where the head has none."""
    if target is None:  # (its layers not read: the embedded default's took ~1 s to dequantize)
        assert target_path is not None, "load_eagle3 needs the target or its path"
        target_config, target_embed, target_lm_head = load_embeddings(target_path, dtype)
    else:
        target_config = target.config
        target_embed, target_lm_head = target.embed_tokens.weight, target.lm_head_weight
    directory = Path(head_path)
    raw = json.loads((directory / "config.json").read_text())
    tensors = read_tensors(directory)
    layout = detect_layout(raw, tensors)
    config = Eagle3Config.from_json(raw, target_config.num_layers, layout)
    if config.target_hidden_size != target_config.hidden_size:
        raise ValueError(
            f"EAGLE head for a target of width {config.target_hidden_size}, "
            f"the target has {target_config.hidden_size}"
        )
    tensors = layer_names(tensors)
    tensors.pop("t2d", None)
    tensors.setdefault("embed_tokens.weight", target_embed.detach())
    tensors.setdefault("lm_head.weight", target_lm_head.detach())
    weights = {
        name: tensor.to(device=device, dtype=torch.int64 if name == "d2t" else dtype)
        for name, tensor in tensors.items()
    }
    embed = weights.pop("embed_tokens.weight")
    head = Eagle3Head(config, weights, embed, target_config.max_position_embeddings)
    if packs_weights(dtype, torch.device(device)):  # bfloat16 weights read as such on the CPU
        for weight in head.matrices():
            cpu_quant.attach_bfloat16(weight)
    return head
