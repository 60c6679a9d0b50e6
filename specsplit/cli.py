"""`specsplit`: run the services, all three at once (`up`), or a streamed generation.

Every flag takes its default from a SPECSPLIT_* environment variable (shown in --help), so a
docker-compose file sets the environment and runs `specsplit serve-<service>`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from specsplit.cli_args import flag, optional_str
from specsplit.cli_flags import (
    adaptive_rungs,
    default_spec,
    drafter_flags,
    generation_flags,
    model_flags,
    spec_flags,
    verifier_flags,
)
from specsplit.cli_generate import stream_generation
from specsplit.cli_serve import (
    quiet_progress_bars,
    serve_drafter,
    serve_gateway,
    serve_verifier,
    start_observability,
)
from specsplit.cli_server_flags import (
    DEFAULT_PORTS,
    api_key_flags,
    backend_tls_flags,
    client_tls_flags,
    fault_flags,
    host_flag,
    http_flags,
    limit_flags,
    resolve_hosts,
    round_lane_flag,
    server_flags,
    tls_files,
    tls_flags,
)
from specsplit.up import resolve_device, run_up

log = logging.getLogger("specsplit.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specsplit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    flag(parser, "--log-level", "INFO", "logging level", choices=levels, type=str.upper)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    drafter = commands.add_parser("serve-drafter", help="run the drafter service")
    server_flags(drafter, "drafter")
    tls_flags(drafter, "drafter")
    model_flags(drafter)
    drafter_flags(drafter)

    verifier = commands.add_parser("serve-verifier", help="run the verifier service")
    server_flags(verifier, "verifier")
    tls_flags(verifier, "verifier")
    model_flags(verifier)
    verifier_flags(verifier)

    gateway = commands.add_parser("serve-gateway", help="run the gateway (the client API)")
    server_flags(gateway, "gateway")
    model_flags(gateway, engine=False)
    for service in ("drafter", "verifier"):
        address = f"localhost:{DEFAULT_PORTS[service]}"
        flag(gateway, f"--{service}-address", address, f"the {service} to connect to")
    spec_flags(gateway)
    fault_flags(gateway)
    limit_flags(gateway)
    http_flags(gateway)
    api_key_flags(gateway, server=True)
    tls_flags(gateway, "gateway")
    backend_tls_flags(gateway)
    round_lane_flag(gateway)

    up = commands.add_parser("up", help="run the three services locally until Ctrl-C")
    host_flag(up, "the services (gRPC, HTTP, metrics)")
    for service, port in DEFAULT_PORTS.items():
        internal = "" if service == "gateway" else " (on TCP: --internal-transport)"
        flag(up, f"--{service}-port", port, f"{service} port{internal}", type=int)
    transport_help = (
        "how the gateway reaches the drafter and verifier: unix (Unix sockets in a private"
        " temporary directory, removed when up stops; cheaper than TCP loopback), tcp (their"
        " --*-port on --host; with --tls auto always) or auto (unix, tcp with --tls auto)"
    )
    choices = ("auto", "unix", "tcp")
    flag(up, "--internal-transport", "auto", transport_help, choices=choices)
    round_lane_flag(up)
    model_flags(up)
    verifier_flags(up)
    flag(up, "--drafter-device", None, "the drafter's torch device; none = --device")
    drafter_flags(up)
    spec_flags(up)
    fault_flags(up, up=True)
    limit_flags(up)
    http_flags(up)
    metrics_help = "gateway's /metrics address; drafter and verifier take the next ports"
    flag(up, "--metrics-listen", ":9400", f"{metrics_help}; none = off", type=optional_str)
    flag(up, "--ready-timeout", 900.0, "seconds to wait for SERVING", type=float)
    flag(up, "--generate", None, "once serving, stream one generation of this prompt and stop")
    generation_flags(up)
    api_key_flags(up, server=True)
    tls_help = "auto = a throwaway local CA: TLS everywhere, mutual TLS to drafter and verifier"
    flag(up, "--tls", "off", f"{tls_help}; off = plaintext", choices=("off", "auto"))
    affinity_help = (
        "on: each service's process runs on 2 cores of its own (the verifier on the highest,"
        " then the drafter, then the gateway), where at least 8 are there; off: where the OS"
        " puts them"
    )
    flag(up, "--cpu-affinity", "off", affinity_help, choices=("on", "off"))

    generate = commands.add_parser("generate", help="stream a generation from a gateway")
    generate.add_argument("prompt", help="prompt text")
    address = f"localhost:{DEFAULT_PORTS['gateway']}"
    flag(generate, "--address", address, "the gateway to connect to", env="GATEWAY_ADDRESS")
    generation_flags(generate)
    api_key_flags(generate, server=False)
    client_tls_flags(generate)
    _train_drafter_parser(commands)
    return parser


def _train_drafter_parser(commands: Any) -> None:
    """`specsplit train-drafter`: flags of drafter/train.py."""
    p = commands.add_parser(
        "train-drafter",
        help="train an EAGLE-3 head for a target by self-distillation (drafter/train.py)",
    )
    model_flags(p, engine=False)
    flag(p, "--device", "auto", "torch device; auto = cuda when available")
    flag(p, "--out", "eagle3-head", "output directory (resumes from what it finds there)")
    flag(p, "--prompts", None, "JSON-lines prompt file; default: the bundled set")
    flag(p, "--limit-prompts", 0, "use only the first N prompts (0 = all)", type=int)
    flag(p, "--max-new-tokens", 256, "answer length limit when the target answers", type=int)
    flag(p, "--answer-batch-size", 64, "prompts answered per generate call", type=int)
    flag(p, "--answers-per-prompt", 1, "answers per prompt: 1 greedy, the rest sampled", type=int)
    flag(p, "--answer-temperature", 0.8, "temperature of the sampled answers", type=float)
    flag(p, "--init-head", None, "start from this head (fine-tune; keeps its draft vocabulary)")
    flag(p, "--draft-vocab-size", 8192, "draft vocabulary (most frequent answer tokens)", type=int)
    flag(p, "--ttt-steps", 7, "draft steps unrolled in training (training-time test)", type=int)
    flag(p, "--step-decay", 0.8, "loss weight of draft step k is decay**k", type=float)
    flag(p, "--epochs", 10, "passes over the training answers", type=int)
    flag(p, "--batch-tokens", 16384, "padded tokens per training batch", type=int)
    flag(p, "--max-len", 1024, "tokens per training sequence (longer ones are cut)", type=int)
    flag(p, "--lr", 1e-3, "peak learning rate (AdamW)", type=float)
    flag(p, "--warmup-steps", 50, "linear warm-up steps", type=int)
    flag(p, "--grad-clip", 0.5, "gradient norm clip", type=float)
    flag(p, "--save-every", 100, "steps between resumable checkpoints", type=int)
    flag(p, "--max-minutes", 0.0, "stop (resumable) after this long; 0 = no limit", type=float)
    flag(p, "--seed", 0, "initialisation and batch order", type=int)
    flag(p, "--report-prompts", 64, "held-out prompts run through the engines (0: none)", type=int)
    flag(p, "--report-new-tokens", 128, "tokens generated per held-out prompt", type=int)
    p.add_argument("--skip-report", action="store_true", help="no held-out report at the end")


def _resolve_drafter(args: argparse.Namespace) -> None:
    """--drafter auto: the shipped EAGLE-3 head when the target is the embedded default and the
    drafter runs on a GPU, else n-gram (prompt lookup). On the CPU the head's round (~3.7 ms on
    the 2-core VM) and its 4-row verify cost more than its 1.6-1.8 tokens a round save, so the
    gate decodes plainly; prompt lookup drafts for nothing and streams 1.30x the target alone
    where answers copy the prompt (bench/e2e.py --prompts grounded), 1.01x on chat questions,
    where the gate decodes plainly (bench/RESULTS.md). --drafter eagle3 without --draft-model
    on the embedded default: the shipped head."""
    if getattr(args, "drafter", None) is None:
        return
    embedded = not args.model
    if args.drafter == "auto":
        on_cpu = resolve_device(getattr(args, "drafter_device", None) or args.device) == "cpu"
        args.drafter = "eagle3" if embedded and not on_cpu else "ngram"
    if args.drafter == "eagle3" and not args.draft_model and embedded:
        from specsplit.model.embedded import embedded_default_head_path

        args.draft_model = embedded_default_head_path()


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag rules argparse cannot express."""
    if hasattr(args, "api_key"):
        from gateway.auth import parse_keys

        args.api_key = parse_keys(args.api_key, os.environ.get("SPECSPLIT_API_KEY"))
    if args.command.startswith("serve-"):
        mutual = args.command != "serve-gateway"
        try:
            tls_files(args).check(f"--tls-* of {args.command}", require_ca=mutual)
            tls_files(args, "backend_tls").check("--backend-tls-*", require_cert=False)
        except ValueError as err:
            parser.error(str(err))
    if args.command == "up" and args.internal_transport == "unix" and args.tls != "off":
        parser.error("--internal-transport unix: --tls auto runs on TCP loopback")
    if getattr(args, "drafter", None) in ("model", "eagle3") and not args.draft_model:
        parser.error(f"--drafter {args.drafter} needs --draft-model")
    if getattr(args, "drafter", None) == "self" and not args.draft_layers:
        parser.error("--drafter self needs --draft-layers K (K > 0)")
    if getattr(args, "kv_dtype", "auto") == "float16" and (
        args.device.startswith("cuda") or args.dtype not in ("auto", "float32")
    ):
        parser.error("--kv-dtype float16: on the CPU under a float32 model only")
    if hasattr(args, "num_steps"):
        from specsplit.errors import ServiceError

        try:
            default_spec(args).validate()
        except ServiceError as err:
            parser.error(f"default {err.message}")
        for name in ("num_steps", "topk", "num_draft_tokens"):
            value, limit = getattr(default_spec(args), name), getattr(args, f"limit_{name}")
            if value > limit:
                flag = "--limit-" + name.replace("_", "-")
                parser.error(f"the default {name} {value} is over {flag} {limit}")
        try:
            adaptive_rungs(args)
        except ValueError as err:
            parser.error(f"--adaptive-ladder: {err}")


