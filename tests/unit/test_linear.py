"""specsplit.model.linear: each CPU float32 route equals F.linear, a row's result does not depend
on the other rows (the fixed-order kernel at any row count, the weight-major route within a
narrow step), and $SPECSPLIT_CPU_LINEAR chooses the route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.model import cpu_gemm
from specsplit.model import linear as linear_module
from specsplit.model.linear import NARROW_ROWS, linear

ROUTES = ["fixed", "weight_major", "torch"]


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fixed" and cpu_gemm.library() is None:
        pytest.skip("no fixed-order CPU kernel on this machine")
    monkeypatch.setattr(linear_module, "cpu_route", lambda: request.param)
    return str(request.param)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(route: str, num_rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 96, generator=gen)
    weight = torch.randn(160, 96, generator=gen)
    bias = torch.randn(160, generator=gen) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (num_rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ["fixed", "weight_major"], indirect=True)
def test_a_narrow_row_is_the_same_alone_or_with_others(route: str) -> None:
    """A one-token decode step and a verify of NARROW_ROWS tokens give the shared row the same
    bits: target-only and speculative rounds agree exactly on it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(NARROW_ROWS, 576, generator=gen)
    weight = torch.randn(1536, 576, generator=gen)
    together = linear(x, weight)
    for row in range(NARROW_ROWS):
        assert torch.equal(linear(x[row : row + 1], weight)[0], together[row])


@pytest.mark.parametrize("route", ["fixed"], indirect=True)
@pytest.mark.parametrize("num_rows", [9, 64, 100, 128])
def test_the_fixed_route_keeps_a_rows_bits_at_any_batch(route: str, num_rows: int) -> None:
    """A row alone and among a batch's verify rows (SmolLM2's down_proj: 1536 -> 576, where the
    weight-major route parts from the one-row result at 64 rows and more)."""
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 1536, generator=gen)
    weight = torch.randn(576, 1536, generator=gen)
    together = linear(x, weight)
    for row in (0, num_rows // 2, num_rows - 1):
        assert torch.equal(linear(x[row : row + 1], weight)[0], together[row])


def test_gradients_flow_through_every_route(route: str) -> None:
    """A product autograd differentiates (training a head on the CPU) keeps its graph: the fixed
    kernel's route hands it to torch."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 32, generator=gen, requires_grad=True)
    weight = torch.randn(8, 32, generator=gen, requires_grad=True)
    linear(x, weight).square().sum().backward()
    assert x.grad is not None and weight.grad is not None
    x_ref, w_ref = x.detach().requires_grad_(), weight.detach().requires_grad_()
    F.linear(x_ref, w_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, w_ref.grad)


def test_other_dtypes_take_f_linear(route: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=gen, dtype=torch.float64)
    weight = torch.randn(8, 32, generator=gen, dtype=torch.float64)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize(
    ("asked", "builds", "chosen"),
    [
        ("auto", True, "fixed"),
        ("auto", False, "weight_major"),
        ("fixed", True, "fixed"),
        ("weight_major", True, "weight_major"),
        ("torch", True, "torch"),
    ],
)
def test_the_switch_chooses_the_route(
    monkeypatch: pytest.MonkeyPatch, asked: str, builds: bool, chosen: str
) -> None:
    monkeypatch.setenv("SPECSPLIT_CPU_LINEAR", asked)
    monkeypatch.setattr(cpu_gemm, "library", lambda: object() if builds else None)
    linear_module.cpu_route.cache_clear()
    try:
        assert linear_module.cpu_route() == chosen
    finally:
        linear_module.cpu_route.cache_clear()


@pytest.mark.parametrize(("asked", "builds"), [("fixed", False), ("mkl", True)])
def test_the_switch_refuses(monkeypatch: pytest.MonkeyPatch, asked: str, builds: bool) -> None:
    monkeypatch.setenv("SPECSPLIT_CPU_LINEAR", asked)
    monkeypatch.setattr(cpu_gemm, "library", lambda: object() if builds else None)
    linear_module.cpu_route.cache_clear()
    try:
        with pytest.raises(SystemExit):
            linear_module.cpu_route()
    finally:
        linear_module.cpu_route.cache_clear()
