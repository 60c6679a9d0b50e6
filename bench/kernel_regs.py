"""Registers, spills and shared memory of the paged-attention kernel per launch config, compiled
for an H100 / H200 (sm_90a) on any machine: no GPU needed (Triton compiles for the target, its
bundled ptxas reports). Count before measuring: a config that spills, or whose registers allow
one program an SM, is where a GPU's time goes first.

    PYTHONPATH=. python bench/kernel_regs.py [--shape 8b smollm2] [--rows 16 64] \
        [--block-n 32 64 128] [--warps 4 8]

Each line: the wrapper's config (`*`, `specsplit.kernels.paged_attention._launch_config` for that
row count) or another; registers a thread, spill stores (bytes a thread), the stack frame, shared
memory (bytes a program), how many programs of it fit an SM by registers (65,536 a SM), and the
`cp.async` copies in its PTX (K/V tiles pipelined through shared memory: 0 means every tile is
loaded into registers first).

The kernel is compiled as a launch specialises it: pointers 16-byte aligned and the integer
arguments the JIT specialises (all but `paged_attention_kernels._ATTENTION_SHAPE_ARGS`) divisible
by 16 where the shape's are. Without those hints (the eighty-eighth session's first version)
Triton can neither vectorise nor pipeline the gathers, and the figures describe a kernel no GPU
runs: the 8B decode tile read 32 registers and 7 KB of spills, as launched it has 168 and none.
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

import specsplit.kernels.paged_attention as pa
import specsplit.kernels.paged_attention_kernels as kernels

SHAPES = {"8b": (4, 128, 8), "smollm2": (3, 64, 3)}  # GQA group, head_dim, KV heads
_POINTERS = {
    "q_ptr": "*bf16",
    "k_ptr": "*bf16",
    "v_ptr": "*bf16",
    "out_ptr": "*bf16",
    "partial_o_ptr": "*fp32",
    "partial_m_ptr": "*fp32",
    "partial_l_ptr": "*fp32",
    "cu_seqlens_q_ptr": "*i32",
    "kv_lens_ptr": "*i32",
    "prefix_lens_ptr": "*i32",
    "block_table_ptr": "*i32",
    "tree_mask_ptr": "*u8",
}
_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
REGISTERS_PER_SM = 65536


def specialised_ints(group: int, head_dim: int, kv_heads: int) -> dict[str, int]:
    """The integer arguments the JIT specialises and their values in a step of this shape (q,
    out [T, heads, D]; K/V caches [slots, KV heads, D])."""
    heads = group * kv_heads
    return {
        "num_heads": heads,
        "stride_q_t": heads * head_dim,
        "stride_q_h": head_dim,
        "stride_k_s": kv_heads * head_dim,
        "stride_k_h": head_dim,
        "stride_v_s": kv_heads * head_dim,
        "stride_v_h": head_dim,
        "stride_o_t": heads * head_dim,
        "stride_o_h": head_dim,
    }


def compile_attention(
    group: int,
    head_dim: int,
    block_m: int,
    block_n: int,
    warps: int,
    stages: int,
    kv_heads: int = 8,
    **flags: Any,
) -> dict[str, int]:
    """The kernel compiled for sm_90a at one config (flags: HAS_TREE, SPLIT, PAGES_AHEAD,
    SKIP_EMPTY; the rest as the wrapper launches a bf16 step with PDL, specialised as the JIT
    does): ptxas's registers, spill stores, stack frame, Triton's shared memory, and the PTX's
    cp.async."""
    constants = {
        "GROUP": group,
        "BLOCK_Q": max(block_m // group, 1),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "HEAD_DIM": head_dim,
        "PAGE_SIZE": 16,
        "HAS_TREE": False,
        "DOT_PRECISION": "tf32",
        "SPLIT": False,
        "PDL": True,
        "PAGES_AHEAD": False,
        "SKIP_EMPTY": False,
        **flags,
    }
    attention, _ = kernels.jitted_kernels(False)
    params = list(inspect.signature(kernels._paged_attention_kernel).parameters)
    signature = {
        p: "constexpr"
        if p in constants
        else _POINTERS.get(p, "fp32" if p == "scale_log2" else "i32")
        for p in params
    }
    ints = specialised_ints(group, head_dim, kv_heads)
    assert set(ints) | set(kernels._ATTENTION_SHAPE_ARGS) | set(_POINTERS) | set(constants) == (
        set(params) - {"scale_log2"}
    ), "kernel_regs: the kernel's arguments changed"
    divisible = [p for p in _POINTERS] + [p for p, value in ints.items() if value % 16 == 0]
    source = triton.compiler.ASTSource(
        fn=attention,
        signature=signature,
        constexprs={(params.index(name),): value for name, value in constants.items()},
        attrs={(params.index(p),): [["tt.divisibility", 16]] for p in divisible},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run(
            [str(_PTXAS), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "stack": number(r"(\d+) bytes stack frame"),
        "shared": int(compiled.metadata.shared),
        "cp_async": len(re.findall(r"cp\.async\.c[ag]", compiled.asm["ptx"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["8b", "smollm2"])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[16, 64], help="BLOCK_M: 16 decode, 64 verify 1+8"
    )
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--stages", type=int, default=None, help="pipeline stages (default: the wrapper's)"
    )
    parser.add_argument("--tree", action="store_true", help="HAS_TREE (a verify's tree mask)")
    parser.add_argument("--split", action="store_true", help="SPLIT (partials for the merge)")
    parser.add_argument("--ahead", action="store_true", help="PAGES_AHEAD")
    parser.add_argument("--skip-empty", action="store_true", help="SKIP_EMPTY (with --split)")
    args = parser.parse_args()
    flags = {"HAS_TREE": args.tree, "SPLIT": args.split, "PAGES_AHEAD": args.ahead,
             "SKIP_EMPTY": args.skip_empty}  # fmt: skip
    print(
        "shape    rows  keys warps stages   regs  spills  stack  shared  programs/SM (regs)"
        "  cp.async"
    )
    for shape in args.shape:
        group, head_dim, kv_heads = SHAPES[shape]
        for rows in args.rows:
            wrapper = pa._launch_config(
                head_dim, group, rows // group, args.split, False, args.tree
            )
            stages = args.stages or wrapper[3]
            for block_n in args.block_n:
                for warps in args.warps:
                    got = compile_attention(
                        group, head_dim, rows, block_n, warps, stages, kv_heads, **flags
                    )
                    fits = REGISTERS_PER_SM // (max(got["registers"], 1) * 32 * warps)
                    mine = (rows, block_n, warps, stages) == wrapper
                    print(
                        f"{shape:8} {rows:4} {block_n:5} {warps:5} {stages:6} {got['registers']:6} "
                        f"{got['spill_stores']:7} {got['stack']:6} {got['shared']:7}  {fits:11}"
                        f"  {got['cp_async']:8}" + ("  *" if mine else ""),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
