"""GGUF's block formats dequantized by torch ops, on the device the weights go to.

The `gguf` package dequantizes with numpy on one core: 223-323 M weights a second on the 2-core
VM, so an 8B GGUF target spends 25-36 s there before its weights reach a GPU (bench/RESULTS.md,
ninety-ninth session). Here a tensor's stored bytes (4.5-8.5 bits a weight) go to the device
and are dequantized there. Each format takes gguf's float32 steps in gguf's order (the block's
float16 scales widened, the integers made float32, then its products and sums one op each, no
fused multiply-add), so the values are gguf's bit for bit on any device
(tests/unit/test_gguf_dequant.py). Formats: BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K (what llama.cpp's common quantizations store); `dequantize` returns None for the others,
which stay gguf's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # values of a K-format super-block


def _f32(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes [start, start + 2) of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _unpack(data: torch.Tensor, width: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Bytes [n, k] in groups of `width`: each group shifted right by each of `shifts` in turn
    and masked -> [n, k x len(shifts)] (gguf's `data.reshape(n, -1, 1, width) >> shifts`)."""
    groups = data.reshape(data.shape[0], -1, 1, width)
    by = torch.tensor(shifts, dtype=torch.uint8, device=data.device).reshape(1, 1, -1, 1)
    return ((groups >> by) & mask).reshape(data.shape[0], -1)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [n, k] in groups of `width`: each group's low nibbles, then its high ones."""
    return _unpack(qs, width, (0, 4), 0x0F)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Each block's `count` bits of its little-endian bytes qh [n, count / 8], bit i at i ->
    [n, count] (0 / 1, int64)."""
    words = qh.to(torch.int64)
    shifts = torch.arange(0, 8 * qh.shape[1], 8, device=qh.device)
    word = (words << shifts).sum(dim=1, keepdim=True)  # (disjoint bits: the sum is their or)
    return (word >> torch.arange(count, device=qh.device)) & 1


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f32(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f32(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f32(blocks, 0), _f32(blocks, 2)
    return d * _nibbles(blocks[:, 4:], 16).float() + m


def _q5(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0 / Q5_1's 5-bit values: 4 bytes of high bits at `start`, then 16 of nibbles."""
    high = _bits(blocks[:, start : start + 4], 32).to(torch.uint8)
    return _nibbles(blocks[:, start + 4 :], 16) | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f32(blocks, 0)
    return d * (_q5(blocks, 2).to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f32(blocks, 0), _f32(blocks, 2)
    return d * _q5(blocks, 4).float() + m


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: each block's 8 sub-block scales and mins times its float16 d and dmin
    ([n, 8, 1] float32 each), from the 12 packed 6-bit bytes at 4 (gguf's get_scale_min)."""
    n = blocks.shape[0]
    d, dmin = _f32(blocks, 0), _f32(blocks, 2)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, mid, top = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = torch.cat([low & 0x3F, (top & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return (d * scales.float()).reshape(n, 8, 1), (dmin * mins.float()).reshape(n, 8, 1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_scales(blocks)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_scales(blocks)
    low = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    high = _unpack(blocks[:, 16:48], 32, tuple(range(8)), 1).reshape(n, 8, 32)
    return (d * (low | (high << 4)).float() - dm).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    high = _unpack(blocks[:, 128:192], 32, (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f32(blocks, 208) * scales).reshape(n, QK_K // 16, 1)
    return (d * q).reshape(n, QK_K)


_FORMATS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.BF16: _bf16,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}


def supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in _FORMATS


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor | None:
    """raw: uint8 [..., row bytes] (GGUF rows of whole blocks, on any device) -> float32
    [..., row values] on its device, gguf's values bit for bit; None for a format not here."""
    fn = _FORMATS.get(qtype)
    if fn is None:
        return None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == torch.uint8 and raw.shape[-1] % type_size == 0, (raw.shape, qtype)
    values = fn(raw.reshape(-1, type_size))
    return values.reshape(*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
