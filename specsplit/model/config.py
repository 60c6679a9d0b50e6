"""The architecture of a Llama-family checkpoint, read once from its transformers config.

Covers Llama (and SmolLM2, which is model_type "llama"), Mistral, Qwen2 (bias on q/k/v) and
Qwen3 (per-head RMSNorm on q and k). Reads both transformers 5.x configs (`rope_parameters`)
and 4.x configs (`rope_theta` + `rope_scaling`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", "factor": ..., ...}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # Llama/Qwen3 with attention_bias also have it; Qwen2 never
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    sliding_window: int | None = None  # not applied by our forward: see loader's warning
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert self.head_dim % 2 == 0, self.head_dim
        assert self.num_layers > 0, self.num_layers
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            assert rope_type in SUPPORTED_ROPE_TYPES and rope_type != "default", self.rope_scaling

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None) -> ModelConfig:
        """Read a transformers config (5.x or 4.x style). EOS ids merge the model config's
        and, when given, the generation config's (chat models often list extra ones there)."""
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: only silu")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_theta, rope_scaling = read_rope(hf_config)
        if model_type == "qwen2":  # Qwen2 configs carry no attention_bias: q/k/v always have one
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = bool(getattr(hf_config, "attention_bias", False))
            o_proj_bias = attention_bias
        eos_ids = _as_ids(getattr(hf_config, "eos_token_id", None))
        if generation_config is not None:
            eos_ids += _as_ids(getattr(generation_config, "eos_token_id", None))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=_read_sliding_window(hf_config),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),  # dedup, keep order
            bos_token_id=getattr(hf_config, "bos_token_id", None),
        )


def read_rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from `rope_parameters` (transformers 5.x) or from
    `rope_theta` + `rope_scaling` (4.x)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None)
    rope_theta = float(theta) if theta is not None else _DEFAULT_ROPE_THETA
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", None) or getattr(
        hf_config, "partial_rotary_factor", None
    )
    if partial not in (None, 1.0):
        raise ValueError(f"unsupported partial_rotary_factor {partial}")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    missing = [key for key in _ROPE_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {missing}")
    scaling: dict[str, Any] = {"rope_type": rope_type}
    scaling.update({key: params[key] for key in _ROPE_KEYS[rope_type]})
    return rope_theta, scaling


def _read_sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if hf_config.model_type == "mistral":
        return window
    if not getattr(hf_config, "use_sliding_window", False):
        return None
    layer_types = getattr(hf_config, "layer_types", None) or []
    return window if "sliding_attention" in layer_types else None


def _as_ids(value: int | list[int] | tuple[int, ...] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers (SGLang's default): early, middle, late; clamped for tiny models.
    The drafter's heads read these unless their config names others; the verifier's warm-up
    captures its hidden-state graphs for them."""
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4))
