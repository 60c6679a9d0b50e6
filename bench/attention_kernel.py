"""Paged attention per layer call on a GPU, inside CUDA graphs: split-KV vs single pass vs the
torch reference, for decode (one query per sequence) or `--q-len` queries a sequence (a verify's).

    PYTHONPATH=. python bench/attention_kernel.py [--replays 30] [--json PATH]

Shapes: head_dim 64 x 3 KV heads x group 3 (SmolLM2-135M) and 128 x 8 x 4 (8B); batch 1/8/32,
kv_len 512/4096, page 16 (each sequence's pages shuffled over the cache; `--contiguous`: in
order, as a fresh pool hands them out), bf16; `--shapes` picks some. Each graph holds one call
per layer over that many separate caches (up to 32 layers, ~8 GiB), so K/V come from HBM as in a
forward step rather than from L2; each replay is timed with CUDA events and the median over
replays, divided by the layers, is the time per call. `floor` is the K/V bytes at the measured
device-to-device copy bandwidth.
Variants: `auto` (the wrapper's choice, its num_splits in brackets), `auto/no-skip` (auto where
it splits, with SKIP_EMPTY_CHUNKS off: empty chunks store neutral partials), `auto/bn32` (auto
where it splits, with key tiles of 32), `single`
(num_splits=1), `sN` (num_splits=N), `ref` (paged_attention_with_plan, the torch loop, with its
plan built outside the graph; not with `--no-ref`). At batch 1 the split's key tile is also
swept (`sN/bn32`, `sN/bn128`). `--sweep`: the single pass with key tiles of 64 / 128, 8 warps,
2 / 3 / 4 pipeline stages and each tile's page ids loaded a tile ahead (`1/bn64`, `1/st3`,
`1/ahead`, ...: the switch `paged_attention.PAGES_AHEAD`), and auto with them ahead, at 2 and 3
stages (`auto/ahead`, `auto/st3/ahead`). `err` is the largest |auto - float32 reference| of
layer 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import specsplit.kernels.paged_attention as pa
from bench.gpu_engine import copy_bandwidth
from specsplit.kernels.paged_attention_reference import (
    paged_attention_reference,
    paged_attention_with_plan,
    reference_plan,
)

PAGE_SIZE = 16
SHAPES = {"smollm2 (64x3x3)": (3, 3, 64), "8b (128x8x4)": (8, 4, 128)}  # kv heads, group, dim
SPLITS = (2, 4, 8, 16, 32)
# name: (key tile, pipeline stages, PAGES_AHEAD, warps); None: the wrapper's. For sm_90a as
# launched (bench/kernel_regs.py) the 8B's decode tile (16 rows x 128 keys, 4 warps) takes 168
# registers and spills none, its K/V tiles copied through shared memory (cp.async)
SINGLE_SWEEP = {
    "1/ahead": (None, None, True, None),
    "1/bn64": (64, None, False, None),
    "1/bn128": (128, None, False, None),
    "1/bn128/w8": (128, None, False, 8),
    "1/bn32": (32, None, False, None),
    "1/w8": (None, None, False, 8),
    "1/bn32/w8": (32, None, False, 8),
    "1/st2": (None, 2, False, None),
    "1/st3": (None, 3, False, None),
    "1/st3/ahead": (None, 3, True, None),
    "1/st4/ahead": (None, 4, True, None),
    "1/bn64/st3/ahead": (64, 3, True, None),
}
# the split path (auto's chunks where the grid is small) with PAGES_AHEAD, and 3 stages
AUTO_SWEEP = {"auto/ahead": None, "auto/st3/ahead": 3}
CACHE_BUDGET = 8 << 30  # bytes of K/V per (shape, batch, kv_len) across layers


@contextlib.contextmanager
def launch_override(
    split: bool | None,
    block_n: int | None = None,
    stages: int | None = None,
    ahead: bool | None = None,
    warps: int | None = None,
    skip_empty: bool | None = None,
) -> Iterator[None]:
    """Overrides the split path's (`split`), the single pass's, or (None) both paths' key tile,
    pipeline stages and warps; `ahead` sets PAGES_AHEAD and `skip_empty` SKIP_EMPTY_CHUNKS
    (None: as they are) (exploration only)."""
    original = pa._launch_config
    original_ahead, original_skip = pa.PAGES_AHEAD, pa.SKIP_EMPTY_CHUNKS

    def patched(*args: Any) -> tuple[int, int, int, int]:
        block_m, bn, w, st = original(*args)
        if split is None or args[3] == split:
            bn, st, w = block_n or bn, stages or st, warps or w
        return block_m, bn, w, st

    pa._launch_config = patched  # type: ignore[assignment]
    if ahead is not None:
        pa.PAGES_AHEAD = ahead
    if skip_empty is not None:
        pa.SKIP_EMPTY_CHUNKS = skip_empty
    try:
        yield
    finally:
        pa._launch_config = original  # type: ignore[assignment]
        pa.PAGES_AHEAD, pa.SKIP_EMPTY_CHUNKS = original_ahead, original_skip


def make_layers(
    batch: int,
    kv_len: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    q_len: int = 1,
    tree: bool = False,
    contiguous: bool = False,
) -> tuple[list[dict[str, Any]], int]:
    """Arguments of paged_attention per layer (own q and caches, shared metadata; q_len queries
    a sequence, causal among its last q_len keys, or under a tree mask that says the same: a
    chain's, as a verify's; the pages shuffled over the cache as a long-running server's are,
    or with `contiguous` in order as a fresh pool hands them out), and the K/V bytes one call
    reads."""
    cuda = torch.device("cuda")
    pages_per_seq = kv_len // PAGE_SIZE
    num_pages = batch * pages_per_seq + 4
    kv_bytes = batch * kv_len * num_kv_heads * head_dim * 2 * 2
    num_layers = max(1, min(32, CACHE_BUDGET // kv_bytes))
    pages = torch.arange if contiguous else torch.randperm
    table = pages(num_pages, device=cuda)[: batch * pages_per_seq].to(torch.int32)
    meta = {
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32, device=cuda) * q_len,
        "kv_lens": torch.full((batch,), kv_len, dtype=torch.int32, device=cuda),
        "prefix_lens": torch.full((batch,), kv_len - q_len, dtype=torch.int32, device=cuda),
        "block_table": table.view(batch, pages_per_seq),
        "page_size": PAGE_SIZE,
        "tree_mask": torch.ones(q_len, q_len, dtype=torch.bool, device=cuda)
        .tril()
        .expand(batch, q_len, q_len)
        .contiguous()
        if tree
        else None,
        "max_q_len": q_len,
        "scale": head_dim**-0.5,
    }
    slots = num_pages * PAGE_SIZE
    layers = []
    for _ in range(num_layers):
        layers.append(
            {
                "q": torch.randn(
                    batch * q_len, num_kv_heads * group, head_dim, device=cuda
                ).bfloat16(),
                "k_cache": torch.randn(slots, num_kv_heads, head_dim, device=cuda).bfloat16(),
                "v_cache": torch.randn(slots, num_kv_heads, head_dim, device=cuda).bfloat16(),
                **meta,
            }
        )
    return layers, kv_bytes


def time_in_graph(calls: Sequence[Callable[[], Any]], replays: int) -> float:
    """Median microseconds per call over `replays` replays of one graph of all `calls`."""
    for call in calls:  # compile, warm the allocator
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def kernel_call(layer: dict[str, Any], out: torch.Tensor, **kw: Any) -> Callable[[], Any]:
    return lambda: pa.paged_attention(**layer, out=out, **kw)


def reference_call(layer: dict[str, Any], out: torch.Tensor) -> Callable[[], Any]:
    plan_keys = ("cu_seqlens_q", "kv_lens", "prefix_lens", "block_table", "page_size", "tree_mask")
    plan = reference_plan(**{k: layer[k] for k in plan_keys})
    q, k, v, scale = layer["q"], layer["k_cache"], layer["v_cache"], layer["scale"]
    return lambda: paged_attention_with_plan(q, k, v, plan, scale, out)


def bench_one(
    batch: int, kv_len: int, num_kv_heads: int, group: int, head_dim: int, args: argparse.Namespace
) -> dict[str, Any]:
    layers, kv_bytes = make_layers(
        batch, kv_len, num_kv_heads, group, head_dim, args.q_len, args.tree, args.contiguous
    )
    outs = [torch.empty_like(layer["q"]) for layer in layers]
    block_m, _, programs = pa.launch_grid(head_dim, group, args.q_len, batch, num_kv_heads, False)
    auto = pa.launch_splits(head_dim, block_m, programs, torch.device("cuda"))
    row: dict[str, Any] = {"layers": len(layers), "auto_splits": auto}
    row["floor"] = kv_bytes / args.bandwidth * 1e6

    def run(name: str, **kw: Any) -> None:
        calls = [kernel_call(layer, out, **kw) for layer, out in zip(layers, outs, strict=True)]
        row[name] = time_in_graph(calls, args.replays)

    run("auto")
    if auto > 1:  # the split path with neutral partials stored (SKIP_EMPTY_CHUNKS off, an A/B)
        auto_out = outs[0].clone()
        with launch_override(None, skip_empty=False):
            run("auto/no-skip")
        if not torch.equal(outs[0], auto_out):  # (the same sums, empty chunks' zeros left out)
            row.setdefault("not_bitwise", []).append("auto/no-skip")
        with launch_override(True, 32):
            run("auto/bn32")
    run("single", num_splits=1)
    single_out = outs[0].clone()
    for s in SPLITS:
        run(f"s{s}", num_splits=s)
    if batch == 1:
        for block_n in (32, 128):
            with launch_override(True, block_n):
                for s in (8, 16, 32):
                    run(f"s{s}/bn{block_n}", num_splits=s)
    if args.sweep:  # the single pass's tile, stages and page ids a tile ahead; auto's ahead
        for name, (block_n, stages, ahead, warps) in SINGLE_SWEEP.items():
            with launch_override(False, block_n, stages, ahead, warps):
                run(name, num_splits=1)
            if block_n is None and warps is None and not torch.equal(outs[0], single_out):
                row.setdefault("not_bitwise", []).append(name)  # (the same sums, in order)
        for name, stages in AUTO_SWEEP.items():  # (PAGES_AHEAD and stages: both paths)
            with launch_override(None, stages=stages, ahead=True):
                run(name)
    if not args.no_ref:
        calls = [reference_call(layer, out) for layer, out in zip(layers, outs, strict=True)]
        row["ref"] = time_in_graph(calls, args.replays)

    first = layers[0]
    got = pa.paged_attention(**first).float()
    up = {name: first[name].float() for name in ("q", "k_cache", "v_cache")}
    want = paged_attention_reference(**{**first, **up})
    row["err"] = (got - want).abs().max().item()
    single = pa.paged_attention(**first, num_splits=1).float()
    row["err_single"] = (single - want).abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--kv-lens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--q-len", type=int, default=1, help="queries a sequence (1: decode)")
    parser.add_argument(
        "--tree", action="store_true", help="the queries under a chain's tree mask (HAS_TREE)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also the single pass's variants in SINGLE_SWEEP (key tiles 64 / 128, 8 warps, "
        "2 / 3 / 4 stages, page ids a tile ahead: `1/...`), and auto with them ahead (AUTO_SWEEP)",
    )
    parser.add_argument(
        "--contiguous", action="store_true", help="each sequence's pages in order, not shuffled"
    )
    names = sorted(shape.split()[0] for shape in SHAPES)
    parser.add_argument("--shapes", nargs="+", choices=names, default=names)
    parser.add_argument("--no-ref", action="store_true", help="skip the torch reference")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
    torch.manual_seed(0)
    args.bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy {args.bandwidth / 1e12:.2f} TB/s", flush=True)

    rows = []
    for shape, (num_kv_heads, group, head_dim) in SHAPES.items():
        if shape.split()[0] not in args.shapes:
            continue
        for kv_len in args.kv_lens:
            for batch in args.batches:
                row = bench_one(batch, kv_len, num_kv_heads, group, head_dim, args)
                row.update(shape=shape, batch=batch, kv_len=kv_len)
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)

    columns = ["floor", *([] if args.no_ref else ["ref"]), "single", "auto"]
    columns += ["auto/no-skip", "auto/bn32"]
    columns += [f"s{s}" for s in SPLITS]
    columns += [*SINGLE_SWEEP, *AUTO_SWEEP] if args.sweep else []
    print(f"\nus per layer call (median of {args.replays} graph replays), q_len {args.q_len}")
    widths = [max(7, len(c)) for c in columns]
    heads = " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
    print(f"{'shape':18} {'B':>3} {'kv':>5} {heads}   err")
    for r in rows:
        cells = " ".join(  # (nan: not run)
            f"{r.get(c, float('nan')):{w}.1f}" for c, w in zip(columns, widths, strict=True)
        )
        print(f"{r['shape']:18} {r['batch']:3} {r['kv_len']:5} {cells}  {r['err']:.3f} "
              f"[auto s{r['auto_splits']}]")  # fmt: skip
    print("\nbatch 1, split key tile sweep (us)")
    for r in rows:
        if r["batch"] == 1:
            sweep = {k: v for k, v in r.items() if "/bn" in k}
            sweep["s8/bn64"], sweep["s16/bn64"], sweep["s32/bn64"] = r["s8"], r["s16"], r["s32"]
            print(f"{r['shape']:18} kv {r['kv_len']:5}: "
                  + " ".join(f"{k} {v:.1f}" for k, v in sorted(sweep.items())))  # fmt: skip


if __name__ == "__main__":
    main()
