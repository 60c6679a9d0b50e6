"""On a CUDA device: `building_ahead` builds our kernels' variants side by side and runs none
of them, and a warm-up's captures then build nothing (bench/kernel_builds.py measures the time).
Skipped where there is no GPU (CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specsplit.kernels.triton_jit import building_ahead, jit
from tests.support import save_tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
tl: Any = None  # triton.language, bound on first launch (triton_jit.jit)


def _scale_kernel(x_ptr, out_ptr, factor, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + offsets, x * factor, mask=offsets < n)


@pytest.fixture
def builds() -> Iterator[list[str]]:
    """The Triton builds started (triton's jit hook), each its kernel's name."""
    from triton import knobs

    started: list[str] = []

    def hook(*, fn: Any, **_: Any) -> bool:
        started.append(fn.name)
        return False

    before, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    yield started
    knobs.runtime.jit_cache_hook = before


def test_the_block_builds_every_variant_and_runs_none(
    builds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSPLIT_BUILD_AHEAD", "1")
    kernel = jit(_scale_kernel)
    x = torch.arange(100, dtype=torch.float32, device="cuda")
    out = torch.zeros_like(x)
    with building_ahead(threads=4):
        for block in (16, 32, 64, 128):
            kernel[(-(-100 // block),)](x, out, 2.0, 100, BLOCK=block)
        kernel[(7,)](x, out, 2.0, 100, BLOCK=16)  # a variant asked twice is built once
    torch.cuda.synchronize()
    assert not out.any()  # nothing ran
    kernel_cache = kernel.device_caches[torch.cuda.current_device()][0]
    assert len(kernel_cache) == 4 and set(builds) == {"_scale_kernel"}
    asked = len(builds)
    for block in (16, 32, 64, 128):  # each runs now, built
        out.zero_()
        kernel[(-(-100 // block),)](x, out, 2.0, 100, BLOCK=block)
        torch.testing.assert_close(out, 2 * x)
    assert len(builds) == asked and len(kernel_cache) == 4  # nothing built after the block


RUNNER = """
import json, sys
import torch
from triton import knobs
from specsplit.kernels.triton_jit import building_ahead
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model

builds = []
knobs.runtime.jit_cache_hook = lambda *, fn, **_: builds.append(fn.name) or False
model, config = load_model(sys.argv[1], torch.bfloat16, "cuda")
kv = make_kv_cache(config, 64, 8, torch.bfloat16, "cuda")
runner = CudaGraphRunner.for_model(model, kv, max_context=256, max_batch_size=8)
with torch.inference_mode():
    with building_ahead():
        for q in (5, 1):
            runner.build(q)
    built = len(builds)
    for q in (5, 1):
        runner.capture(q)
print(json.dumps({"built": builds[:built], "in_captures": builds[built:],
                  "graphs": sorted(map(list, runner.graphs))}))
"""


def test_a_graph_runner_captures_what_it_built(tmp_path: Path) -> None:
    """`CudaGraphRunner.build` inside an active block takes the variants every bucket's capture
    then launches: the captures build nothing more (in a process of its own with
    $SPECSPLIT_BUILD_AHEAD=1, so that every kernel is jitted with the switch on)."""
    target = save_tiny_llama(tmp_path / "target", seed=3)
    env = dict(os.environ, SPECSPLIT_BUILD_AHEAD="1", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, str(target)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert "_paged_attention_kernel" in got["built"] and "_small_linear_kernel" in got["built"]
    assert got["in_captures"] == []
    assert got["graphs"] == sorted([q, [], b] for q in (1, 5) for b in (1, 2, 4, 8))
