"""EAGLE draft heads in their published checkpoint layouts, run on our paged KV cache.

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

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from specsplit.kv_cache import KVCache
from specsplit.model.attention import attend
from specsplit.model.batch import ForwardBatch
from specsplit.model.config import read_rope
from specsplit.model.fused import rms_norm
from specsplit.model.linear import linear
from specsplit.model.llama import LlamaModel
from specsplit.model.rope import apply_rotary, rope_cos_sin, rope_inv_freq

log = logging.getLogger(__name__)

HEAD_WEIGHTS = "model.safetensors"
LAYOUTS = ("eagle3", "eagle")  # EAGLE-3; EAGLE-1/2 (one layer on the target's last hidden state)
_LAYER = "midlayer."  # the decoder layer's prefix in Eagle3Head.w


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers (SGLang's default): early, middle, late; clamped for tiny models."""
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4))


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


class Eagle3Head:
    """An EAGLE head of either layout. Weights as plain tensors named as in the module docstring
    (the layer under `midlayer.`, lm_head.weight always present); no nn.Module: nothing trains."""

    def __init__(
        self, config: Eagle3Config, weights: dict[str, torch.Tensor], embed: torch.Tensor
    ) -> None:
        self.config = config
        self.w = weights
        self.embed = embed  # [V, H]
        _check_weights(config, weights, embed)
        self.d2t = weights.get("d2t")  # [Vd] int64 or None (same vocabulary)
        c = config
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(embed.device)

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
        c, w, p = self.config, self.w, _LAYER
        eps = c.rms_norm_eps
        x, residual = self._layer_input(self.embed[batch.input_ids], features)
        h = residual + self._attention(x, batch, kv)  # [T, H]
        y = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = linear(y, w[p + "mlp.gate_proj.weight"])
        up = linear(y, w[p + "mlp.up_proj.weight"])
        out = h + linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])  # [T, H]
        last = out[batch.logit_indices]  # [L, H]
        normed = rms_norm(last, w["norm.weight"], eps) if c.layout == "eagle3" else last
        return linear(normed, w["lm_head.weight"]).float(), last

    def _layer_input(
        self, emb: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, features [T, H] -> the attention's input ([T, 2H] EAGLE-3, [T, H] EAGLE-1/2) and
        the residual [T, H]."""
        c, w, p = self.config, self.w, _LAYER
        eps = c.rms_norm_eps
        if c.layout == "eagle3":
            hidden = rms_norm(features, w[p + "hidden_norm.weight"], eps)
            x = torch.cat([rms_norm(emb, w[p + "input_layernorm.weight"], eps), hidden], dim=-1)
            return x, hidden if c.norm_before_residual else features
        fused = linear(torch.cat([emb, features], dim=-1), w["fc.weight"], w.get("fc.bias"))
        norm = w.get(p + "input_layernorm.weight")
        return (fused if norm is None else rms_norm(fused, norm, eps)), fused

    def _attention(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        c, p = self.config, _LAYER + "self_attn."
        t = x.shape[0]
        q = linear(x, self.w[p + "q_proj.weight"]).view(t, c.num_heads, c.head_dim)
        k = linear(x, self.w[p + "k_proj.weight"]).view(t, c.num_kv_heads, c.head_dim)
        v = linear(x, self.w[p + "v_proj.weight"]).view(t, c.num_kv_heads, c.head_dim)
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv.k[0].index_copy_(0, batch.slot_mapping, k.to(kv.k[0].dtype))
        kv.v[0].index_copy_(0, batch.slot_mapping, v.to(kv.v[0].dtype))
        out = attend(q, kv.k[0], kv.v[0], batch)  # [T, heads, D]
        return linear(out.view(t, -1), self.w[p + "o_proj.weight"])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[L, Vd] -> [L, V]: draft logits scattered to target ids, -inf elsewhere."""
        if self.d2t is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        ids = self.to_target_ids(torch.arange(logits.shape[1], device=logits.device))
        full[:, ids] = logits
        return full

    def make_kv_cache(self, num_pages: int, page_size: int) -> KVCache:
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, num_pages, page_size, self.dtype, self.device)


def _check_weights(c: Eagle3Config, w: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
    """ValueError for a missing or misshapen tensor; a warning for tensors the head ignores."""
    h, inter, p = c.hidden_size, c.intermediate_size, _LAYER
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


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / HEAD_WEIGHTS).exists():
        from safetensors.torch import load_file

        return load_file(str(directory / HEAD_WEIGHTS))
    return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def _layer_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`layers.0.` -> `midlayer.`; a head with more layers is refused."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("layers.0."):
            name = _LAYER + name.removeprefix("layers.0.")
        elif name.startswith(("layers.", "midlayers.")):
            raise ValueError(f"{name}: only single-layer EAGLE heads are supported")
        out[name] = tensor
    return out


