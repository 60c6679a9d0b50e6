"""Fixtures of the CPU kernels' tests (tests/unit/test_cpu_gemm.py, test_cpu_quant.py,
test_cpu_int8.py, test_loader.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specsplit.model import cpu_gemm


@pytest.fixture
def cpu_kernel() -> cpu_gemm.Library:
    """cpu_gemm.c's library (built in this test session's cache: tests/conftest.py's
    private_cache_dir), or the test skipped where this machine cannot build or run it."""
    lib = cpu_gemm.library()
    if lib is None:
        pytest.skip("no fixed-order CPU kernel on this machine (no compiler, or no AVX2 + FMA)")
    return lib


@pytest.fixture(params=[16, 8], ids=["16-lanes", "8-lanes"])
def lanes(request: pytest.FixtureRequest, cpu_kernel: cpu_gemm.Library) -> int:
    """Each variant of the kernel this CPU runs: 16 lanes (AVX-512), 8 (AVX2 + FMA)."""
    if request.param > cpu_kernel.lanes:
        pytest.skip("this CPU has no AVX-512")
    return int(request.param)


@pytest.fixture
def float32_products(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Packed weights on their float32 route, not AMX's 8-bit panels (whose products are near
    the float32 ones, not their bits: test_cpu_int8.py), whatever $SPECSPLIT_CPU_INT8 says."""
    monkeypatch.setenv("SPECSPLIT_CPU_INT8", "0")
    cpu_gemm.int8_switch.cache_clear()
    yield
    cpu_gemm.int8_switch.cache_clear()
