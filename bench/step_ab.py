"""The verifier engine's decode step (or, --verify-n N, its verify round of 1 + N tokens: the
pending token and a chain of N random drafts) under several kernel switches, alternating in one
process.

    PYTHONPATH=. python bench/step_ab.py --shape smollm2-135m --batch 1 8 32 \
        --variant base= --variant nopdl=pdl=0 --variant unfused=rows=4 \
        --variant small32=rows=32

A switch changes a step by ~10% where two processes of one setup differ by as much (bench/
RESULTS.md, fiftieth session), so a verdict needs the setups side by side in one process: each
variant is an engine of its own (its KV cache, its CUDA graphs captured under its switches) on
one set of random weights, and the timing goes round the variants `--reps` times, `--steps`
target-only decode rounds of `--decode-steps` steps each a turn, per batch. Prints each
variant's median ms a step over its turns, its ratio to the first variant's (the median of the
turns' ratios, with their least and most), and whether its tokens equal the first variant's
(switches that keep the arithmetic, as programmatic dependent launch does, must give the same
tokens; the tensor-core path sums in another order, so its bf16 tokens may part).

Switches (module globals read at each launch, set before a variant's capture and its turns;
small_linear's in specsplit.kernels.small_linear_tiles):
  pdl=0|1         programmatic dependent launch (specsplit.kernels.triton_jit.PDL_SWITCH)
  pages_ahead=0|1 paged attention loads each key tile's page ids a tile ahead
                  (specsplit.kernels.paged_attention.PAGES_AHEAD)
  skip_empty=0|1  split-KV's empty chunks store their max alone (SKIP_EMPTY_CHUNKS)
  decode_stages=N pipeline stages of paged attention's causal decode tile (DECODE_STAGES)
  wide_block_n=N  the key tile of a verify tree's wide blocks (paged_attention.WIDE_BLOCK_N)
  wide_warps=N    their warps (WIDE_WARPS)
  wide_split=N    split, their target programs a SM (WIDE_SPLIT_PROGRAMS_PER_SM)
  split=N         decode blocks' split target, programs a SM, for heads of at most 64
                  (SPLIT_PROGRAMS_PER_SM)
  split_large=N   the same for wider heads (LARGE_HEAD_SPLIT_PROGRAMS_PER_SM)
  prefetch=0|1    with it, small_linear's L2 prefetch of the weights (PREFETCH)
  pdl_dot=0|1     with it, the tensor-core path's launches too (PDL_ON_TENSOR_CORES)
  late=0|1        with those, the next kernel launched after the K loop (PDL_TRIGGER_LATE)
  rows=4|16|32    the most rows on the small-linear path (llama.SMALL_LINEAR_ROWS; above 4 the
                  tensor-core path, 17-32 rows as one 32-row block: DOT_ROWS)
  tiles=N/K/W/S   the tensor-core path's tiles (DOT_TILES), e.g. 32/64/4/4
  prefetch_lines=N  with the prefetch, at most N (a power of two) 128-byte lines of each weight
                  row, its first (PREFETCH_MAX_LINES; 0 = whole rows, the default)
  max_weight_mb=N the largest layer weight, MB, whose model takes the small-linear path
                  (llama.SMALL_LINEAR_MAX_WEIGHT_BYTES, default 16: SmolLM2 does, an 8B does not;
                  e.g. 1024 puts an 8B's batch-1 steps on the broadcast path's fused kernels)
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

import torch

from bench.gpu_engine import SHAPES, EngineBench, median_ms, random_model
from specsplit.kernels import paged_attention, small_linear_tiles, triton_jit
from specsplit.model import llama


@dataclass
class Variant:
    name: str
    switches: dict[str, str]
    bench: EngineBench | None = None
    states: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    ms: dict[int, list[float]] = field(default_factory=dict)  # batch -> ms a step, per turn
    tokens: dict[int, list[int]] = field(default_factory=dict)  # batch -> the first turn's


def parse_variant(text: str) -> Variant:
    """NAME=KEY=VALUE,KEY=VALUE (NAME= alone: the defaults)."""
    name, _, rest = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=KEY=VALUE,...")
    switches = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in SWITCHES:
            raise argparse.ArgumentTypeError(f"{item!r}: one of {', '.join(SWITCHES)}=VALUE")
        switches[key] = value
    return Variant(name, switches)


def _rows(value: str) -> None:
    rows = int(value)
    if rows not in (4, 16, 32):
        raise SystemExit(f"rows={value}: 4, 16 or 32")
    llama.SMALL_LINEAR_ROWS = rows
    small_linear_tiles.DOT_ROWS = max(16, rows)


def _tiles(value: str) -> None:
    tiles = tuple(int(v) for v in value.split("/"))
    small_linear_tiles.DOT_TILES = tiles  # type: ignore[assignment]


def _max_weight_mb(value: str) -> None:
    megabytes = int(value)
    if megabytes <= 0:
        raise SystemExit(f"max_weight_mb={value}: a positive number of MB")
    llama.SMALL_LINEAR_MAX_WEIGHT_BYTES = megabytes << 20


def _prefetch_lines(value: str) -> None:
    lines = int(value)
    if lines < 0 or lines & (lines - 1):
        raise SystemExit(f"prefetch_lines={value}: 0 or a power of two")
    small_linear_tiles.PREFETCH_MAX_LINES = lines or None


def _pdl(value: str) -> None:
    if value not in ("0", "1"):
        raise SystemExit(f"pdl={value}: 0 or 1")
    triton_jit.PDL_SWITCH = value


SWITCHES = {
    "pdl": _pdl,
    "pages_ahead": lambda value: setattr(paged_attention, "PAGES_AHEAD", value == "1"),
    "skip_empty": lambda value: setattr(paged_attention, "SKIP_EMPTY_CHUNKS", value == "1"),
    "decode_stages": lambda value: setattr(paged_attention, "DECODE_STAGES", int(value)),
    "wide_block_n": lambda value: setattr(paged_attention, "WIDE_BLOCK_N", int(value)),
    "wide_warps": lambda value: setattr(paged_attention, "WIDE_WARPS", int(value)),
    "wide_split": lambda value: setattr(paged_attention, "WIDE_SPLIT_PROGRAMS_PER_SM", int(value)),
    "split": lambda value: setattr(paged_attention, "SPLIT_PROGRAMS_PER_SM", int(value)),
    "split_large": lambda value: setattr(
        paged_attention, "LARGE_HEAD_SPLIT_PROGRAMS_PER_SM", int(value)
    ),
    "prefetch": lambda value: setattr(small_linear_tiles, "PREFETCH", value != "0"),
    "pdl_dot": lambda value: setattr(small_linear_tiles, "PDL_ON_TENSOR_CORES", value == "1"),
    "late": lambda value: setattr(small_linear_tiles, "PDL_TRIGGER_LATE", value == "1"),
    "rows": _rows,
    "tiles": _tiles,
    "max_weight_mb": _max_weight_mb,
    "prefetch_lines": _prefetch_lines,
}
DEFAULTS = {
    "pdl": triton_jit.PDL_SWITCH,
    "pages_ahead": "1" if paged_attention.PAGES_AHEAD else "0",
    "skip_empty": "1" if paged_attention.SKIP_EMPTY_CHUNKS else "0",
    "decode_stages": str(paged_attention.DECODE_STAGES),
    "wide_block_n": str(paged_attention.WIDE_BLOCK_N),
    "wide_warps": str(paged_attention.WIDE_WARPS),
    "wide_split": str(paged_attention.WIDE_SPLIT_PROGRAMS_PER_SM),
    "split": str(paged_attention.SPLIT_PROGRAMS_PER_SM),
    "split_large": str(paged_attention.LARGE_HEAD_SPLIT_PROGRAMS_PER_SM),
    "prefetch": "1" if small_linear_tiles.PREFETCH else "0",
    "pdl_dot": "1" if small_linear_tiles.PDL_ON_TENSOR_CORES else "0",
    "late": "1" if small_linear_tiles.PDL_TRIGGER_LATE else "0",
    "rows": str(llama.SMALL_LINEAR_ROWS),
    "tiles": "",
    "max_weight_mb": str(llama.SMALL_LINEAR_MAX_WEIGHT_BYTES >> 20),
    "prefetch_lines": str(small_linear_tiles.PREFETCH_MAX_LINES or 0),
}


def apply(variant: Variant) -> None:
    """Every switch as `variant` sets it, the rest at their defaults (as at import)."""
    for key, setter in SWITCHES.items():
        value = variant.switches.get(key, DEFAULTS[key])
        if key == "tiles" and not value:
            small_linear_tiles.DOT_TILES = None
        else:
            setter(value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--variant", type=parse_variant, action="append", default=[])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="rounds a variant's turn")
    parser.add_argument("--reps", type=int, default=7, help="turns a variant")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--verify-n", type=int, default=0, help="verify rounds of 1 + N tokens, not decode steps"
    )
    args = parser.parse_args()
    variants: list[Variant] = args.variant or [parse_variant("base="), parse_variant("nopdl=pdl=0")]
    # EngineBench's: graphs for decode (and verify rounds of 1 + N), decode steps run ahead,
    # every batch's sequences open at once for all the turns (a turn's warm-up and tokens' round
    # included; a verify round commits up to 1 + N tokens and stores its N + 1)
    n = args.verify_n
    args.verify_n, args.decode_ahead = [n] if n else [], True
    args.kv_seqs = sum(args.batch)
    args.kv_room = args.reps * (args.steps + 4) * (n + 2 if n else args.decode_steps) + 64
    steps = 1 if n else args.decode_steps  # a timed call's steps

    def round_of(bench: EngineBench, state: dict[str, tuple[int, int]]) -> None:
        bench.step(state, n, steps)

    hf, config = random_model(args.shape)
    device, dtype = hf.device, hf.dtype
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    what = f"verify rounds of 1 + {n}" if n else f"rounds of {args.decode_steps} decode steps"
    print(
        f"{args.shape} on {name}, {dtype}, context {args.context}, {what}, {args.reps} turns "
        f"of {args.steps} rounds"
    )
    graphs = device.type == "cuda"
    for variant in variants:
        apply(variant)
        variant.bench = EngineBench(hf, config, args, graphs)
        for batch in args.batch:
            variant.states[batch] = variant.bench.open(batch, f"b{batch}-")
    for rep in range(args.reps):
        for variant in variants:
            apply(variant)
            bench = variant.bench
            assert bench is not None
            for batch in args.batch:
                state = variant.states[batch]
                if rep == 0:  # the same prompts, the same steps: the same tokens, or not
                    round_of(bench, state)
                    variant.tokens[batch] = [pending for _, pending in state.values()]
                ms = median_ms(lambda b=bench, s=state: round_of(b, s), args.steps)
                variant.ms.setdefault(batch, []).append(ms / steps)
    report(variants, args.batch, f"verify 1+{n} round" if n else "decode step")
    for variant in variants:  # every page back
        assert variant.bench is not None
        variant.bench.close({k: v for state in variant.states.values() for k, v in state.items()})


def report(variants: list[Variant], batches: list[int], what: str = "decode step") -> None:
    base = variants[0]
    print(f"\nms a {what} (median of turns); ratio to {base.name} (median of the turns' "
          "ratios, least-most); tokens as its")  # fmt: skip
    print("| variant | switches | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for variant in variants:
        cells = []
        for batch in batches:
            ms = statistics.median(variant.ms[batch])
            ratios = [a / b for a, b in zip(variant.ms[batch], base.ms[batch], strict=True)]
            same = variant.tokens[batch] == base.tokens[batch]
            cells.append(
                f"{ms:.3f} ({statistics.median(ratios):.3f}x, {min(ratios):.2f}-"
                f"{max(ratios):.2f}; tokens {'same' if same else 'differ'})"
            )
        switches = ",".join(f"{k}={v}" for k, v in variant.switches.items()) or "defaults"
        print(f"| {variant.name} | {switches} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
