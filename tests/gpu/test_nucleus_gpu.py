"""On a CUDA device: the top-k / top-p threshold kernel equals its sort-based reference at
real vocabularies (SmolLM2's 49152, Llama 3's 128256), for a sampled round's rows of mixed
cuts, and inside target_probs_rows (the sampled acceptance graphs' path). Skipped where there
is no GPU (CI)."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.nucleus import cut_thresholds, cut_thresholds_reference
from specsplit.sampling import SamplingParams, target_probs, target_probs_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_kernel_equals_the_reference_at_real_vocabularies(vocab: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, device="cuda", generator=gen)
    logits *= torch.linspace(0.2, 8.0, rows, device="cuda")[:, None]
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.tensor([0, 1, 20, 50, 1000, vocab] * 10 + [0] * 4, device="cuda")
    top_p = torch.tensor([1.0, 0.9, 0.95, 0.5, 0.99, 0.7, 0.8, 1.0] * 8, device="cuda")
    got = cut_thresholds(probs, top_k, top_p)
    want = cut_thresholds_reference(probs, top_k, top_p)
    counted = top_p >= 1  # top-k alone counts tokens: exact
    assert torch.equal(got[counted], want[counted])
    # top-p sums a row's mass in float32, in another order than torch's: a boundary token may
    # fall either side, never more than its own mass
    kept_got = (probs * (probs >= got[:, None])).sum(dim=-1)
    kept_want = (probs * (probs >= want[:, None])).sum(dim=-1)
    assert (kept_got - kept_want).abs().max() < 1e-4
    assert (got == want).float().mean() > 0.9


def test_target_probs_rows_cut_as_target_probs_on_the_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = 3 * torch.randn(4, 49152, device="cuda", generator=gen)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=1.2, top_k=100, top_p=0.8),
        SamplingParams(temperature=1.0),
    ]
    got = target_probs_rows(
        logits,
        torch.tensor([p.temperature for p in params], device="cuda"),
        torch.tensor([p.top_k for p in params], device="cuda"),
        torch.tensor([p.top_p for p in params], device="cuda", dtype=torch.float64),
    )
    for i, p in enumerate(params):
        want = target_probs(logits[i : i + 1], p)[0]
        assert torch.equal(got[i] > 0, want > 0), p
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-4)
