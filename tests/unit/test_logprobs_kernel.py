"""The log-probability kernels (`specsplit.kernels.logprobs`) under the Triton interpreter equal
their plain-torch references: tokens at rows (rows that end mid-block, a bonus token's row and
token read from the acceptance's results, with no draft accepted and with some), each row's top
k (k 1 to 20, ties to the lowest column), outputs written in place into a larger buffer; and on
the CPU the functions run the references."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.logprobs import (
    token_logprobs,
    token_logprobs_reference,
    top_logprobs,
    top_logprobs_reference,
)

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# results rows [accepted drafts a, bonus, the a accepted nodes, -1 padded]
PACKED = torch.tensor([[0, 7, -1, -1], [2, 3, 0, 2], [1, 9, 2, -1]])


@pytest.mark.parametrize("vocab", [10, 63, 64, 200, 1000])
def test_token_logprobs_equal_the_reference(vocab: int) -> None:
    logits = _logits(9, vocab, vocab)
    queries = torch.tensor(
        [[0, 0, -1], [3, vocab - 1, -1], [8, vocab // 2, -1]]  # tokens at rows
        + [[0, 0, 0], [1, 0, 1], [4, 0, 2]]  # bonus tokens of results rows 0-2
    )
    got = token_logprobs(logits, queries, PACKED, kernel=True)
    want = token_logprobs_reference(logits, queries, PACKED)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # a bonus query's row: the root's, + 1 + the last accepted node where any was accepted
    expected = torch.log_softmax(logits[1 + 1 + 2], dim=-1)[3]
    assert got[4].item() == pytest.approx(expected.item(), abs=1e-5)
    assert got[3].item() == pytest.approx(torch.log_softmax(logits[0], -1)[7].item(), abs=1e-5)


@pytest.mark.parametrize(("vocab", "k"), [(10, 1), (63, 5), (200, 20), (1000, 3), (20, 20)])
def test_top_logprobs_equal_the_reference(vocab: int, k: int) -> None:
    logits = _logits(5, vocab, vocab + k)
    rows = torch.tensor([[4, 0, 0], [0, 0, 0], [2, 0, 0], [2, 0, 0]])
    got = top_logprobs(logits, rows, k, kernel=True)
    want = top_logprobs_reference(logits, rows, k)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_top_ties_go_to_the_lowest_column() -> None:
    logits = _logits(1, 300, 7)
    logits[0, [250, 40, 41, 299, 64]] = logits.max() + 1.0  # across blocks of 64 and within
    got = top_logprobs(logits, torch.tensor([[0, 0, 0]]), 5, kernel=True)
    assert got[0, 5:].tolist() == [40.0, 41.0, 64.0, 250.0, 299.0]
    assert got[0, :5].tolist() == pytest.approx([got[0, 0].item()] * 5)


def test_outputs_are_written_in_place_into_a_larger_buffer() -> None:
    logits = _logits(4, 130, 3)
    queries = torch.tensor([[1, 5, -1], [2, 0, 0]])
    rows = torch.tensor([[3, 0, 0]])
    buffer = torch.full((2 + 2 * 4,), 99.0)
    token_logprobs(logits, queries, PACKED, out=buffer[:2], kernel=True)
    top_logprobs(logits, rows, 4, out=buffer[2:].view(1, 8), kernel=True)
    want = torch.cat(
        [
            token_logprobs_reference(logits, queries, PACKED),
            top_logprobs_reference(logits, rows, 4)[0],
        ]
    )
    torch.testing.assert_close(buffer, want, atol=1e-5, rtol=0)


def test_the_cpu_runs_the_references() -> None:
    logits = _logits(3, 50, 5)
    queries = torch.tensor([[0, 3, -1], [1, 0, 0]])
    rows = torch.tensor([[2, 0, 0]])
    assert torch.equal(
        token_logprobs(logits, queries, PACKED), token_logprobs_reference(logits, queries, PACKED)
    )
    assert torch.equal(top_logprobs(logits, rows, 2), top_logprobs_reference(logits, rows, 2))
