"""The pointwise parts of a decoder layer, each one kernel on a GPU.

Unfused, a layer's RMSNorms, residual adds, RoPE, K/V stores and SiLU-and-mul are ~30 small
kernels; at batch 1 their launches and tails cost more than the weights take to read (SmolLM2
on an H100: 1,155 kernels and 2.4 ms of GPU time per step for a 0.1 ms floor). On a GPU each
function below runs as one Triton kernel made by torch.compile (nano-vllm does the same),
captured with the rest of the step in its CUDA graph; on the CPU it runs as written, the
reference. `SPECSPLIT_TORCH_COMPILE=0` turns compilation off.

`rope_and_store` is the exception on a GPU: it runs our own Triton kernel
(specsplit/kernels/rope_store.py), one launch per layer where torch.compile makes ~3 (at batch 1
the launches bound the step). `SPECSPLIT_TRITON_ROPE=0` runs the compiled torch version instead,
for A/B benchmarks; without triton it runs that version too.

`SPECSPLIT_TRITON_POINTWISE=1` runs the others as our own Triton kernels too
(specsplit/kernels/pointwise.py), so that nothing is compiled by torch.compile (its tracing
costs a warm GPU restart 5-10 s). Off (torch.compile's) by default: on an H200 they cut a cold
warm-up by 5-10 s more, but SmolLM2's decode step took 1.04-1.05x the device time at batch 32-64
(the 8B's 0.98x; `scripts/gpu_suite.sh pointwise-ab`, bench/RESULTS.md).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from specsplit.kernels import pointwise
from specsplit.kernels.pointwise import (
    add_rms_norm_reference,
    norm_embed_and_cat_reference,
    rms_norm_reference,
    silu_and_mul_reference,
)
from specsplit.kernels.rope_store import rope_store, rope_store_reference

F_ = TypeVar("F_", bound=Callable[..., Any])
COMPILE = os.environ.get("SPECSPLIT_TORCH_COMPILE", "1") != "0"
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_ROPE = os.environ.get("SPECSPLIT_TRITON_ROPE", "1") != "0" and HAS_TRITON
TRITON_POINTWISE = os.environ.get("SPECSPLIT_TRITON_POINTWISE", "0") == "1" and HAS_TRITON
# compiled variants per function (dtype, eps, weights as parameters or plain tensors: a target,
# a draft model and an EAGLE head in one process each add theirs); past the limit torch.compile
# fails outright (fullgraph), so keep room for every model a process (or a test run) loads
RECOMPILE_LIMIT = 64


def compile_in_process() -> None:
    """torch.compile's kernels built in this process, not by its pool of compile worker
    processes (one a core, up to 32, per service), unless $TORCHINDUCTOR_COMPILE_THREADS asks
    for the pool. The pool saved nothing in a GPU `up`'s cold warm-up (SmolLM2-shaped target
    with an EAGLE-3 head, empty compile caches: 82.2 s with it, 82.6 without, medians of two, one
    H200; `bench/startup.py --compile-threads`): these graphs are a kernel or two each. And it
    hung a GPU test process once (torch 2.11: the parent waited forever on a worker's result)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1


def _on_gpu(fn: F_, kernel: Callable[..., Any] | None = None) -> F_:
    """fn for CUDA tensors in inference as `kernel` when given, else compiled (dynamic shapes);
    as written elsewhere (the CPU, and training, where autograd needs it)."""
    compiled: list[Callable[..., Any]] = []

    def dispatch(x: torch.Tensor, *args: Any) -> Any:
        on_gpu = x.is_cuda and not torch.is_grad_enabled()
        if on_gpu and kernel is not None:
            return kernel(x, *args)
        if not (on_gpu and COMPILE):
            return fn(x, *args)
        if not compiled:
            compile_in_process()
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        return compiled[0](x, *args)

    dispatch.__doc__ = fn.__doc__
    return dispatch  # type: ignore[return-value]


rms_norm = _on_gpu(rms_norm_reference, pointwise.rms_norm if TRITON_POINTWISE else None)
# an EAGLE-3 layer's input [T, 2H] and RMSNorm(features) [T, H] (see the reference's docstring)
norm_embed_and_cat = _on_gpu(
    norm_embed_and_cat_reference, pointwise.norm_embed_and_cat if TRITON_POINTWISE else None
)
# (residual + x, RMSNorm(residual + x)), [T, hidden]
add_rms_norm = _on_gpu(add_rms_norm_reference, pointwise.add_rms_norm if TRITON_POINTWISE else None)
# [T, num_heads, head_dim] rotated q; k and v stored (see the reference's docstring)
rope_and_store = _on_gpu(rope_store_reference, rope_store if TRITON_ROPE else None)
# [T, 2 * inter] -> silu(gate) * up, [T, inter]
silu_and_mul = _on_gpu(silu_and_mul_reference, pointwise.silu_and_mul if TRITON_POINTWISE else None)
