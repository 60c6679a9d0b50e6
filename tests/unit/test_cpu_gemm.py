"""specsplit/model/cpu_gemm.c, the fixed-order float32 CPU matmul: a row's result is the same bits
alone or among any number of rows and at any place among them (both variants: 16 lanes and 8),
it is x @ weight.T to float32's accuracy (against float64), at widths that leave partial vectors
and blocks, on strided rows; it is built once into the cache; and where no compiler builds it,
`linear` takes the torch route."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specsplit.model import cpu_gemm
from specsplit.model import linear as linear_module
from specsplit.model.cpu_gemm import fixed_linear

pytestmark = pytest.mark.usefixtures("cpu_kernel")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k_len", [1, 7, 16, 40, 577])
def test_a_rows_bits_do_not_depend_on_the_other_rows(lanes: int, k_len: int) -> None:
    """Each row of a 300-row product, computed again in batches of 1-100 rows starting at it
    (so it falls at every place of a block of rows), gives the same bits."""
    x, weight = randn(300, k_len), randn(37, k_len, seed=1)
    together = fixed_linear(x, weight, lanes)
    for num_rows in (1, 2, 3, 4, 5, 9, 17, 64, 65, 100):
        for start in (0, 1, 2, 3, 150, 300 - num_rows):
            part = fixed_linear(x[start : start + num_rows], weight, lanes)
            assert torch.equal(part, together[start : start + num_rows]), (num_rows, start)


SHAPES = [(1, 1, 1), (3, 5, 33), (9, 160, 96), (70, 13, 1536), (5, 49, 576)]  # rows, out, in


@pytest.mark.parametrize(("num_rows", "n_len", "k_len"), SHAPES)
def test_it_is_the_product_to_float32s_accuracy(
    lanes: int, num_rows: int, n_len: int, k_len: int
) -> None:
    x, weight = randn(num_rows, k_len), randn(n_len, k_len, seed=2)
    got = fixed_linear(x, weight, lanes)
    want = x.double() @ weight.double().T
    assert got.shape == (num_rows, n_len) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * k_len**0.5)


def test_strided_rows_are_read_in_place_and_transposed_ones_copied() -> None:
    wide, weight = randn(6, 300), randn(20, 96, seed=3)
    x = wide[:, 50:146]  # rows strided by 300
    assert torch.equal(fixed_linear(x, weight), fixed_linear(x.contiguous(), weight))
    columns = randn(96, 6).t()  # [6, 96], its last dim strided
    assert torch.equal(fixed_linear(columns, weight), fixed_linear(columns.contiguous(), weight))


def test_empty_products() -> None:
    assert fixed_linear(torch.empty(0, 8), randn(4, 8)).shape == (0, 4)
    assert torch.equal(fixed_linear(randn(3, 0), torch.empty(5, 0)), torch.zeros(3, 5))


def test_the_threads_split_outputs_never_a_sum() -> None:
    x, weight = randn(17, 200), randn(301, 200, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fixed_linear(x, weight)
        torch.set_num_threads(2)
        two = fixed_linear(x, weight)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize(
    "case", ["float64", "widths", "one-dim", "lanes"], ids=lambda case: f"refuses-{case}"
)
def test_it_refuses_what_it_cannot_run(case: str) -> None:
    x, weight = randn(2, 8), randn(3, 8)
    calls = {
        "float64": lambda: fixed_linear(x.double(), weight.double()),
        "widths": lambda: fixed_linear(x, randn(3, 9)),
        "one-dim": lambda: fixed_linear(x[0], weight),
        "lanes": lambda: fixed_linear(x, weight, lanes=4),
    }
    with pytest.raises(ValueError):
        calls[case]()


def test_it_is_built_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_CACHE_DIR", str(tmp_path))
    first = cpu_gemm._built("cc")
    assert first.parent == tmp_path / "cpu_gemm" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_gemm._built("cc") == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left


def test_without_a_compiler_linear_takes_the_torch_route(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.delenv("SPECSPLIT_CPU_LINEAR", raising=False)
    cpu_gemm.library.cache_clear()
    linear_module.cpu_route.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="specsplit.model.cpu_gemm"):
            assert cpu_gemm.library() is None
            assert linear_module.cpu_route() == "weight_major"
        assert "no C compiler" in caplog.text
        monkeypatch.setenv("SPECSPLIT_CPU_LINEAR", "fixed")
        linear_module.cpu_route.cache_clear()
        with pytest.raises(SystemExit):
            linear_module.cpu_route()
    finally:
        monkeypatch.undo()
        cpu_gemm.library.cache_clear()
        linear_module.cpu_route.cache_clear()
