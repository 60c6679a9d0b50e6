"""What our Triton kernel modules share: the jit on first launch, their wrappers' device check.

A kernel is a plain function until its first launch, jitted then. Importing the model does not
import triton, and TRITON_INTERPRET=1 is read when triton decorates a function (its own
library's too), so a test that sets it before importing triton still can. A kernel here calls
no `@triton.jit` function of triton's library (tl.zeros, tl.max, tl.sum: use tl.full and
tl.reduce with triton's combine functions), so it also runs interpreted when triton was
imported before TRITON_INTERPRET was set. Each kernel module names triton.language `tl` (a
module global, bound by `jit`) and caches its jitted kernels per `interpreting()`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch


def jit(
    kernel: Callable[..., Any], do_not_specialize: Sequence[str] = (), generic: bool = False
) -> Any:
    """`kernel` decorated by triton.jit: compiled, or interpreted under TRITON_INTERPRET=1 (the
    decoration reads the knob, so callers cache the result per `interpreting()`), with the `tl`
    of its module bound to triton.language. Integer arguments named in `do_not_specialize` do
    not get a variant per value class (== 1, divisible by 16). `generic`: none of its runtime
    arguments does, and no pointer gets one per alignment either, so it compiles once per set
    of constexprs (a kernel launched outside the warmed-up shapes, on views at any offset)."""
    import triton
    import triton.language

    vars(sys.modules[kernel.__module__])["tl"] = triton.language  # the kernel's globals
    if interpreting():
        _fix_interpreter_index()
    if not generic:
        return triton.jit(kernel, do_not_specialize=do_not_specialize)
    runtime = runtime_params(kernel)
    return triton.jit(kernel, do_not_specialize=runtime, do_not_specialize_on_alignment=runtime)


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
