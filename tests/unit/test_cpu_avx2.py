"""The C layer's and products' AVX2 variant (8 lanes: what a CPU without AVX-512 runs) through
their tests on a CPU with AVX-512, which otherwise runs only its own 16-lane code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.model import cpu_gemm

ROOT = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/unit/test_cpu_layer.py",
    "tests/unit/test_model_vs_transformers.py",
    "tests/unit/test_cpu_gemm.py",
]


@pytest.mark.skipif(
    cpu_gemm.library() is None or cpu_gemm.library().lanes != 16,
    reason="no AVX-512 here: the AVX2 variant is what every test runs",
)
def test_the_avx2_variant_passes_the_c_layers_tests() -> None:
    """$SPECSPLIT_CPU_AVX512=0 (cpu_gemm.Library: 8 lanes, no 8-bit route): the C layer's
    attention by rows, exp8, the products' 8-lane tiles, each row's bits whatever the step, and
    transformers' logits."""
    env = {**os.environ, "SPECSPLIT_CPU_AVX512": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]
