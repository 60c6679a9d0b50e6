"""Rotary position embeddings in the HF convention (rotate_half over the two halves of a head).

HF checkpoints, including GGUF files converted by transformers (which undoes llama.cpp's
interleaved q/k permutation), expect this layout. Frequencies are computed in float32 and the
rotation runs in the activation dtype, as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2], for rope_type default, linear or llama3."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        # Scaling positions by 1/factor is the same as scaling the frequencies.
        return inv_freq / factor
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, factor, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, rope_scaling: dict[str, Any]
) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [T, head_dim] in `dtype`, for int positions [T]."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, head_dim // 2] float32
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """`rope_cos_sin` for every position below `num_positions`, computed once: a step's cos and
    sin are then two kernels (rope_cos_sin is 7, a cost where a small model's forward runs many
    times a round, as an EAGLE head's in a draft tree). The same float32 products, cos and sin as
    rope_cos_sin, so the same values below num_positions; a position past the table takes its
    last row (wrong there, but no fault on a GPU): size it past every position a forward takes."""

    def __init__(self, inv_freq: torch.Tensor, num_positions: int, dtype: torch.dtype) -> None:
        positions = torch.arange(num_positions, device=inv_freq.device)
        cos, sin = rope_cos_sin(positions, inv_freq, dtype)
        self.head_dim = cos.shape[1]
        self.table = torch.cat([cos, sin], dim=1)  # [num_positions, 2 * head_dim]: cos | sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, head_dim] (views of one [T, 2 * head_dim] gather), for int
        positions [T]."""
        both = self.table[positions.clamp(max=self.table.shape[0] - 1)]
        return both[:, : self.head_dim], both[:, self.head_dim :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, num_heads, head_dim] by cos/sin [T, head_dim]."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return x * cos + rotate_half(x) * sin
