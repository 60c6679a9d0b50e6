"""An EAGLE-3 draft head in the published checkpoint layout, run on our paged KV cache.

Checkpoint (a directory: config.json + model.safetensors or pytorch_model.bin), H = the head's
hidden size (= the target's), Ht = the target's hidden size, V = the target vocabulary,
Vd = draft_vocab_size:

    fc.weight                                   [H, 3 * Ht]   fuses three target layers' outputs
    midlayer.input_layernorm.weight             [H]           on the token embedding
    midlayer.hidden_norm.weight                 [H]           on the fused feature
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * head_dim, 2 * H]  input cat(emb, feature)
    midlayer.self_attn.o_proj.weight            [H, heads * head_dim]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [Vd, H]
    d2t (optional)                              [Vd] int64: target id = draft id + d2t[draft id]
    embed_tokens.weight (optional)              [V, H]; else the target's `embed_tokens`

One decoder layer (the midlayer): residual = feature; x = cat(input_ln(emb), hidden_norm(feature));
h = feature + o_proj(attn(x)); out = h + mlp(post_ln(h)). Logits come from norm(out); `out`
(pre-norm) is the feature of the next draft step (the head feeds itself past the target's rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specsplit.kv_cache import KVCache
from specsplit.model.batch import ForwardBatch
from specsplit.model.llama import LlamaModel, _expand_kv, rms_norm
from specsplit.model.rope import apply_rotary, rope_cos_sin, rope_inv_freq

HEAD_WEIGHTS = "model.safetensors"


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers (SGLang's default): early, middle, late; clamped for tiny models."""
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4))


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
    aux_layers: tuple[int, ...]  # target layers whose outputs are fused (3 of them)

    @classmethod
    def from_json(cls, raw: dict, num_target_layers: int) -> Eagle3Config:  # type: ignore[type-arg]
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        eagle = raw.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden,
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            aux_layers=tuple(layers) if layers else default_aux_layers(num_target_layers),
        )


