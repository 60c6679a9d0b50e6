"""specsplit.model.linear: the CPU float32 route equals F.linear, and a row's result does not
depend on the other rows of a narrow step (1-4 rows run one kernel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.model import linear as linear_module
from specsplit.model.linear import NARROW_ROWS, linear


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(num_rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 96, generator=gen)
    weight = torch.randn(160, 96, generator=gen)
    bias = torch.randn(160, generator=gen) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (num_rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_narrow_row_is_the_same_alone_or_with_others() -> None:
    """A one-token decode step and a verify of NARROW_ROWS tokens give the shared row the same
    bits: target-only and speculative rounds agree exactly on it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(NARROW_ROWS, 576, generator=gen)
    weight = torch.randn(1536, 576, generator=gen)
    together = linear(x, weight)
    for row in range(NARROW_ROWS):
        assert torch.equal(linear(x[row : row + 1], weight)[0], together[row])


def test_other_dtypes_and_the_switch_take_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=gen, dtype=torch.float64)
    weight = torch.randn(8, 32, generator=gen, dtype=torch.float64)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    monkeypatch.setattr(linear_module, "WEIGHT_MAJOR", False)
    x32, w32 = x.float(), weight.float()
    assert torch.equal(linear(x32, w32), F.linear(x32, w32))
