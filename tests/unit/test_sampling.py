"""SamplingParams validation and the target distribution (temperature, top-k, top-p)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels.nucleus import TOP_P_SLACK
from specsplit.sampling import (
    SamplingParams,
    draw_from_cut,
    make_generator,
    sample,
    target_probs,
    target_probs_rows,
)


def _logits_of(probs: list[float]) -> torch.Tensor:
    """[1, V] logits whose softmax is `probs`."""
    return torch.tensor(probs, dtype=torch.float64).log()[None].float()


def test_default_params_are_greedy_and_valid() -> None:
    params = SamplingParams()
    params.validate()
    assert params.greedy
    assert not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        (SamplingParams(temperature=1.0, top_p=1.5), "top_p"),
        (SamplingParams(temperature=1.0, top_p=math.nan), "top_p"),
        (SamplingParams(temperature=1.0, top_k=-1), "top_k"),
        (SamplingParams(temperature=1.0, seed=-1), "seed"),
    ],
)
def test_invalid_params_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} ="):
        params.validate()


def test_boundary_params_are_valid() -> None:
    SamplingParams(temperature=2.0, top_p=1.0, top_k=0, seed=0).validate()
    SamplingParams(temperature=1e-3, top_p=1e-9, top_k=1, seed=2**64 - 1).validate()


def test_target_probs_rejects_greedy_params() -> None:
    with pytest.raises(ValueError, match="temperature"):
        target_probs(torch.zeros(1, 4), SamplingParams())


def test_temperature_one_is_softmax() -> None:
    logits = torch.tensor([[0.0, math.log(2.0)], [1.0, 1.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 2 / 3], [0.5, 0.5]]))


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[0.0, math.log(2.0)]])
    # T = 0.5 doubles the logit gap: odds 2 -> 4; T = 2 halves it: odds 2 -> sqrt(2).
    torch.testing.assert_close(
        target_probs(logits, SamplingParams(temperature=0.5)), torch.tensor([[0.2, 0.8]])
    )
    sqrt2 = math.sqrt(2.0)
    torch.testing.assert_close(
        target_probs(logits, SamplingParams(temperature=2.0)),
        torch.tensor([[1 / (1 + sqrt2), sqrt2 / (1 + sqrt2)]]),
    )


def test_top_k_keeps_exactly_k() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 2.5, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs > 0).sum(dim=-1).tolist() == [3, 3]
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1, 3, 4]
    assert (probs[1] > 0).nonzero().flatten().tolist() == [0, 1, 2]
    torch.testing.assert_close(probs[0, [1, 3, 4]], torch.softmax(logits[0, [1, 3, 4]], dim=-1))
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2))


def test_top_k_keeps_exactly_k_under_ties() -> None:
    probs = target_probs(torch.zeros(1, 10), SamplingParams(temperature=1.0, top_k=4))
    assert int((probs > 0).sum()) == 4
    torch.testing.assert_close(probs[probs > 0], torch.full((4,), 0.25))


def test_top_k_at_or_over_vocab_is_off() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    expected = torch.softmax(logits, dim=-1)
    for top_k in (0, 3, 7):
        probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
        torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.5, [0.5]),  # the first token alone reaches 0.5 exactly: nothing else
        (0.75, [0.5, 0.25]),  # boundary: 0.5 + 0.25 reaches 0.75 exactly
        (0.76, [0.5, 0.25, 0.125]),  # just over the boundary pulls in one more token
        (0.3, [0.5]),  # less than the top token's mass: still keeps one token
        (1e-9, [0.5]),
        (1.0, [0.5, 0.25, 0.125, 0.125]),  # off
    ],
)
def test_top_p_boundary(top_p: float, kept: list[float]) -> None:
    logits = _logits_of([0.125, 0.5, 0.125, 0.25])  # sorted: 1 (0.5), 3 (0.25), 0 / 2 (0.125)
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert int((probs > 0).sum()) == len(kept)
    torch.testing.assert_close(
        probs.sort(descending=True).values[: len(kept)],
        torch.tensor(kept) / sum(kept),
    )
    assert probs[1] > 0  # the most likely token is always kept


def test_top_k_then_top_p() -> None:
    # top_k = 3 leaves [0.5, 0.25, 0.125] / 0.875; top_p = 0.8 of that needs 0.5 + 0.25 (0.857).
    logits = _logits_of([0.125, 0.5, 0.125, 0.25])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))[0]
    torch.testing.assert_close(probs, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))


def test_sample_is_reproducible_with_a_seed() -> None:
    probs = torch.softmax(torch.randn(4, 50, generator=make_generator(0)), dim=-1)
    first = sample(probs, make_generator(1234))
    second = sample(probs, make_generator(1234))
    assert first.shape == (4,)
    assert first.dtype == torch.int64
    assert torch.equal(first, second)


def test_sample_never_draws_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3]]).expand(1000, 4)
    tokens = sample(probs, make_generator(7))
    assert set(tokens.tolist()) == {1, 3}


def test_unseeded_generators_differ() -> None:
    draws = {int(torch.randint(2**62, (), generator=make_generator(None))) for _ in range(4)}
    assert len(draws) == 4


def test_target_probs_rows_give_each_rows_target_probs() -> None:
    """Rows of one batch with their own params (greedy, temperature, top-k, top-p, both, and
    a top-k past the vocabulary) are each what target_probs gives that row; without filters
    (no sort) as well where no row cuts."""
    gen = make_generator(7)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.7),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=500),
    ]
    logits = 3 * torch.randn(len(params), 64, generator=gen)
    temperature = torch.tensor([p.temperature for p in params])
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    got = target_probs_rows(logits, temperature, top_k, top_p)
    for i, p in enumerate(params):
        if p.greedy:
            want = F.one_hot(logits[i].argmax(), 64).float()
        else:
            want = target_probs(logits[i : i + 1], p)[0]
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-5)
        assert torch.equal(got[i] > 0, want > 0), params[i]  # the same tokens kept
    plain = [0, 1, 5]  # rows that cut nothing
    unfiltered = target_probs_rows(
        logits[plain], temperature[plain], top_k[plain], top_p[plain], filters=False
    )
    torch.testing.assert_close(unfiltered, got[plain], atol=1e-6, rtol=1e-5)


def test_target_probs_rows_checks_shapes() -> None:
    with pytest.raises(ValueError, match="logits"):
        target_probs_rows(torch.zeros(2, 4), torch.ones(3), torch.zeros(2), torch.ones(2))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.7),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.5),
    ],
    ids=["plain", "top_k", "top_p", "both"],
)
def test_draw_from_cut_draws_target_probs_cut_to_its_support(params: SamplingParams) -> None:
    """The support is target_probs' likeliest `support` tokens, renormalized (the tokens a
    top-k / top-p cuts carry probability 0 in it); uniforms on a
    fine grid land on each token in proportion to its probability, and never on one cut."""
    logits = 2 * torch.randn(1, 64, generator=make_generator(3))
    want = target_probs(logits, params)[0]
    top = want.topk(16)
    row = torch.tensor([[params.temperature, params.top_p, params.top_k]])
    grid = (torch.arange(4000) + 0.5) / 4000
    tokens, ids, probs = draw_from_cut(logits.expand(4000, -1), row.expand(4000, -1), grid, 16)
    kept = top.values > 0  # the order of the cut tokens (probability 0) is any
    assert torch.equal(ids[0][kept], top.indices[kept])
    torch.testing.assert_close(probs[0], top.values / top.values.sum(), atol=1e-6, rtol=1e-5)
    counts = torch.bincount(tokens, minlength=64).double() / 4000
    dense = torch.zeros(64, dtype=torch.float64).scatter_(0, ids[0], probs[0].double())
    assert (counts - dense).abs().max() < 1e-3
    assert not counts[dense == 0].any()


@pytest.mark.parametrize(
    "top_p", [1.0, 0.995, 0.5], ids=["top_p-off", "top_p-wider", "top_p-tighter"]
)
def test_draw_from_cut_with_a_tail_keeps_the_tokens_holding_all_but_it(top_p: float) -> None:
    """tail t: a row keeps its likeliest tokens until they hold 1 - t of the mass (top-p's
    cut where that is tighter), renormalized, and its draws land on those alone, in
    proportion; tail 0 with top-p off keeps the whole support."""
    logits = 4 * torch.randn(1, 64, generator=make_generator(5))
    row = torch.tensor([[1.0, top_p, 0]])
    grid = (torch.arange(4000) + 0.5) / 4000
    tail = 0.01
    tokens, ids, probs = draw_from_cut(
        logits.expand(4000, -1), row.expand(4000, -1), grid, 64, tail
    )
    full = torch.softmax(logits[0].double(), dim=-1).sort(descending=True)
    before = full.values.cumsum(0) - full.values
    bound = min(1.0 - tail, top_p - TOP_P_SLACK if top_p < 1 else math.inf)
    kept = (before < bound) | (torch.arange(64) == 0)
    assert 1 <= int(kept.sum()) < 64  # a peaked row: a few tokens
    assert torch.equal(ids[0][: int(kept.sum())], full.indices[kept])
    want = torch.where(kept, full.values, 0.0)
    torch.testing.assert_close(probs[0].double(), want / want.sum(), atol=1e-6, rtol=1e-5)
    counts = torch.bincount(tokens, minlength=64).double() / 4000
    dense = torch.zeros(64, dtype=torch.float64).scatter_(0, ids[0], probs[0].double())
    assert (counts - dense).abs().max() < 1e-3 and not counts[dense == 0].any()
    if top_p == 1.0:
        _, _, whole = draw_from_cut(logits, row, grid[:1], 64)
        assert bool((whole > 0).all())
