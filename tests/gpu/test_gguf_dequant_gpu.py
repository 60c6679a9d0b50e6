"""On a CUDA device: GGUF weights dequantized on the GPU from their stored bytes
(specsplit/model/gguf_dequant.py, `GGUFFile.tensor`) equal gguf's numpy values bit for bit,
each format and a whole file's model loaded on the GPU against the same file loaded on the CPU.
Skipped where there is no GPU (CI)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from specsplit.model import gguf_dequant
from specsplit.model.gguf_file import GGUFFile, GGUFStateDict
from specsplit.model.loader import load_model
from tests.unit.test_gguf_dequant import SCALES, random_rows
from tests.unit.test_gguf_file import _write

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
Q = GGMLQuantizationType
K_SHAPE = {"head_dim": 64, "hidden": 256, "ffn": 512}  # (the K types' 256-weight blocks)


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_each_format_on_the_gpu_is_ggufs_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    raw = random_rows(qtype, rows=64, blocks=4, seed=int(qtype))
    got = gguf_dequant.dequantize(torch.from_numpy(raw).cuda(), qtype)
    assert got is not None and got.is_cuda and got.dtype == torch.float32
    want = np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)
    assert np.array_equal(got.cpu().numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(
    ("qtype", "shape"),
    [(Q.Q8_0, {}), (Q.Q4_1, {}), (Q.Q5_1, {}), (Q.Q4_K, K_SHAPE), (Q.Q6_K, K_SHAPE)],
    ids=lambda v: v.name if isinstance(v, Q) else "",
)  # fmt: skip
def test_a_file_loaded_on_the_gpu_is_the_cpu_load(tmp_path: Path, qtype: Q, shape: dict) -> None:
    path = _write(tmp_path / "model.gguf", "llama", qtype, tied=False, **shape)
    on_gpu, _ = load_model(path, torch.float32, "cuda")
    on_cpu, _ = load_model(path, torch.float32, "cpu")
    gpu_params, cpu_params = dict(on_gpu.named_parameters()), dict(on_cpu.named_parameters())
    assert gpu_params.keys() == cpu_params.keys()
    for name, param in gpu_params.items():
        assert param.is_cuda and torch.equal(param.cpu(), cpu_params[name]), name


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_the_gpu_dequantizes_what_it_can(tmp_path: Path, qtype: Q) -> None:
    """The state dict read for the GPU is the host's, every matrix dequantized there: its
    format's first-row check against gguf passed (no fallback to gguf's numpy)."""
    path = _write(tmp_path / "m.gguf", "llama", qtype, tied=True, head_dim=64, hidden=256, ffn=512)
    with GGUFFile(path) as file:
        on_gpu, on_host = GGUFStateDict(file, 4, 2, "cuda"), GGUFStateDict(file, 4, 2)
        for name in on_gpu:
            assert torch.equal(on_gpu[name].cpu(), on_host[name]), name
        assert file._on_device == {(qtype, "cuda"): True}