def load_eagle3(
    head_path: str,
    target_path: str | None,
    dtype: torch.dtype,
    device: str | torch.device,
    target: LlamaModel | None = None,
) -> Eagle3Head:
    """The head at `head_path`, EAGLE-3 or EAGLE-1/2 (detect_layout); the token embedding and
    lm_head are the target's (`target`, else loaded from `target_path`) where the head has none."""
    if target is None:
        assert target_path is not None, "load_eagle3 needs the target or its path"
        from specsplit.model.loader import load_model

        target, _ = load_model(target_path, dtype=dtype, device="cpu")
    directory = Path(head_path)
    raw = json.loads((directory / "config.json").read_text())
    tensors = _read_tensors(directory)
    layout = detect_layout(raw, tensors)
    config = Eagle3Config.from_json(raw, target.config.num_layers, layout)
    if config.target_hidden_size != target.config.hidden_size:
        raise ValueError(
            f"EAGLE head for a target of width {config.target_hidden_size}, "
            f"the target has {target.config.hidden_size}"
        )
    tensors = _layer_names(tensors)
    tensors.pop("t2d", None)
    tensors.setdefault("embed_tokens.weight", target.embed_tokens.weight.detach())
    tensors.setdefault("lm_head.weight", target.lm_head_weight.detach())
    weights = {
        name: tensor.to(device=device, dtype=torch.int64 if name == "d2t" else dtype)
        for name, tensor in tensors.items()
    }
    embed = weights.pop("embed_tokens.weight")
    return Eagle3Head(config, weights, embed)


# -- random heads for tests ---------------------------------------------------------------------


class _Random:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    def ones(self, n: int) -> torch.Tensor:
        return 1.0 + self.randn(n, scale=0.05)

    def attention_mlp(self, prefix: str, hidden: int, attn_in: int) -> dict[str, torch.Tensor]:
        """q/k/v/o (4 heads, 2 KV heads) and the MLP (intermediate 2 * hidden) of a layer."""
        head_dim, inter = hidden // 4, 2 * hidden
        a, m = prefix + "self_attn.", prefix + "mlp."
        return {
            a + "q_proj.weight": self.randn(4 * head_dim, attn_in),
            a + "k_proj.weight": self.randn(2 * head_dim, attn_in),
            a + "v_proj.weight": self.randn(2 * head_dim, attn_in),
            a + "o_proj.weight": self.randn(hidden, 4 * head_dim),
            m + "gate_proj.weight": self.randn(inter, hidden),
            m + "up_proj.weight": self.randn(inter, hidden),
            m + "down_proj.weight": self.randn(hidden, inter),
        }


def _llama_json(target_config: Any, architecture: str) -> dict[str, Any]:
    """The Llama config of a random head: one layer shaped as `attention_mlp` makes it."""
    hidden = target_config.hidden_size
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "rms_norm_eps": target_config.rms_norm_eps,
        "rope_theta": target_config.rope_theta,
        "vocab_size": target_config.vocab_size,
        "max_position_embeddings": target_config.max_position_embeddings,
    }


def _save_head(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / HEAD_WEIGHTS))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def save_random_eagle3(
    path: Path,
    target_config: Any,
    seed: int,
    draft_vocab_size: int | None = None,
    *,
    prefix: str = "midlayer.",
    norm_before_residual: bool = False,
    embed: bool = False,
) -> Path:
    """A random EAGLE-3 head for `target_config` (our ModelConfig) in the published layout. With a
    draft_vocab_size, the draft vocabulary is a random subset of the target's (d2t, t2d).
    `prefix`: the layer's name ("layers.0." as vLLM writes it); `embed`: its own embed_tokens."""
    r = _Random(seed)
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    draft_vocab = draft_vocab_size or vocab
    tensors = {
        "fc.weight": r.randn(hidden, 3 * hidden),
        prefix + "input_layernorm.weight": r.ones(hidden),
        prefix + "hidden_norm.weight": r.ones(hidden),
        prefix + "post_attention_layernorm.weight": r.ones(hidden),
        **r.attention_mlp(prefix, hidden, 2 * hidden),
        "norm.weight": r.ones(hidden),
        "lm_head.weight": r.randn(draft_vocab, hidden, scale=1.0),
    }
    if draft_vocab != vocab:
        kept = torch.randperm(vocab, generator=r.gen)[:draft_vocab].sort().values  # target ids
        tensors["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        tensors["t2d"] = t2d
    if embed:
        tensors["embed_tokens.weight"] = r.randn(vocab, hidden, scale=1.0)
    aux = list(default_aux_layers(target_config.num_layers))
    config = {
        **_llama_json(target_config, "LlamaForCausalLMEagle3"),
        "target_hidden_size": hidden,
        "draft_vocab_size": draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux},
    }
    if norm_before_residual:
        config["norm_before_residual"] = True
    return _save_head(path, tensors, config)


def save_random_eagle(
    path: Path,
    target_config: Any,
    seed: int,
    *,
    fc_bias: bool = True,
    input_layernorm: bool = False,
    embed: bool = False,
) -> Path:
    """A random EAGLE-1/2 head (cnets1.py's layout, config architectures LlamaForCausalLM as
    EAGLE publishes them) for `target_config`: no lm_head, no final norm; `input_layernorm`, `embed`
    (its own embed_tokens) and `fc_bias` as some checkpoints have them."""
    r = _Random(seed)
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    tensors = {"fc.weight": r.randn(hidden, 2 * hidden)}
    if fc_bias:
        tensors["fc.bias"] = r.randn(hidden)
    if input_layernorm:
        tensors["layers.0.input_layernorm.weight"] = r.ones(hidden)
    tensors["layers.0.post_attention_layernorm.weight"] = r.ones(hidden)
    tensors.update(r.attention_mlp("layers.0.", hidden, hidden))
    if embed:
        tensors["embed_tokens.weight"] = r.randn(vocab, hidden, scale=1.0)
    config = {**_llama_json(target_config, "LlamaForCausalLM"), "bias": fc_bias}
    return _save_head(path, tensors, config)
