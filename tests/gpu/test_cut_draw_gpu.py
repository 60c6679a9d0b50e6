"""On a CUDA device: the sampled draft's cut-and-draw kernel equals its torch reference at real
vocabularies (an EAGLE-3 head's 32000, SmolLM2's 49152) and the drafter's support (256), for rows
of mixed cuts with the drafter's tail, also replayed from a CUDA graph; and draw_from_cut (which
takes it on a GPU) against the reference's draws. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.cut_draw import cut_draw, cut_draw_reference
from specsplit.sampling import draw_from_cut
from specsplit.tree import DRAFT_SUPPORT, DRAFT_TAIL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rows(vocab: int, rows: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    x = torch.randn(rows, vocab, device="cuda", generator=gen)
    x *= torch.linspace(0.2, 12.0, rows, device="cuda")[:, None]  # flat to peaked
    values = x.topk(DRAFT_SUPPORT, dim=-1).values
    settings = [[1.0, 1.0, 0], [1.0, 0.9, 0], [1.0, 1.0, 20], [1.0, 0.8, 100]] * (rows // 4)
    params = torch.tensor(settings, device="cuda")
    uniforms = torch.rand(rows, device="cuda", generator=gen)
    return values, torch.logsumexp(x, dim=-1), params, uniforms


@pytest.mark.parametrize("vocab", [32000, 49152])
def test_kernel_equals_the_reference_at_real_vocabularies(vocab: int) -> None:
    values, log_norm, params, uniforms = _rows(vocab)
    got_probs, got_pick = cut_draw(values, log_norm, params, uniforms, vocab, DRAFT_TAIL)
    want_probs, want_pick = cut_draw_reference(
        values, log_norm, params, uniforms, vocab, DRAFT_TAIL
    )
    torch.testing.assert_close(got_probs, want_probs, atol=1e-6, rtol=1e-5)
    # float32 sums in another order: a boundary token of the tail or top-p may fall either
    # side, and a uniform on a CDF boundary pick either neighbour
    assert ((got_probs > 0) != (want_probs > 0)).sum() <= 2
    assert (got_pick == want_pick).float().mean() > 0.95
    assert bool((got_probs.gather(1, got_pick[:, None]) > 0).all())


def test_kernel_replays_from_a_cuda_graph() -> None:
    values, log_norm, params, uniforms = _rows(32000, rows=8)
    cut_draw(values, log_norm, params, uniforms, 32000, DRAFT_TAIL)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probs, pick = cut_draw(values, log_norm, params, uniforms, 32000, DRAFT_TAIL)
    for seed in range(3):
        uniforms.copy_(
            torch.rand(8, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        )
        graph.replay()
        want_probs, want_pick = cut_draw(values, log_norm, params, uniforms, 32000, DRAFT_TAIL)
        assert torch.equal(probs, want_probs) and torch.equal(pick, want_pick)


def test_draw_from_cut_on_the_gpu_draws_as_the_reference() -> None:
    """draw_from_cut's draws on a fine grid of uniforms land in proportion to the
    probabilities it returns (the kernel's), which are the reference's."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    logits = 3 * torch.randn(1, 49152, device="cuda", generator=gen)
    row = torch.tensor([[0.8, 0.95, 0.0]], device="cuda")
    grid = (torch.arange(4000, device="cuda") + 0.5) / 4000
    tokens, ids, probs = draw_from_cut(
        logits.expand(4000, -1), row.expand(4000, -1), grid, DRAFT_SUPPORT, DRAFT_TAIL
    )
    x = logits.float() / 0.8
    want, _ = cut_draw_reference(
        x.topk(DRAFT_SUPPORT).values, torch.logsumexp(x, -1), row, grid[:1], 49152, DRAFT_TAIL
    )
    torch.testing.assert_close(probs[0], want[0], atol=1e-6, rtol=1e-5)
    dense = torch.zeros(49152, device="cuda", dtype=torch.float64)
    dense.scatter_(0, ids[0], probs[0].double())
    counts = torch.bincount(tokens, minlength=49152).double() / 4000
    assert (counts - dense).abs().max() < 1e-3 and not counts[dense == 0].any()
