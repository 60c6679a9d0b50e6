"""Start-up cost: loading a checkpoint and `specsplit up`'s time to serve.

Each step runs in a fresh Python process (the first imports and lazy initialisations are part
of what a service pays), --repeat times in turn; the baseline, transformers' own model of the
checkpoint (`AutoModelForCausalLM.from_pretrained`, which is what `load_model` read a GGUF file
through before specsplit/model/gguf_file.py), is measured in the same run:

    PYTHONPATH=. python bench/startup.py [--model PATH] [--repeat 2] [--up]

--up: also `specsplit up` on the model (CPU, embedded default unless --model), seconds from
launch to the gateway's SERVING, and its drafter's and verifier's "ready after" lines: once
converting the GGUF's tokenizer, then --repeat times reading it from the cache the first kept.

--up-only: `up` alone, without the load steps; --up-arg FLAG adds a flag to every `up` (e.g.
--up-arg=--drafter=eagle3). --compile-threads default 1: `up` alone (no load steps, nor --up's
runs), once a value, in turn, --repeat times, with
$TORCHINDUCTOR_COMPILE_THREADS that value (`default`: unset, torch.compile's pool of compile
worker processes, one a core up to 32; 1: compiled in the process) and empty torch.compile and
Triton caches: what a GPU service's warm-up costs on a fresh machine either way.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_TOKENIZER = "from specsplit.model.loader import load_tokenizer\nload_tokenizer(PATH)"
STEPS = {
    "transformers model (baseline)": (
        "from transformers import AutoModelForCausalLM\n"
        "from specsplit.model.loader import from_pretrained_args\n"
        "name, kwargs = from_pretrained_args(PATH)\n"
        "AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kwargs)"
    ),
    "load_model": (
        "from specsplit.model.loader import load_model\nload_model(PATH, torch.float32, 'cpu')"
    ),
    "load_config": "from specsplit.model.loader import load_config\nload_config(PATH)",
    # (each step runs with $SPECSPLIT_CACHE_DIR a new empty directory, but "cached": the
    # previous step's, which kept the tokenizer)
    "load_tokenizer, converting": _TOKENIZER,
    "load_tokenizer, cached": _TOKENIZER,
}
# this checkout: each child runs its code (from its directory too: `-c` and `-m` put the working
# directory first on sys.path, so a copy of this file in another checkout times that one)
ROOT = str(Path(__file__).resolve().parent.parent)
_TIMED = """
import time, torch
PATH = {path!r}
start = time.perf_counter()
{body}
print("SECONDS", time.perf_counter() - start)
"""


def time_step(body: str, path: str, cache_dir: str) -> float:
    """Seconds `body` takes in a fresh process (its imports included, Python's start not),
    its caches (specsplit/model/tokenizer_cache.py) in `cache_dir`."""
    code = _TIMED.format(path=path, body=body)
    env = {**_env(), "SPECSPLIT_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT
    )
    return float(re.findall(r"SECONDS (\S+)", out.stdout)[-1])


def time_up(
    model: str | None,
    cache_dir: str,
    extra: Sequence[str] = (),
    env_extra: Mapping[str, str] | None = None,
) -> tuple[float, str]:
    """Seconds from launching `specsplit up` (its caches in `cache_dir`, `extra` flags, the
    environment with `env_extra`) to its gateway's SERVING, and the services' "ready after"
    lines (`up` stopped once the drafter's is there too)."""
    argv = [sys.executable, "-m", "specsplit.cli", "up", "--http-listen", "none"]
    argv += ["--metrics-listen", "none"] + (["--model", model] if model else []) + list(extra)
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        start = time.monotonic()
        env = {**_env(), "SPECSPLIT_CACHE_DIR": cache_dir, **(env_extra or {})}
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=ROOT)
        try:
            _wait_for_line(proc, log.name, "Gateway SERVING", start)
            seconds = time.monotonic() - start
            # (the gateway serves once the verifier is; the drafter may still be warming up)
            _wait_for_line(proc, log.name, "drafter: ready after", start)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        ready = re.findall(r"(\w+): ready after ([\d.]+ s)", Path(log.name).read_text())
    return seconds, ", ".join(f"{name} {after}" for name, after in ready)


def _wait_for_line(proc: subprocess.Popen[bytes], log: str, line: str, start: float) -> None:
    """Until `up`'s log has `line`; at most 600 s from `start`, and while `up` runs."""
    while line not in Path(log).read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() - start > 600:
            raise RuntimeError(f"up: no {line!r}: {Path(log).read_text()[-2000:]}")
        time.sleep(0.05)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded GGUF)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--up", action="store_true", help="also time `specsplit up`")
    parser.add_argument("--up-only", action="store_true", help="time `specsplit up` alone")
    parser.add_argument("--up-arg", action="append", default=[], help="a flag for `up`")
    parser.add_argument(
        "--compile-threads", nargs="+", default=None, help="`default` or N: cold compile caches"
    )
    args = parser.parse_args()
    if args.compile_threads:
        compile_threads(args)
        return
    from specsplit.model.embedded import embedded_default_model_path

    path = args.model or embedded_default_model_path()
    times: dict[str, list[float]] = {name: [] for name in STEPS}
    with tempfile.TemporaryDirectory() as root:
        # (the steps in turn, so that drift hits them alike)
        for turn in range(0 if args.up_only else args.repeat):
            for i, (name, body) in enumerate(STEPS.items()):
                cache_dir = os.path.join(root, f"{turn}-{i - (name.endswith('cached'))}")
                times[name].append(time_step(body, path, cache_dir))
    if not args.up_only:
        print(f"{path}, {args.repeat} runs each, fresh processes, seconds (median; runs)")
        baseline = statistics.median(times["transformers model (baseline)"])
        for name, runs in times.items():
            median = statistics.median(runs)
            shown = ", ".join(f"{t:.2f}" for t in runs)
            ratio = f"baseline / this {baseline / median:.1f}x"
            print(f"  {name:<30} {median:6.2f}  ({shown}; {ratio})")
    if args.up or args.up_only:  # (the first `up` keeps the tokenizer, the next ones read it)
        with tempfile.TemporaryDirectory() as cache_dir:
            for turn in range(args.repeat + 1):
                seconds, ready = time_up(args.model, cache_dir, args.up_arg)
                kept = "cached" if turn else "converting"
                print(f"  specsplit up to SERVING ({kept}) {seconds:6.2f}  ({ready})")


def compile_threads(args: argparse.Namespace) -> None:
    """`up` to SERVING with each $TORCHINDUCTOR_COMPILE_THREADS in turn, compile caches empty."""
    times: dict[str, list[float]] = {value: [] for value in args.compile_threads}
    with tempfile.TemporaryDirectory() as root:
        for turn in range(args.repeat):
            for value in args.compile_threads:
                run_dir = os.path.join(root, f"{turn}-{value}")
                env = {
                    "TORCHINDUCTOR_CACHE_DIR": os.path.join(run_dir, "inductor"),
                    "TRITON_CACHE_DIR": os.path.join(run_dir, "triton"),
                }
                if value != "default":
                    env["TORCHINDUCTOR_COMPILE_THREADS"] = value
                seconds, ready = time_up(args.model, run_dir, args.up_arg, env)
                times[value].append(seconds)
                print(f"  compile threads {value:>7}: up to SERVING {seconds:6.2f}  ({ready})")
    for value, runs in times.items():
        print(f"compile threads {value:>7}: median {statistics.median(runs):6.2f} s ({len(runs)})")


if __name__ == "__main__":
    main()
