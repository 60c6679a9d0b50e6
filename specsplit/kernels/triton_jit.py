"""What our Triton kernel modules share: the jit on first launch, their wrappers' device check.

A kernel is a plain function until its first launch, jitted then. Importing the model does not
import triton, and TRITON_INTERPRET=1 is read when triton decorates a function (its own
library's too), so a test that sets it before importing triton still can. A kernel here calls
no `@triton.jit` function of triton's library (tl.zeros, tl.max, tl.sum: use tl.full and
tl.reduce with triton's combine functions), so it also runs interpreted when triton was
imported before TRITON_INTERPRET was set. Each kernel module names triton.language `tl` (a
module global, bound by `jit`) and caches its jitted kernels per `interpreting()`.

Programmatic dependent launch (PDL, Hopper and later: `pdl`): a kernel launched with it may start
while the kernel before it in the stream still runs; it reads nothing that kernel may write until
`tl.extra.cuda.gdc_wait()` returns (that kernel finished, its writes visible). The decode path's
kernels (small_linear, paged_attention, rope_store) take a `PDL` constexpr: with it every
program calls `gdc_launch_dependents()` first (the next kernel may launch once all of them
have) and then `gdc_wait()` before its first load of anything a kernel writes; only constant
weights may be touched before (small_linear's L2 prefetch). Every program waits, also one with
nothing to do: a kernel that ended before its predecessor would let the kernel after it pass
its own wait early. So a decoder layer's launches overlap their ramps and a projection's weight
reads the kernel before it, where kernel launches and memory latency bound a small model's step.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch


def jit(
    kernel: Callable[..., Any],
    do_not_specialize: Sequence[str] = (),
    generic: bool = False,
    any_alignment: Sequence[str] = (),
) -> Any:
    """`kernel` decorated by triton.jit: compiled, or interpreted under TRITON_INTERPRET=1 (the
    decoration reads the knob, so callers cache the result per `interpreting()`), with the `tl`
    of its module bound to triton.language. Integer arguments named in `do_not_specialize` do
    not get a variant per value class (== 1, divisible by 16), pointers named in
    `any_alignment` none per 16-byte alignment (one read a scalar at a time gains nothing from
    it, and a view at an odd offset would build a variant in traffic). `generic`: none of its
    runtime arguments does, and no pointer gets one per alignment either, so it compiles once
    per set of constexprs (a kernel launched outside the warmed-up shapes, on views at any
    offset)."""
    import triton
    import triton.language

    vars(sys.modules[kernel.__module__])["tl"] = triton.language  # the kernel's globals
    if generic:
        do_not_specialize = any_alignment = runtime_params(kernel)
    if interpreting():
        _fix_interpreter_index()
    elif build_ahead_switch():
        return _kernel_class()(
            kernel,
            do_not_specialize=do_not_specialize,
            do_not_specialize_on_alignment=any_alignment,
        )
    return triton.jit(
        kernel, do_not_specialize=do_not_specialize, do_not_specialize_on_alignment=any_alignment
    )


# set inside an active `building_ahead`: our compiled kernels' launches build and do not run
_BUILDING: ContextVar[bool] = ContextVar("specsplit_building_ahead", default=False)


def build_ahead_switch() -> bool:
    """$SPECSPLIT_BUILD_AHEAD: "1" (default) turns `building_ahead` on, "0" leaves it a plain
    block. A cold SmolLM2-shaped verifier's warm-up 40.5 -> 26.8 s with it, its EAGLE-3
    drafter's 41.4 -> 28.6 s (H200, 16 build threads, bench/kernel_builds.py, bench/RESULTS.md)."""
    value = os.environ.get("SPECSPLIT_BUILD_AHEAD", "1")
    if value not in ("0", "1"):
        raise SystemExit(f"SPECSPLIT_BUILD_AHEAD={value!r}: 0 or 1")
    return value == "1"


@functools.cache
def _kernel_class() -> type:
    """triton's JITFunction, whose launch inside an active `building_ahead` only builds
    (triton's warmup call: the variant compiled, nothing launched)."""
    from triton.runtime.jit import JITFunction

    class Kernel(JITFunction):  # type: ignore[misc]
        def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            return super().run(*args, grid=grid, warmup=warmup or _BUILDING.get(), **kwargs)

    return Kernel


