"""`x @ weight.T` in float32 on the CPU with each output in one fixed order whatever the number of
rows (`fixed_linear`): the kernel of cpu_gemm.c (AVX-512, else AVX2 + FMA), built on first use
by the machine's C compiler into the cache (`$SPECSPLIT_CACHE_DIR/cpu_gemm/`, one file a source
and compiler) and loaded with ctypes, which releases the GIL for the call.

Why: a greedy verify of 1 + n tokens must give each row the bits a one-token step gives it, and
MKL's GEMMs pick their kernels (and so their sums' order) by the row count. cpu_gemm.c sums
every output in lanes over k and then across the lanes in a fixed tree, so a row's result is
the same alone or among 300 rows, and a one-row step streams the weights about as fast as
MKL's GEMV (bench/cpu_linear.py; bench/RESULTS.md). Without a compiler, or on a CPU with
neither AVX-512 nor AVX2 + FMA, `library()` is None and specsplit/model/linear.py keeps its
weight-major torch route.

Where the CPU has AMX's 8-bit tiles, else AVX-512 VNNI (`int8_route`; $SPECSPLIT_CPU_INT8=0
turns it off): 4-bit and 8-bit GGUF matrices in panels go to cpu_gemm.c's `int8_gemm` (AMX) or
`vnni_gemm` (the same bits), x as two 8-bit parts a block of 32: each row still its own bits at
any row count, a one-row step ~0.8x the float32 route's time and a verify's extra rows cheap
(on AMX), the products within ~2e-5 of the float32 ones but not their bits.

$SPECSPLIT_CPU_AVX512=0 runs the AVX2 + FMA variant (8 lanes, no 8-bit route) on a CPU with
AVX-512 too: what a CPU without AVX-512 runs, for its tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specsplit.model import cpu_quant
from specsplit.model.cpu_quant import Packed, Runs
from specsplit.model.tokenizer_cache import cache_root
from specsplit.switches import env_switch

log = logging.getLogger(__name__)

# the GEMM, and cpu_layer.c's decoder layer that calls it (specsplit/model/cpu_layer.py)
SOURCES = (Path(__file__).with_name("cpu_gemm.c"), Path(__file__).with_name("cpu_layer.c"))
FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off"]


class RunArgs(ctypes.Structure):
    """cpu_layer.c's Run: a run of a matrix's rows packed in one kind."""

    _fields_ = [
        ("packed", ctypes.c_void_p), ("stride", ctypes.c_int64), ("kind", ctypes.c_int64),
        ("rows", ctypes.c_int64),
    ]  # fmt: skip


class WeightArgs(ctypes.Structure):
    """cpu_layer.c's Weight: a float32 matrix and its packed runs, if any."""

    _fields_ = [
        ("w", ctypes.c_void_p), ("num_runs", ctypes.c_int64),
        ("runs", RunArgs * cpu_quant.MAX_RUNS),
    ]  # fmt: skip


