"""EAGLE draft heads' published checkpoint layouts: detection, config, weight checks, reading.

A head is a directory: config.json + model.safetensors or pytorch_model.bin. H = the head's hidden
size, Ht = the target's, V = the target vocabulary, Vd = draft_vocab_size. The head's one decoder
layer is `midlayer.` here; checkpoints may name it `layers.0.` (both are read). The layout is
detected from the checkpoint (`detect_layout`).

EAGLE-3, layout "eagle3" (SafeAILab/EAGLE cnets.py; SGLang and vLLM llama_eagle3.py):

    fc.weight                                   [H, 3 * Ht]   fuses three target layers' outputs
    fc.bias (optional)                          [H]
    midlayer.input_layernorm.weight             [H]           on the token embedding
    midlayer.hidden_norm.weight                 [H]           on the fused feature
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * head_dim, 2 * H]  input cat(emb, feature)
    midlayer.self_attn.o_proj.weight            [H, heads * head_dim]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [Vd, H] (absent: the target's, Vd = V)
    d2t (optional)                              [Vd] int64: target id = draft id + d2t[draft id]
    t2d (ignored), embed_tokens.weight (optional) [V, H]; else the target's `embed_tokens`

    residual = feature, or hidden_norm(feature) with config `norm_before_residual: true`;
    x = cat(input_ln(emb), hidden_norm(feature)); h = residual + o_proj(attn(x));
    out = h + mlp(post_ln(h)); logits = lm_head(norm(out)).

EAGLE-1/2, layout "eagle" (SafeAILab/EAGLE cnets1.py; SGLang llama_eagle.py, vLLM
llama_eagle.py): a Llama config with num_hidden_layers 1. The feature is the target's last hidden
state after its final norm (aux layer index = the target's num_layers, see LlamaModel.forward).

    fc.weight [H, 2 * H], fc.bias (optional) [H]   on cat(emb, feature)
    layers.0.self_attn.{q,k,v}_proj.weight      [heads * head_dim, H]; o_proj as above
    layers.0.post_attention_layernorm.weight, layers.0.mlp.*   as above
    layers.0.input_layernorm.weight (optional: EAGLE's layer 0 has none)
    embed_tokens.weight, lm_head.weight (optional: else the target's)

    x = fc(cat(emb, feature)); h = x + o_proj(attn(input_ln(x))); out = h + mlp(post_ln(h));
    logits = lm_head(out): no final norm.

Either way `out` is the feature the next draft step reads at a tree node (the head feeds itself
past the target's rows).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specsplit.model.config import default_aux_layers, read_rope

log = logging.getLogger(__name__)

HEAD_WEIGHTS = "model.safetensors"
LAYOUTS = ("eagle3", "eagle")  # EAGLE-3; EAGLE-1/2 (one layer on the target's last hidden state)
HEAD_LAYER = "midlayer."  # the decoder layer's prefix in Eagle3Head.w


def detect_layout(raw: dict[str, Any], names: Iterable[str]) -> str:
    """The layout, "eagle3" or "eagle" (EAGLE-1/2), from config.json (`raw`) and the checkpoint's
    tensor names: EAGLE-3 architectures name it (LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM)
    and only EAGLE-3 has hidden_norm; EAGLE-1/2 heads are published as plain LlamaForCausalLM."""
    names = set(names)
    architectures = " ".join(raw.get("architectures") or []).lower()
    if "eagle3" in architectures or any(n.endswith("hidden_norm.weight") for n in names):
        return "eagle3"
    if "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names:
        return "eagle"
    raise ValueError(
        f"not an EAGLE head: architectures {raw.get('architectures')}, no hidden_norm "
        "(EAGLE-3) and no fc + layers.0 (EAGLE-1/2)"
    )


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    max_position_embeddings: int
    # target layers whose outputs the head reads, side by side: 3 fused ones (EAGLE-3), or
    # (num_target_layers,) = the last hidden state after the final norm (EAGLE-1/2)
    aux_layers: tuple[int, ...]
    layout: str = "eagle3"  # one of LAYOUTS
    norm_before_residual: bool = False  # EAGLE-3 variant: residual = hidden_norm(feature)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def feature_width(self) -> int:
        """Width of one target row the head reads: len(aux_layers) * Ht."""
        return len(self.aux_layers) * self.target_hidden_size

    @classmethod
    def from_json(
        cls, raw: dict[str, Any], num_target_layers: int, layout: str = "eagle3"
    ) -> Eagle3Config:
        assert layout in LAYOUTS, layout
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        if layout == "eagle":
            aux_layers: tuple[int, ...] = (num_target_layers,)  # after the final norm
        else:
            layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            aux_layers = tuple(layers) if layers else default_aux_layers(num_target_layers)
        max_positions = int(raw.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = read_rope(
            SimpleNamespace(**{**raw, "max_position_embeddings": max_positions})
        )
        return cls(
            hidden_size=hidden,
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            max_position_embeddings=max_positions,
            aux_layers=aux_layers,
            layout=layout,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            rope_scaling=rope_scaling,
        )


def check_weights(c: Eagle3Config, w: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
    """ValueError for a missing or misshapen tensor; a warning for tensors the head ignores."""
    h, inter, p = c.hidden_size, c.intermediate_size, HEAD_LAYER
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    eagle3 = c.layout == "eagle3"
    attn_in = 2 * h if eagle3 else h
    if not eagle3 and c.target_hidden_size != h:
        raise ValueError(
            f"EAGLE-1/2 head of width {h} for a target of width {c.target_hidden_size}"
        )
    required = {
        "fc.weight": (h, c.feature_width if eagle3 else 2 * h),
        p + "self_attn.q_proj.weight": (q, attn_in),
        p + "self_attn.k_proj.weight": (kv, attn_in),
        p + "self_attn.v_proj.weight": (kv, attn_in),
        p + "self_attn.o_proj.weight": (h, q),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (c.draft_vocab_size, h),
    }
    optional = {"fc.bias": (h,), "d2t": (c.draft_vocab_size,)}
    norms = {p + "input_layernorm.weight": (h,)}
    if eagle3:
        norms.update({p + "hidden_norm.weight": (h,), "norm.weight": (h,)})
        required.update(norms)
    else:
        optional.update(norms)
    for name, shape in {**required, **optional}.items():
        if name not in w:
            if name in required:
                raise ValueError(f"EAGLE head ({c.layout}): {name} missing")
        elif tuple(w[name].shape) != shape:
            what = f"{name} has shape {tuple(w[name].shape)}, want {shape}"
            if name == "fc.weight" and eagle3:
                what += f": target layers {c.aux_layers} of width {c.target_hidden_size}"
            raise ValueError(f"EAGLE head ({c.layout}): {what}")
    if tuple(embed.shape) != (c.vocab_size, h):
        raise ValueError(f"token embedding {tuple(embed.shape)}, want {(c.vocab_size, h)}")
    if c.draft_vocab_size != c.vocab_size and "d2t" not in w:
        raise ValueError(f"draft vocabulary {c.draft_vocab_size} != {c.vocab_size} without d2t")
    ignored = sorted(set(w) - set(required) - set(optional))
    if ignored:
        log.warning("EAGLE head (%s): ignoring %s", c.layout, ignored)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / HEAD_WEIGHTS).exists():
        from safetensors.torch import load_file

        return load_file(str(directory / HEAD_WEIGHTS))
    return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def layer_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`layers.0.` -> `midlayer.`; a head with more layers is refused."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("layers.0."):
            name = HEAD_LAYER + name.removeprefix("layers.0.")
        elif name.startswith(("layers.", "midlayers.")):
            raise ValueError(f"{name}: only single-layer EAGLE heads are supported")
        out[name] = tensor
    return out
