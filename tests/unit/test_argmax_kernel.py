"""The split argmax (`specsplit.kernels.argmax.argmax_rows`) under the Triton interpreter equals
torch.argmax exactly: rows cut into chunks that end mid-row, ties across chunks (the lowest
column wins), rows of -inf, NaN (the largest, as torch has it), half-precision logits; and
`greedy_tokens` on the CPU is torch.argmax itself."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels import argmax as argmax_module
from specsplit.kernels.argmax import argmax_reference, argmax_rows, greedy_tokens

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


@pytest.mark.parametrize(
    ("rows", "cols", "chunk"),
    [(1, 1000, 64), (3, 257, 64), (5, 64, 64), (2, 63, 64), (4, 5000, 256), (7, 33, 16)],
)
def test_argmax_rows_equals_torch_argmax(rows: int, cols: int, chunk: int) -> None:
    logits = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    assert torch.equal(argmax_rows(logits, chunk=chunk), argmax_reference(logits))


def test_ties_go_to_the_lowest_column_within_and_across_chunks() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    top = logits.max() + 1.0
    logits[0, [250, 40, 41]] = top  # across chunks of 64: column 40
    logits[1, [70, 71]] = top  # within one chunk: column 70
    logits[2, [299, 5, 200]] = top
    got = argmax_rows(logits, chunk=64)
    assert got.tolist() == [40, 70, 5] == argmax_reference(logits).tolist()


def test_a_row_of_minus_infinity_gives_column_zero() -> None:
    logits = torch.full((2, 130), float("-inf"))
    logits[1, 129] = 0.0
    assert argmax_rows(logits, chunk=64).tolist() == [0, 129] == argmax_reference(logits).tolist()


def test_nan_counts_as_the_largest_value_as_in_torch() -> None:
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(2))
    logits[1, 200] = float("nan")
    assert torch.equal(argmax_rows(logits, chunk=64), argmax_reference(logits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_with_their_many_ties(dtype: torch.dtype) -> None:
    # integers up to 40 over 1000 columns: each row's largest value is held by many columns
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 40, (6, 1000), generator=gen).to(dtype)
    assert torch.equal(argmax_rows(logits, chunk=64), argmax_reference(logits))


def test_out_is_written_in_place_and_rows_of_a_larger_tensor_are_read() -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(4))
    out = torch.full((5,), -1, dtype=torch.int64)
    got = argmax_rows(logits[:5], out=out, chunk=128)
    assert got is out and torch.equal(out, argmax_reference(logits[:5]))


@pytest.mark.parametrize(
    ("logits", "out", "match"),
    [
        (torch.randn(2, 3, 4), None, "2-D"),
        (torch.randn(4, 3).t(), None, "contiguous"),
        (torch.zeros(2, 3, dtype=torch.int64), None, "float"),
        (torch.randn(2, 3), torch.zeros(2, dtype=torch.int32), "int64"),
        (torch.randn(2, 3), torch.zeros(3, dtype=torch.int64), r"\[2\]"),
        (torch.randn(2, 0), None, "no columns"),
    ],
)
def test_the_wrapper_refuses_what_the_kernel_cannot_read(
    logits: torch.Tensor, out: torch.Tensor | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        argmax_rows(logits, out=out)


def test_greedy_tokens_on_the_cpu_is_torch_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("argmax_rows launched on the CPU")

    monkeypatch.setattr(argmax_module, "argmax_rows", refuse)
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
