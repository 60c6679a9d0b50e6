"""The accepted-rows Triton kernel (under the interpreter on the CPU) equals its plain reference:
each asking sequence's pending rows, then its accepted path's rows, back to back from row 0, for
chains and trees, ragged pending counts (a prefill beside decode rounds), sequences that do not
ask, nothing accepted, widths that are not a multiple of the column block, results padded past
the batch (a CUDA graph's); the reference matches rows picked by hand; the wrapper refuses what
it cannot run."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.kernels.accepted_rows import (
    BLOCK_COLUMNS,
    accepted_rows,
    accepted_rows_reference,
)

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


def make_round(
    pending: list[int],
    nodes: list[int],
    asks: list[bool],
    width: int,
    seed: int,
    extra_rows: int = 0,  # packed rows past the batch (a graph's padding)
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(hidden [sum p + n, width], packed [B + extra_rows, 2 + max n], starts): each sequence's
    accepted path a random chain of distinct nodes in increasing order."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for p, n in zip(pending, nodes, strict=True):
        starts.append(row)
        row += p + n
    hidden = torch.randn(row, width, generator=gen)
    width_n = max(nodes, default=0)
    packed = torch.full((len(pending) + extra_rows, 2 + width_n), -1, dtype=torch.int64)
    for b, n in enumerate(nodes):
        path = sorted(rng.sample(range(n), rng.randint(0, n)))
        packed[b, 0] = len(path)
        packed[b, 1] = rng.randrange(1000)  # the bonus token: not read
        packed[b, 2 : 2 + len(path)] = torch.tensor(path, dtype=torch.int64)
    packed[len(pending) :, 0] = 5  # padding rows: never read
    return hidden, packed, starts


def num_kept(packed: torch.Tensor, pending: list[int], asks: list[bool]) -> int:
    """Rows gathered: p + accepted drafts of each sequence that asks."""
    return sum(
        p + int(packed[b, 0]) for b, (p, ask) in enumerate(zip(pending, asks, strict=True)) if ask
    )


def meta_of(starts: list[int], pending: list[int], asks: list[bool]) -> torch.Tensor:
    return torch.tensor([starts, pending, [int(a) for a in asks]], dtype=torch.int64)


CASES = {
    "decode-chain": ([1, 1, 1], [3, 3, 3], [True, True, True], 64),
    "prefill-beside-rounds": ([17, 1, 2], [3, 4, 0], [True, True, True], 96),
    "some-do-not-ask": ([1, 3, 1, 1], [3, 3, 3, 3], [True, False, True, False], 40),
    "trees-ragged": ([1, 2, 1], [8, 5, 1], [True, True, True], 33),
    "wider-than-a-block": ([1, 2], [3, 4], [True, True], BLOCK_COLUMNS + 77),
    "one-sequence": ([1], [4], [True], 48),
    "none-asks": ([1, 1], [3, 3], [False, False], 16),
    "long-prompt-row-groups": ([70, 1, 1], [0, 3, 2], [True, True, True], 24),
}
# more sequences than the kernel sums at once (BLOCK_SEQS): one seed, slow interpreted
MANY = ([1, 2] * 35, [2, 1] * 35, [True, True, False] * 23 + [True], 8)


@pytest.mark.parametrize("extra_rows", [0, 3], ids=["exact", "padded"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_equals_reference(case: str, extra_rows: int) -> None:
    pending, nodes, asks, width = CASES[case]
    for seed in range(3):
        hidden, packed, starts = make_round(pending, nodes, asks, width, seed, extra_rows)
        expected = accepted_rows_reference(hidden, packed, starts, pending, asks)
        got = accepted_rows(hidden, packed, meta_of(starts, pending, asks))
        num = num_kept(packed, pending, asks)
        assert expected.shape == (num, width)
        assert torch.equal(got[:num], expected), (case, seed)


def test_kernel_sums_the_rows_before_past_a_block_of_sequences() -> None:
    pending, nodes, asks, width = MANY
    hidden, packed, starts = make_round(pending, nodes, asks, width, seed=5, extra_rows=1)
    expected = accepted_rows_reference(hidden, packed, starts, pending, asks)
    got = accepted_rows(hidden, packed, meta_of(starts, pending, asks))
    assert torch.equal(got[: expected.shape[0]], expected)


def test_kernel_writes_the_dtype_asked() -> None:
    pending, nodes, asks, width = CASES["trees-ragged"]
    hidden, packed, starts = make_round(pending, nodes, asks, width, seed=1)
    expected = accepted_rows_reference(hidden, packed, starts, pending, asks, torch.bfloat16)
    got = accepted_rows(hidden, packed, meta_of(starts, pending, asks), torch.bfloat16)
    num = num_kept(packed, pending, asks)
    assert got.dtype == expected.dtype == torch.bfloat16
    # the interpreter rounds to bfloat16 by truncation, a GPU to nearest (tests/gpu: exact)
    torch.testing.assert_close(got[:num], expected, rtol=2**-7, atol=0)


def test_reference_picks_pending_then_accepted_path_rows() -> None:
    # seq 0: 2 pending + 3 nodes at rows 0-4, nodes 0 and 2 accepted; seq 1 does not ask
    # (rows 5-8); seq 2: 1 pending + 2 nodes at rows 9-11, nothing accepted
    hidden = torch.arange(12, dtype=torch.float32)[:, None].repeat(1, 4)
    packed = torch.tensor([[2, 7, 0, 2, -1], [1, 7, 1, -1, -1], [0, 7, -1, -1, -1]])
    out = accepted_rows_reference(hidden, packed, [0, 5, 9], [2, 1, 1], [True, False, True])
    assert out[:, 0].tolist() == [0, 1, 2, 4, 9]


def test_wrapper_refuses_what_it_cannot_run() -> None:
    hidden, packed, starts = make_round([1, 1], [3, 3], [True, True], 16, seed=0)
    meta = meta_of(starts, [1, 1], [True, True])
    with pytest.raises(ValueError, match="meta must be"):
        accepted_rows(hidden, packed, meta.to(torch.int32))
    with pytest.raises(ValueError, match="packed must be"):
        accepted_rows(hidden, packed[:1], meta)
    with pytest.raises(ValueError, match="hidden must be"):
        accepted_rows(hidden.t(), packed, meta)