def generate(args: argparse.Namespace) -> int:
    return asyncio.run(stream_generation(args.address, args.prompt, args))


def up(args: argparse.Namespace) -> int:

    return run_up(args)


def train_drafter(args: argparse.Namespace) -> int:
    from drafter.train import train_drafter as run

    return run(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve-drafter": serve_drafter,
    "serve-verifier": serve_verifier,
    "serve-gateway": serve_gateway,
    "up": up,
    "generate": generate,
    "train-drafter": train_drafter,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_hosts(args)
    _resolve_drafter(args)
    _check(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    service = args.command.removeprefix("serve-")
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
    if args.command.startswith("serve-"):
        quiet_progress_bars()
        start_observability(service, args.metrics_listen)
    try:
        with profiled(service):
            return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    finally:
        # Exiting: spare the interpreter's last garbage collections over torch's and
        # transformers' objects (measured 1-2 s on a 2-core box), time a stop's grace is for.
        gc.freeze()


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """With $SPECSPLIT_PROFILE_DIR set (a developer's switch, for benches): the command's main
    thread under cProfile from one SIGUSR2 to the next (a toggle), its stats written to
    DIR/<name>-<pid>.prof at each stop and when the command returns. bench/profile_services.py
    signals the three services around its timed run, so loading and warm-up stay out. The event
    loop runs on the main thread, and on a GPU the engine calls too (--engine-calls); an engine
    thread's calls on the CPU are not in it. Not SIGUSR1: in the GPU services something loaded
    after this handler takes that signal over, and a Python handler for it never runs there."""
    directory = os.environ.get("SPECSPLIT_PROFILE_DIR")
    if not directory:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    path = os.path.join(directory, f"{name}-{os.getpid()}.prof")

    def start() -> None:
        try:
            profile.enable()
            logging.getLogger(__name__).info("profile started: %s", path)
        except ValueError as e:  # another profiling tool holds the interpreter's hook
            # (Python 3.12+: sys.monitoring's profiler id): say which, beside the profile
            monitoring = getattr(sys, "monitoring", None)
            holder = None if monitoring is None else monitoring.get_tool(monitoring.PROFILER_ID)
            message = f"profile not started: {e} (the profiler hook's holder: {holder!r})"
            logging.getLogger(__name__).warning("%s", message)
            os.makedirs(directory, exist_ok=True)
            with open(path.removesuffix(".prof") + ".error", "w") as f:
                f.write(message + "\n")

    def stop() -> None:
        profile.disable()
        os.makedirs(directory, exist_ok=True)
        profile.dump_stats(path)
        functions = len(profile.getstats())
        logging.getLogger(__name__).info("profile written: %s, %d functions", path, functions)

    running = False

    def toggle(signum: int, frame: object) -> None:
        nonlocal running
        running = not running
        (start if running else stop)()

    handler = signal.signal(signal.SIGUSR2, toggle)
    try:
        yield
    finally:
        stop()
        signal.signal(signal.SIGUSR2, handler)


if __name__ == "__main__":
    sys.exit(main())