class Eagle3Head:
    """Weights as plain tensors (no nn.Module: nothing here trains)."""

    def __init__(
        self, config: Eagle3Config, weights: dict[str, torch.Tensor], embed: torch.Tensor
    ) -> None:
        self.config = config
        self.w = weights
        self.embed = embed  # [V, H]
        c = config
        assert embed.shape == (c.vocab_size, c.hidden_size), embed.shape
        assert weights["fc.weight"].shape == (c.hidden_size, 3 * c.target_hidden_size)
        assert weights["lm_head.weight"].shape == (c.draft_vocab_size, c.hidden_size)
        self.d2t = weights.get("d2t")  # [Vd] int64 or None (same vocabulary)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, None).to(embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[T, 3 * Ht] target rows -> [T, H] features."""
        return F.linear(target_features.to(self.dtype), self.w["fc.weight"])

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        features: torch.Tensor,  # [T, H] (already fused) per query token
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's K/V; returns float32 logits [L, Vd] and pre-norm outputs [L, H] at
        batch.logit_indices."""
        c, w = self.config, self.w
        eps = c.rms_norm_eps
        p = "midlayer."
        emb = self.embed[batch.input_ids]  # [T, H]
        x = torch.cat(
            [
                rms_norm(emb, w[p + "input_layernorm.weight"], eps),
                rms_norm(features, w[p + "hidden_norm.weight"], eps),
            ],
            dim=-1,
        )  # [T, 2H]
        h = features + self._attention(x, batch, kv)
        y = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = F.linear(y, w[p + "mlp.gate_proj.weight"])
        up = F.linear(y, w[p + "mlp.up_proj.weight"])
        out = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])  # [T, H]
        last = out[batch.logit_indices]  # [L, H]
        logits = F.linear(rms_norm(last, w["norm.weight"], eps), w["lm_head.weight"]).float()
        return logits, last

    def _attention(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        c, p = self.config, "midlayer.self_attn."
        t = x.shape[0]
        q = F.linear(x, self.w[p + "q_proj.weight"]).view(t, c.num_heads, c.head_dim)
        k = F.linear(x, self.w[p + "k_proj.weight"]).view(t, c.num_kv_heads, c.head_dim)
        v = F.linear(x, self.w[p + "v_proj.weight"]).view(t, c.num_kv_heads, c.head_dim)
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv.k[0].index_copy_(0, batch.slot_mapping, k.to(kv.k[0].dtype))
        kv.v[0].index_copy_(0, batch.slot_mapping, v.to(kv.v[0].dtype))
        groups = c.num_heads // c.num_kv_heads
        out = torch.empty_like(q)  # [T, heads, D]
        start = 0
        for q_len, slots, mask in zip(batch.q_lens, batch.kv_slots, batch.masks, strict=True):
            q_b = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, D]
            k_b = _expand_kv(kv.k[0][slots], groups).to(q.dtype)
            v_b = _expand_kv(kv.v[0][slots], groups).to(q.dtype)
            o_b = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=mask)
            out[start : start + q_len] = o_b.transpose(0, 1)
            start += q_len
        return F.linear(out.view(t, -1), self.w[p + "o_proj.weight"])

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


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / HEAD_WEIGHTS).exists():
        from safetensors.torch import load_file

        return load_file(str(directory / HEAD_WEIGHTS))
    return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def load_eagle3(
    head_path: str,
    target_path: str | None,
    dtype: torch.dtype,
    device: str | torch.device,
    target: LlamaModel | None = None,
) -> Eagle3Head:
    """The head at `head_path`; token embeddings from the target (`target`, else loaded from
    `target_path`) unless the head has its own."""
    if target is None:
        assert target_path is not None, "load_eagle3 needs the target or its path"
        from specsplit.model.loader import load_model

        target, _ = load_model(target_path, dtype=dtype, device="cpu")
    directory = Path(head_path)
    raw = json.loads((directory / "config.json").read_text())
    tensors = _read_tensors(directory)
    embed, num_target_layers = target.embed_tokens.weight.detach(), target.config.num_layers
    embed = tensors.pop("embed_tokens.weight", embed)
    config = Eagle3Config.from_json(raw, num_target_layers)
    weights = {}
    for name, tensor in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":
            weights[name] = tensor.to(device=device, dtype=torch.int64)
        else:
            weights[name] = tensor.to(device=device, dtype=dtype)
    return Eagle3Head(config, weights, embed.to(device=device, dtype=dtype))


def save_random_eagle3(
    path: Path,
    target_config: object,
    seed: int,
    draft_vocab_size: int | None = None,
) -> Path:
    """A random head for `target_config` (our ModelConfig) in the published layout. With a
    draft_vocab_size, the draft vocabulary is a random subset of the target's (d2t, t2d)."""
    from specsplit.model.config import ModelConfig

    assert isinstance(target_config, ModelConfig)
    gen = torch.Generator().manual_seed(seed)
    hidden = target_config.hidden_size
    heads, kv_heads, head_dim = 4, 2, hidden // 4
    inter = 2 * hidden
    vocab = target_config.vocab_size
    draft_vocab = draft_vocab_size or vocab

    def randn(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def ones(n: int) -> torch.Tensor:
        return 1.0 + randn(n, scale=0.05)

    m = "midlayer."
    tensors = {
        "fc.weight": randn(hidden, 3 * hidden),
        m + "input_layernorm.weight": ones(hidden),
        m + "hidden_norm.weight": ones(hidden),
        m + "post_attention_layernorm.weight": ones(hidden),
        m + "self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
        m + "self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        m + "mlp.gate_proj.weight": randn(inter, hidden),
        m + "mlp.up_proj.weight": randn(inter, hidden),
        m + "mlp.down_proj.weight": randn(hidden, inter),
        "norm.weight": ones(hidden),
        "lm_head.weight": randn(draft_vocab, hidden, scale=1.0),
    }
    if draft_vocab != vocab:
        kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # target ids
        tensors["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        tensors["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": target_config.rms_norm_eps,
        "rope_theta": target_config.rope_theta,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": target_config.max_position_embeddings,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(default_aux_layers(target_config.num_layers))
        },
    }
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / HEAD_WEIGHTS))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