def build_threads() -> int:
    """$SPECSPLIT_BUILD_THREADS (an integer >= 1), else the cores this process may run on."""
    value = os.environ.get("SPECSPLIT_BUILD_THREADS")
    if value is None:
        return len(os.sched_getaffinity(0))
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"SPECSPLIT_BUILD_THREADS={value!r}: an integer >= 1")
    return int(value)


def building() -> bool:
    """Whether this is inside an active `building_ahead` (our kernels' launches run nothing):
    a warm-up launches what it will capture only then."""
    return _BUILDING.get()


@contextmanager
def building_ahead(threads: int | None = None) -> Iterator[None]:
    """Active (`build_ahead_switch` on, the kernels compiled, not interpreted), a launch of one of
    our kernels inside runs nothing: a variant not built yet is handed to `threads` threads
    (default: $SPECSPLIT_BUILD_THREADS, else the cores this process may run on) to compile, and
    the block ends once every one is built (triton's AsyncCompileMode). A warm-up that first
    launches each variant it will need inside this block (attention's variants, a step of every
    bucket its graphs capture: code that reads nothing of what our kernels compute, not even as
    an index into a torch op) builds them side by side instead of one after another in the
    captures (a build takes 0.1-3 s, the paged-attention kernel's the longest: a cold
    SmolLM2-shaped verifier's warm-up spent 55 s of its 87 on 90 builds, its drafter's 46 of 90
    on 46, H200, bench/kernel_builds.py). What the launches would write is left as it was;
    torch's own ops run. Nested blocks are one. Inactive: a plain block, its launches run."""
    if _BUILDING.get() or not build_ahead_switch() or interpreting():
        yield
        return
    from triton.runtime._async_compile import AsyncCompileMode

    token = _BUILDING.set(True)
    try:
        workers = threads or build_threads()
        with ThreadPoolExecutor(workers, "triton-build") as pool, AsyncCompileMode(pool):
            yield
    finally:
        _BUILDING.reset(token)


def runtime_params(kernel: Callable[..., Any]) -> list[str]:
    """The names of `kernel`'s arguments that are not `tl.constexpr`."""
    parameters = inspect.signature(kernel).parameters.items()
    return [name for name, param in parameters if "constexpr" not in str(param.annotation)]


def check_device(kernel: str, tensors: Sequence[torch.Tensor], interpret: bool) -> None:
    """ValueError unless `tensors` are on one device where `kernel` runs: CUDA, or the CPU
    under TRITON_INTERPRET=1 (`interpret`)."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"{kernel}: all tensors must be on one device, got {devices}")
    if device.type != "cuda" and not interpret:
        raise ValueError(
            f"{kernel}: tensors are on {device}: the kernel runs on CUDA, or on the CPU under "
            f"TRITON_INTERPRET=1; elsewhere use {kernel}_reference"
        )


def _pdl_switch() -> str:
    """$SPECSPLIT_PDL: "1" (default) launches the decode path's kernels with programmatic
    dependent launch where the GPU has it (compute capability 9.0+), "0" never. SmolLM2's decode
    step at batch 1: 0.693 -> 0.519 ms (0.75x; 0.58 ms without small_linear's prefetch) on an
    H200, alternating in one process (bench/step_ab.py, bench/RESULTS.md)."""
    value = os.environ.get("SPECSPLIT_PDL", "1")
    if value not in ("0", "1"):
        raise SystemExit(f"SPECSPLIT_PDL={value!r}: 0 or 1")
    return value


PDL_SWITCH = _pdl_switch()  # read at each launch (a bench may change it between captures)


def pdl(device: torch.device) -> bool:
    """Whether a launch on `device` uses programmatic dependent launch (module docstring): the
    switch is on, the device is a CUDA GPU of compute capability 9.0 or later, and the kernel
    is compiled (the interpreter runs kernels one after another anyway)."""
    if PDL_SWITCH != "1" or device.type != "cuda" or torch.version.hip or interpreting():
        return False
    return _capability(device) >= 9


def pdl_launch(dependent: bool) -> dict[str, bool]:
    """A launch's keyword for programmatic dependent launch where `dependent` (`pdl`); none
    otherwise (the interpreter takes no such keyword)."""
    return {"launch_pdl": True} if dependent else {}


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fix_interpreter_index() -> None:
    """triton 3.6's interpreter turns a scalar into an int with int(1-element array), which numpy
    >= 2.4 refuses, so `range(0, kv_end, BLOCK_N)` fails there; this applies the upstream fix
    (triton#9171 / #9172, squeeze first). Interpreter only; a no-op where already fixed."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
