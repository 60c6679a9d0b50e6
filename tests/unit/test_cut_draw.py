"""The sampled draft's cut-and-draw kernel (specsplit/kernels/cut_draw.py) equals its torch
reference under the Triton interpreter (float32, the CPU): supports of one token, below, at and
past a power of two, top-k inside and past the support, top-p and the tail on and off, peaked
and flat rows; each draw lands on a token its own distribution keeps; the wrapper refuses what
it cannot run."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.cut_draw import cut_draw, cut_draw_reference

pytest.importorskip("triton")

# (top_p, top_k) a row: off, top-k inside the support, past it, top-p, both, extreme top-p
SETTINGS = [(1.0, 0), (1.0, 3), (1.0, 10_000), (0.9, 0), (0.5, 5), (1e-9, 0), (0.999, 0)]


def _inputs(support: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    rows = len(SETTINGS) * 2
    scale = torch.tensor([4.0, 0.3]).repeat_interleave(len(SETTINGS))[:, None]  # peaked, flat
    x = torch.randn(rows, vocab, generator=gen) * scale
    values = x.topk(support, dim=-1).values
    params = torch.tensor([[1.0, p, k] for p, k in SETTINGS] * 2, dtype=torch.float32)
    uniforms = torch.rand(rows, generator=gen)
    return values, torch.logsumexp(x, dim=-1), params, uniforms


@pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py
@pytest.mark.parametrize("tail", [0.0, 1e-3, 0.05])
@pytest.mark.parametrize(("support", "vocab"), [(1, 9), (7, 40), (16, 16), (100, 500), (256, 700)])
def test_kernel_equals_the_reference(support: int, vocab: int, tail: float) -> None:
    values, log_norm, params, uniforms = _inputs(support, vocab, seed=support + vocab)
    got_probs, got_pick = cut_draw(values, log_norm, params, uniforms, vocab, tail)
    want_probs, want_pick = cut_draw_reference(values, log_norm, params, uniforms, vocab, tail)
    torch.testing.assert_close(got_probs, want_probs, atol=1e-6, rtol=1e-5)
    assert torch.equal((got_probs > 0), (want_probs > 0))  # the same tokens kept
    # the same draw, but where the uniform sits within float32 rounding of a CDF boundary
    cdf = want_probs.double().cumsum(dim=-1)
    near = ((cdf - uniforms[:, None].double() * cdf[:, -1:]).abs() < 1e-5).any(dim=-1)
    assert torch.equal(got_pick[~near], want_pick[~near])
    kept = got_probs.gather(1, got_pick[:, None]).squeeze(1)
    assert bool((kept > 0).all())  # every draw lands on a token its distribution keeps


@pytest.mark.usefixtures("triton_interpreter")
def test_draws_on_a_fine_grid_land_in_proportion_to_the_kernels_own_probabilities() -> None:
    values, log_norm, params, _ = _inputs(32, 200, seed=1)
    row = 3  # top-p 0.9 on a peaked row
    grid = (torch.arange(4000) + 0.5) / 4000
    many = (values[row].expand(4000, -1).contiguous(), log_norm[row].expand(4000).contiguous())
    probs, pick = cut_draw(*many, params[row].expand(4000, -1).contiguous(), grid, 200, 1e-3)
    counts = torch.bincount(pick, minlength=32).double() / 4000
    assert (counts - probs[0].double()).abs().max() < 1e-3
    assert not counts[probs[0] == 0].any()


@pytest.mark.usefixtures("triton_interpreter")
def test_the_wrapper_refuses_what_it_cannot_run() -> None:
    values, log_norm, params, uniforms = _inputs(8, 50, seed=0)
    with pytest.raises(ValueError, match="values \\[R, S\\] float32"):
        cut_draw(values.double(), log_norm, params, uniforms, 50)
    with pytest.raises(ValueError, match="uniforms \\[R\\]"):
        cut_draw(values, log_norm, params, uniforms[:3], 50)
    with pytest.raises(ValueError, match="0 < S <= vocab_size"):
        cut_draw(values, log_norm, params, uniforms, 4)
    empty = cut_draw(values[:0], log_norm[:0], params[:0], uniforms[:0], 50)
    assert empty[0].shape == (0, 8) and empty[1].shape == (0,)
