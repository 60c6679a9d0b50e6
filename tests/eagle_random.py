"""Random EAGLE heads in the published layouts (drafter/eagle_checkpoint.py), for tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from drafter.eagle_checkpoint import HEAD_WEIGHTS
from specsplit.model.config import default_aux_layers


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


def save_target_and_drafters(root: Path, hidden_size: int = 128) -> dict[str, Path]:
    """A tiny random target ("target", 4 layers) and what drafts for it, keyed by drafter kind:
    "model" (a one-layer random Llama) and "eagle3" (a random EAGLE-3 head for it)."""
    from specsplit.model.loader import load_model
    from tests.support import save_tiny_llama

    target = save_tiny_llama(root / "target", seed=0, num_layers=4, hidden_size=hidden_size)
    _, config = load_model(str(target), dtype=torch.float32, device="cpu")
    return {
        "target": target,
        "model": save_tiny_llama(root / "draft", seed=1, num_layers=1, hidden_size=hidden_size),
        # 300 of the target's 512 ids: more than a sampled draw's support (DRAFT_SUPPORT), so a
        # draw reads the head's columns alone (drafter/expansion_maps.py draw_columns)
        "eagle3": save_random_eagle3(root / "head", config, seed=3, draft_vocab_size=300),
    }
