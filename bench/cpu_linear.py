"""The CPU's float32 linear routes (specsplit/model/linear.py) over one pass of a model's weights:
the fixed-order kernel (specsplit/model/cpu_gemm.c, `fixed`), the weight-major torch route
(`weight_major`) and MKL's `F.linear` (`torch`, the baseline), at several row counts, with
whether each keeps a row's bits whatever the row count ("exact": every row of a 300-row
product, computed again in batches of 1-128 rows, gives the same bits).

One pass: each layer's qkv, o, gate_up and down projections and the LM head, at the model's
shapes (default: the embedded SmolLM2-135M-Instruct's config), random float32 weights; median
ms of --repeat passes, after one untimed pass.

    PYTHONPATH=. python bench/cpu_linear.py [--model PATH] [--rows 1 4 9 32 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specsplit.model import cpu_gemm
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.linear import weight_major
from specsplit.model.loader import load_config

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shapes(path: str) -> list[tuple[int, int]]:
    """(out, in) of every linear of one forward pass, in order."""
    c = load_config(path)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = [
        (q + 2 * kv, c.hidden_size),
        (c.hidden_size, q),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    return layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


def pass_ms(fn: Linear, weights: list[torch.Tensor], rows: int, repeat: int) -> float:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    for w in weights:  # untimed
        fn(inputs[w.shape[1]], w)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for w in weights:
            fn(inputs[w.shape[1]], w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def exact(fn: Linear, weights: list[torch.Tensor]) -> bool:
    """Every distinct weight shape: rows of a 300-row product equal to the same rows computed
    in batches of 1-128 rows."""
    for w in {tuple(w.shape): w for w in weights}.values():
        x = torch.randn(300, w.shape[1])
        together = fn(x, w)
        for num_rows in (1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 100, 128):
            for start in (0, 300 - num_rows):
                if not torch.equal(fn(x[start : start + num_rows], w), together[start:][:num_rows]):
                    return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 9, 17, 32, 64, 200])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [
        torch.randn(n, k) / k**0.5 for n, k in shapes(args.model or embedded_default_model_path())
    ]
    routes: dict[str, Linear] = {"weight_major": weight_major, "torch (baseline)": F.linear}
    lib = cpu_gemm.library()
    if lib is not None:
        routes = {f"fixed ({lib.lanes} lanes)": cpu_gemm.fixed_linear, **routes}
    print(f"{len(weights)} weights, {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB a pass, "
          f"{args.threads} threads; ms a pass (median of {args.repeat})")  # fmt: skip
    print("| route | " + " | ".join(f"{r} rows" for r in args.rows) + " | exact |")
    print("|---|" + "---:|" * len(args.rows) + "---|")
    for name, fn in routes.items():
        times = [pass_ms(fn, weights, rows, args.repeat) for rows in args.rows]
        cells = " | ".join(f"{t:.1f}" for t in times)
        print(f"| {name} | {cells} | {'yes' if exact(fn, weights) else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
