"""The greedy accept-walk Triton kernel (under the interpreter on the CPU) equals its torch
reference (`accept_greedy_batched` + `accepted_kv_moves`, packed): for chains and trees of every
padded width, paths accepted to any depth, nothing accepted, padding sequences (a graph's
bucket), decode rounds (no tree), rows of the round in any order, page sizes 1 and 16; the
wrapper refuses what it cannot run."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.kernels.accept_walk import accept_walk, accept_walk_reference
from verifier.accept_layout import window_pages

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py

SCRATCH = 7  # the scratch slot: every move past the accepted path goes there


def random_round(
    rng: random.Random,
    sizes: list[int],  # each sequence's tree nodes (0: a decode round's)
    width: int,  # N, >= max(sizes): nodes past a tree's end are padding
    page_size: int,
    topk: int,
    padding: int = 0,  # sequences past the batch (a graph's bucket): parents -2, rows 0
    accept_rate: float = 0.7,
) -> dict[str, torch.Tensor]:
    """A round as the acceptance graph's layout holds it: the argmax at each row, each sequence's
    rows (shuffled over the round), draft tokens and parents (padding -2), base and page-table
    window. Each node's token is its parent's argmax with probability `accept_rate` (siblings
    distinct), so paths of every depth come up."""
    batch = len(sizes) + padding
    rows = list(range(sum(n + 1 for n in sizes)))
    rng.shuffle(rows)
    argmax = torch.tensor([rng.randrange(1000) for _ in rows], dtype=torch.int64)
    row_index = torch.zeros(batch, width + 1, dtype=torch.int64)
    draft = torch.zeros(batch, width, dtype=torch.int64)
    parents = torch.full((batch, width), -2, dtype=torch.int64)
    at = 0
    for b, n in enumerate(sizes):
        own = rows[at : at + n + 1]
        at += n + 1
        row_index[b, : n + 1] = torch.tensor(own)
        children: dict[int, list[int]] = {}
        for j in range(n):
            options = [p for p in [-1, *range(j)] if len(children.get(p, [])) < topk]
            parent = rng.choice(options) if topk > 1 else j - 1
            taken = {int(draft[b, c]) for c in children.get(parent, [])}
            target = int(argmax[own[parent + 1]])
            if rng.random() < accept_rate and target not in taken:
                token = target
            else:
                token = rng.choice([t for t in range(1000, 1010) if t not in taken])
            draft[b, j], parents[b, j] = token, parent
            children.setdefault(parent, []).append(j)
    pages = window_pages(width, page_size)
    table = torch.tensor(
        [rng.sample(range(1, 100), pages) for _ in range(batch)], dtype=torch.int64
    ).reshape(batch, pages)
    base = torch.tensor([rng.randrange(page_size) for _ in range(batch)], dtype=torch.int64)
    return dict(
        argmax=argmax, row_index=row_index, draft_tokens=draft, parents=parents, base=base,
        table=table,
    )  # fmt: skip


def assert_walk_matches(round_: dict[str, torch.Tensor], page_size: int) -> torch.Tensor:
    got = accept_walk(**round_, page_size=page_size, scratch_slot=SCRATCH)
    want = accept_walk_reference(**round_, page_size=page_size, scratch_slot=SCRATCH)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g, w)
    return got[0]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("width", [1, 2, 4, 8, 16])
def test_the_walk_matches_the_torch_ops_for_chains_and_trees(
    width: int, topk: int, page_size: int
) -> None:
    rng = random.Random(width * 100 + topk * 10 + page_size)
    depths = set()
    for _ in range(6):
        sizes = [rng.randint(1, width) for _ in range(rng.randint(1, 4))]
        round_ = random_round(rng, sizes, width, page_size, topk, padding=rng.randint(0, 2))
        packed = assert_walk_matches(round_, page_size)
        depths.update(packed[: len(sizes), 0].tolist())
    assert len(depths) > 1, depths  # more than one accept length came up


def test_a_whole_chain_accepted_and_nothing_accepted() -> None:
    rng = random.Random(3)
    for rate, want in ((1.0, 8), (0.0, 0)):
        round_ = random_round(rng, [8, 8], 8, 16, topk=1, accept_rate=rate)
        packed = assert_walk_matches(round_, 16)
        assert packed[:, 0].tolist() == [want, want]
        last = 7 if want else -1  # the bonus: the argmax at the last accepted node's row
        rows = round_["row_index"][:, last + 1]
        assert packed[:, 1].tolist() == round_["argmax"][rows].tolist()


def test_a_decode_round_takes_each_rows_argmax_and_moves_nothing() -> None:
    round_ = random_round(random.Random(5), [0, 0, 0], 0, 16, topk=1, padding=1)
    packed, src, dst = accept_walk(**round_, page_size=16, scratch_slot=SCRATCH)
    assert packed.shape == (4, 2) and src.numel() == dst.numel() == 0
    assert packed[:3, 0].tolist() == [0, 0, 0]
    rows = round_["row_index"][:3, 0]
    assert packed[:3, 1].tolist() == round_["argmax"][rows].tolist()
    assert_walk_matches(round_, 16)


def test_padding_sequences_accept_nothing_and_move_scratch_to_scratch() -> None:
    round_ = random_round(random.Random(9), [4], 4, 1, topk=1, padding=3, accept_rate=1.0)
    packed, src, dst = accept_walk(**round_, page_size=1, scratch_slot=SCRATCH)
    assert packed[1:, 0].tolist() == [0, 0, 0]
    assert packed[1:, 2:].eq(-1).all()
    assert src[4:].eq(SCRATCH).all() and dst[4:].eq(SCRATCH).all()
    assert_walk_matches(round_, 1)


def test_the_wrapper_refuses_inputs_it_cannot_run() -> None:
    round_ = random_round(random.Random(1), [2], 2, 16, topk=1)
    bad = dict(round_, parents=round_["parents"].to(torch.int32))
    with pytest.raises(ValueError, match="int64"):
        accept_walk(**bad, page_size=16, scratch_slot=SCRATCH)
    bad = dict(round_, row_index=round_["row_index"][:, :2].contiguous())
    with pytest.raises(ValueError, match="row_index"):
        accept_walk(**bad, page_size=16, scratch_slot=SCRATCH)
    bad = dict(round_, base=round_["base"].repeat(2))
    with pytest.raises(ValueError, match="base"):
        accept_walk(**bad, page_size=16, scratch_slot=SCRATCH)