class Library:
    """The loaded kernel and the lanes this CPU's variant uses (16 or 8)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cdll = ctypes.CDLL(str(path))
        self.cdll.fixed_gemm_lanes.restype = ctypes.c_int
        self.lanes = int(self.cdll.fixed_gemm_lanes())
        avx512 = env_switch("SPECSPLIT_CPU_AVX512")
        if not avx512 and self.lanes == 16:
            self.lanes = 8
        self._gemm = self.cdll.fixed_gemm
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._gemm.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
        self._gemm.argtypes += [ctypes.c_int]
        self._gemm.restype = None
        self._quant = self.cdll.quant_gemm
        self._quant.argtypes = [ptr, i64, ptr, i64, ctypes.c_int, ptr, i64, i64, i64, i64]
        self._quant.argtypes += [ctypes.c_int, ctypes.c_int]
        self._quant.restype = None
        self._weight_gemm = self.cdll.weight_gemm
        self._weight_gemm.argtypes = [ctypes.POINTER(WeightArgs), ptr, i64, ptr, i64, i64, i64]
        self._weight_gemm.argtypes += [i64, ctypes.c_int, ctypes.c_int]
        self._weight_gemm.restype = None
        self.cdll.amx_int8_ready.restype = ctypes.c_int
        self.cdll.vnni_int8_ready.restype = ctypes.c_int
        self.amx = avx512 and bool(self.cdll.amx_int8_ready())
        self.vnni = avx512 and bool(self.cdll.vnni_int8_ready())
        self.int8_ready = self.amx or self.vnni  # (the two kernels give the same bits)
        self.cdll.int8_kernel_rows.argtypes = [i64]
        self.cdll.int8_kernel_rows.restype = i64

    def int8_kernel_rows(self, rows: int) -> int:
        """Products on panels of at least `rows` rows of x take AMX's tiles where the CPU has
        both kernels, fewer AVX-512 VNNI (the C file's AMX_FROM_ROWS, 1, by default; tests and
        bench/cpu_int8_gemm.py: a large number for VNNI only); returns the number it
        replaces."""
        return int(self.cdll.int8_kernel_rows(rows))

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, lanes: int) -> None:
        """out [M, N] = x [M, K] @ weight [N, K].T, rows of each contiguous (checked by the
        caller), with `lanes` 16 or 8 (what this CPU runs)."""
        num_rows, k_len = x.shape
        self._gemm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
            out.data_ptr(), out.stride(0), num_rows, weight.shape[0], k_len, lanes,
            torch.get_num_threads(),
        )  # fmt: skip

    def weight(self, x: torch.Tensor, weight: WeightArgs, out: torch.Tensor, lanes: int) -> None:
        """`gemm` through cpu_layer.c's weight_gemm: from the weight's packed runs where it has
        them, else its float32 values (the same bits)."""
        num_rows, k_len = x.shape
        self._weight_gemm(
            ctypes.byref(weight), x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
            num_rows, out.shape[1], k_len, lanes, torch.get_num_threads(),
        )  # fmt: skip

    def quant(self, x: torch.Tensor, packed: Packed, out: torch.Tensor, lanes: int) -> None:
        """`gemm` with the packed weights (specsplit/model/cpu_quant.py) of a matrix [N, K]
        (`out`'s rows may be strided)."""
        num_rows, k_len = x.shape
        data = packed.data
        self._quant(
            x.data_ptr(), x.stride(0), data.data_ptr(), data.stride(0), packed.kind,
            out.data_ptr(), out.stride(0), num_rows, packed.rows, k_len, lanes,
            torch.get_num_threads(),
        )  # fmt: skip


@functools.cache
def int8_switch() -> bool:
    """$SPECSPLIT_CPU_INT8: "1" (default) or "0": 4-bit and 8-bit GGUF weights regrouped into
    panels and multiplied with x as two 8-bit parts on AMX's tiles (cpu_gemm.c's int8_gemm) or
    with AVX-512 VNNI (vnni_gemm) where this CPU has them (on AMX a step 0.7-0.85x the float32
    route's time from 1 to 16 rows)."""
    return env_switch("SPECSPLIT_CPU_INT8")


def int8_route() -> bool:
    """Whether packed 4-bit and 8-bit weights go to panels (`int8_switch` on and AMX's 8-bit
    tiles or AVX-512 VNNI ready)."""
    lib = library()
    return int8_switch() and lib is not None and lib.int8_ready


def half_panels() -> bool:
    """Whether panels take float16 scales (`cpu_quant.panels(half=True)`, kinds 7 and 8: a
    one-row product reads 0.83x / 0.94x the bytes of a 4-bit / 8-bit matrix): where the CPU has
    AVX-512 VNNI and not AMX's tiles, whose int8_gemm reads float32 ones."""
    lib = library()
    return lib is not None and lib.vnni and not lib.amx


def weight_args(weight: torch.Tensor, runs: Runs | None) -> WeightArgs:
    """cpu_layer.c's Weight of a float32 matrix and its packed runs (None: none)."""
    held = WeightArgs(weight.data_ptr(), len(runs or ()))
    for i, run in enumerate(runs or ()):
        held.runs[i] = RunArgs(run.data.data_ptr(), run.data.stride(0), run.kind, run.rows)
    return held


@functools.cache
def library() -> Library | None:
    """The kernel, built into the cache if no build of this source and compiler is there yet;
    None (logged once) where it cannot be built or this CPU cannot run it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        log.info("cpu_gemm: no C compiler (%s); float32 CPU matmuls take the torch route", compiler)
        return None
    try:
        path = _built(compiler)
        lib = Library(path)
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("cpu_gemm: not built (%s); float32 CPU matmuls take the torch route", e)
        return None
    if lib.lanes == 0:
        log.info("cpu_gemm: this CPU has neither AVX-512 nor AVX2 + FMA; the torch route")
        return None
    return lib


def _built(compiler: str) -> Path:
    """The shared library of SOURCES by `compiler`, built once into the cache (written to a
    temporary file, then renamed: processes starting together each build and one wins)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    sources = b"".join(source.read_bytes() for source in SOURCES)
    key = hashlib.sha256(sources + version.encode() + " ".join(FLAGS).encode())
    directory = cache_root() / "cpu_gemm"
    path = directory / f"cpu_gemm-{key.hexdigest()[:24]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", temporary, *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def fixed_linear(x: torch.Tensor, weight: torch.Tensor, lanes: int | None = None) -> torch.Tensor:
    """x [T, in] @ weight [out, in].T -> [T, out] (float32, CPU), each output in the fixed order
    of cpu_gemm.c (from the weight's packed blocks where cpu_quant attached them, the same
    bits): `library()` must not be None. `lanes` (tests): 8 runs the AVX2 variant on a
    CPU that has AVX-512 too."""
    lib = library()
    assert lib is not None, "fixed_linear without cpu_gemm's library"
    if not (
        x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
    ):
        raise ValueError(
            f"fixed_linear: float32 CPU tensors, got {x.dtype} {x.device}, {weight.dtype} "
            f"{weight.device}"
        )
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fixed_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if lanes not in (None, 8, lib.lanes):
        raise ValueError(f"fixed_linear: lanes {lanes}: this CPU runs {lib.lanes} or 8")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    if out.numel() == 0:
        return out
    runs = cpu_quant.packed(weight)
    if runs is None:
        lib.gemm(x, weight, out, lanes or lib.lanes)
    else:
        lib.weight(x, weight_args(weight, runs), out, lanes or lib.lanes)
    return out
