"""`building_ahead` (specsplit/kernels/triton_jit.py): active ($SPECSPLIT_BUILD_AHEAD=1, the
default, and the kernels compiled), a launch of one of our kernels inside the block only builds
its variant (triton's warmup call, compiled by a pool of threads), so a warm-up builds side by
side what its captures take; otherwise it is a plain block. The GPU half (variants built,
nothing written, the captures building nothing more) is tests/gpu/test_build_ahead_gpu.py; here
what needs no GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specsplit.kernels import triton_jit
from specsplit.kernels.triton_jit import (
    build_ahead_switch,
    build_threads,
    building,
    building_ahead,
    jit,
)

tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)


def _fill_kernel(out_ptr, value, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, value, mask=offsets < n)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Kernels taken as compiled (not interpreted), with JITFunction.run recording the
    `warmup` of each launch instead of launching (there is no GPU here)."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(triton_jit, "interpreting", lambda: False)
    calls: list[bool] = []

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        calls.append(warmup)

    monkeypatch.setattr(JITFunction, "run", run)
    return calls


def test_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSPLIT_BUILD_AHEAD", raising=False)
    assert build_ahead_switch()


def test_switched_off_the_block_is_plain(
    compiled: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("SPECSPLIT_BUILD_AHEAD", "0")
    assert not build_ahead_switch()
    kernel = jit(_fill_kernel)
    assert type(kernel) is JITFunction  # triton's own, as before the switch
    with building_ahead():
        assert not building()
        kernel[(1,)](torch.zeros(8), 1.0, 8, BLOCK=8)
    assert compiled == [False]  # launched


def test_on_a_launch_in_the_block_only_builds(
    compiled: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSPLIT_BUILD_AHEAD", "1")
    kernel = jit(_fill_kernel)
    out = torch.zeros(8)
    kernel[(1,)](out, 1.0, 8, BLOCK=8)
    assert not building()
    with building_ahead(threads=2):
        assert building()
        kernel[(1,)](out, 1.0, 8, BLOCK=8)
        with building_ahead():  # a nested block is the same block
            assert building()
            kernel[(1,)](out, 1.0, 8, BLOCK=8)
        assert building()
    assert not building()
    kernel[(1,)](out, 1.0, 8, BLOCK=8)
    kernel.warmup(out, 1.0, 8, BLOCK=8, grid=(1,))  # triton's own warmup call still works
    assert compiled == [False, True, True, False, True]


def test_interpreted_launches_run_inside_the_block(
    triton_interpreter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the interpreter nothing is built: the block is plain, a launch runs as written (the
    CPU warm-up tests run their kernels there)."""
    monkeypatch.setenv("SPECSPLIT_BUILD_AHEAD", "1")
    out = torch.zeros(40)
    with building_ahead():
        assert not building()
        jit(_fill_kernel)[(3,)](out, 2.5, 40, BLOCK=16)
    assert torch.equal(out, torch.full((40,), 2.5))


def test_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSPLIT_BUILD_THREADS", raising=False)
    assert build_threads() >= 1
    monkeypatch.setenv("SPECSPLIT_BUILD_THREADS", "3")
    assert build_threads() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("SPECSPLIT_BUILD_THREADS", bad)
        with pytest.raises(SystemExit, match="SPECSPLIT_BUILD_THREADS"):
            build_threads()
    monkeypatch.setenv("SPECSPLIT_BUILD_AHEAD", "yes")
    with pytest.raises(SystemExit, match="SPECSPLIT_BUILD_AHEAD"):
        build_ahead_switch()
