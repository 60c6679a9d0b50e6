"""The top-k / top-p threshold kernel (specsplit/kernels/nucleus.py) equals its sort-based
reference under the Triton interpreter (float32, the CPU), row by row, for vocabularies below,
at and past one block, top-k and top-p on and off, together, at their extremes, on rows with
zeros and with ties; the threshold keeps what target_probs' sort keeps where probabilities are
distinct, and tied tokens together; the wrapper refuses what it cannot run."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.nucleus import cut_thresholds, cut_thresholds_reference
from specsplit.sampling import SamplingParams, target_probs

pytest.importorskip("triton")


def _rows(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distributions (peaked, flat, with zeros, uniform: all tied) with mixed cuts."""
    gen = torch.Generator().manual_seed(seed)
    settings = [
        (0, 1.0), (1, 1.0), (3, 1.0), (vocab, 1.0), (vocab + 5, 0.9), (0, 0.9), (0, 0.5),
        (0, 1e-9), (5, 0.8), (40, 0.95), (2, 0.3), (0, 0.999),
    ]  # fmt: skip
    logits = (
        torch.randn(len(settings), vocab, generator=gen)
        * torch.tensor([4.0, 1.0, 0.3] * (len(settings) // 3))[:, None]
    )
    probs = torch.softmax(logits, dim=-1)
    probs[3, vocab // 2 :] = 0  # a row with zeros (cut by an earlier top-k)
    probs[3] /= probs[3].sum()
    probs[7] = 1.0 / vocab  # every token tied
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings], dtype=torch.float32)
    return probs, top_k, top_p


@pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py
@pytest.mark.parametrize("vocab", [7, 64, 300, 2048, 2500])
def test_kernel_equals_the_reference(vocab: int) -> None:
    probs, top_k, top_p = _rows(vocab, seed=vocab)
    got = cut_thresholds(probs, top_k, top_p)
    want = cut_thresholds_reference(probs, top_k, top_p)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("seed", range(3))
def test_the_threshold_keeps_what_target_probs_keeps(seed: int) -> None:
    """Distinct probabilities (random logits): the tokens at or above the threshold are the
    ones target_probs' sort keeps, for every cut."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(1, 500, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    for top_k, top_p in [(0, 0.9), (20, 1.0), (20, 0.6), (300, 0.95), (0, 0.2), (1, 0.9)]:
        tau = cut_thresholds_reference(
            probs, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float32)
        )
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        kept = target_probs(logits, params)[0] > 0
        assert torch.equal(probs[0] >= tau, kept), (top_k, top_p)


def test_tied_tokens_at_the_boundary_are_kept_together() -> None:
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    tau = cut_thresholds_reference(
        probs, torch.tensor([2]), torch.tensor([1.0], dtype=torch.float32)
    )
    assert (probs[0] >= tau).tolist() == [True, True, True, True]
    tau = cut_thresholds_reference(
        probs, torch.tensor([0]), torch.tensor([0.5], dtype=torch.float32)
    )
    assert (probs[0] >= tau).tolist() == [True, True, True, True]  # 0.4 before each 0.2
    tau = cut_thresholds_reference(
        probs, torch.tensor([0]), torch.tensor([0.3], dtype=torch.float32)
    )
    assert (probs[0] >= tau).tolist() == [True, False, False, False]


@pytest.mark.usefixtures("triton_interpreter")
def test_wrapper_refuses_what_it_cannot_run() -> None:
    probs = torch.full((2, 8), 0.125)
    k, p = torch.zeros(2, dtype=torch.int64), torch.ones(2)
    with pytest.raises(ValueError, match="float32"):
        cut_thresholds(probs.double(), k, p)
    with pytest.raises(ValueError, match="top_k"):
        cut_thresholds(probs, k[:1], p)
    with pytest.raises(ValueError, match="top_p"):
        cut_thresholds(probs, k, p.double())
    with pytest.raises(ValueError, match="contiguous"):
        cut_thresholds(torch.full((8, 2), 0.5).T, k, p)
