"""On a CUDA device: the compiled pointwise functions of specsplit/model/fused.py against their
plain-torch references (the CPU path). Skipped where there is no GPU (CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specsplit.model.fused import norm_embed_and_cat, rms_norm, rms_norm_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-ids"])
def test_norm_embed_and_cat_is_its_reference(dtype: torch.dtype, rows: int, strided: bool) -> None:
    """An EAGLE-3 head's layer input in one compiled kernel: the embedding gather, both norms
    and the concatenation, as the reference computes them (token ids may be a column of the
    chains being verified: a strided view)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, vocab, eps = 96, 500, 1e-5
    embed = torch.randn(vocab, hidden, generator=gen, device="cuda").to(dtype)
    features = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    w_embed, w_features = (1 + 0.1 * torch.randn(2, hidden, generator=gen, device="cuda")).to(dtype)
    table = torch.randint(0, vocab, (rows, 3), generator=gen, device="cuda")
    ids = table[:, 1] if strided else table[:, 1].contiguous()
    x, normed = norm_embed_and_cat(features, ids, embed, w_embed, w_features, eps)
    want_normed = rms_norm_reference(features, w_features, eps)
    want_x = torch.cat([rms_norm_reference(embed[ids], w_embed, eps), want_normed], dim=-1)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert x.shape == (rows, 2 * hidden) and normed.shape == (rows, hidden)
    torch.testing.assert_close(x, want_x, **tol)
    torch.testing.assert_close(normed, want_normed, **tol)


def _compile_workers() -> list[str]:
    """Command lines of this process's children that are inductor's compile workers."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # (gone meanwhile)
        if int(fields[1]) == os.getpid() and "compile_worker" in cmdline:
            found.append(cmdline)
    return found


def test_compiled_functions_start_no_compile_workers() -> None:
    """A compiled function's first call on a GPU builds its kernels in this process: inductor's
    pool of worker processes is not started (fused.compile_in_process)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        pytest.skip("the environment chooses the compile threads")
    x = torch.randn(5, 64, device="cuda")
    weight = torch.ones(64, device="cuda")
    with torch.inference_mode():
        torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    assert _compile_workers() == []
