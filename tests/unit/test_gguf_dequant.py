"""specsplit/model/gguf_dequant.py: GGUF's block formats dequantized by torch ops equal the
`gguf` package's numpy values bit for bit (the same float32 steps in the same order), on blocks
of random bytes with finite float16 scales, several rows at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize

from specsplit.model import gguf_dequant
from specsplit.model.gguf_file import _same_first_row

# where each format keeps its float16 scale fields (byte offsets in a block)
SCALES = {
    GGMLQuantizationType.BF16: (),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def random_rows(qtype: GGMLQuantizationType, rows: int, blocks: int, seed: int) -> np.ndarray:
    """uint8 [rows, blocks x type size]: random bytes, finite float16 scales (BF16: finite
    values)."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * blocks, type_size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.BF16:
        values = rng.normal(0, 3, (rows * blocks, type_size // 2)).astype(np.float32)
        data = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    for start in SCALES[qtype]:
        scale = rng.uniform(-0.1, 0.1, rows * blocks).astype(np.float16)
        data[:, start : start + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, blocks * type_size)


def same_bits(got: torch.Tensor, want: np.ndarray) -> bool:
    return got.dtype == torch.float32 and np.array_equal(
        got.numpy().view(np.uint32), np.ascontiguousarray(want, dtype=np.float32).view(np.uint32)
    )


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_each_format_is_ggufs_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    raw = random_rows(qtype, rows=5, blocks=3, seed=int(qtype))
    got = gguf_dequant.dequantize(torch.from_numpy(raw), qtype)
    assert got is not None and got.shape == (5, 3 * GGML_QUANT_SIZES[qtype][0])
    assert same_bits(got, dequantize(raw, qtype))


@pytest.mark.parametrize(
    "qtype",
    [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
     GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.BF16],
    ids=lambda q: q.name,
)  # fmt: skip
def test_quantized_weights_come_back_as_gguf_reads_them(qtype: GGMLQuantizationType) -> None:
    """Weights quantized by gguf (the formats its numpy writes), read back as gguf reads them,
    a 3-D tensor's leading dims kept."""
    weights = np.random.default_rng(1).normal(0, 0.05, (2, 3, 64)).astype(np.float32)
    raw = quantize(weights, qtype)
    got = gguf_dequant.dequantize(torch.from_numpy(raw), qtype)
    assert got is not None and got.shape == (2, 3, 64)
    assert same_bits(got, dequantize(raw, qtype))
    torch.testing.assert_close(got, torch.from_numpy(weights), atol=0.02, rtol=0.0)


def test_other_formats_are_left_to_gguf() -> None:
    assert not gguf_dequant.supported(GGMLQuantizationType.Q2_K)
    raw = torch.zeros(1, GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K][1], dtype=torch.uint8)
    assert gguf_dequant.dequantize(raw, GGMLQuantizationType.Q2_K) is None


def test_a_device_row_unlike_ggufs_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """`GGUFFile.tensor`'s check of a format's first tensor read on a device: its first row
    against gguf's, bit for bit (a difference sends the format back to gguf's numpy)."""
    qtype = GGMLQuantizationType.Q4_K
    raw = random_rows(qtype, rows=3, blocks=2, seed=5)
    values = gguf_dequant.dequantize(torch.from_numpy(raw), qtype)
    assert values is not None
    assert _same_first_row(raw, values, qtype)
    values[0, 7] = torch.nextafter(values[0, 7], torch.tensor(1e9))  # one ulp off
    assert not _same_first_row(raw, values, qtype)
    assert "Q4_K dequantized on cpu differs" in caplog.text
