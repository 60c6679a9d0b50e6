"""`specsplit up`: the three services as local child processes, supervised until Ctrl-C."""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import importlib.util
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from specsplit.affinity import affinity_plan
from specsplit.cli_flags import (
    DECODE_LOOKUP_ON_CPU,
    DECODE_STEPS_ON_GPU,
    PREFILL_CHUNK_ON_CPU,
    SHARED_DRAFTER_KV_MEMORY_FRACTION,
)
from specsplit.cli_generate import stream_generation
from specsplit.cli_server_flags import DEFAULT_PORTS
from specsplit.up_security import UpSecurity
from specsplit.up_services import Interrupted, RestartPolicy, ServiceDied, Services

log = logging.getLogger("specsplit.up")
LANE_POLL_MS_ON_GPU = 5.0  # --round-lane-poll-ms auto with the verifier on a GPU


def _opt(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _rates(rates: tuple[float, ...] | None) -> str | None:
    """--synthetic-acceptance's rates as the flag reads them."""
    return None if rates is None else ",".join(map(str, rates))


LIMIT_FLAGS = (  # the gateway's request limits, passed on as given
    "--limit-num-steps",
    "--limit-topk",
    "--limit-num-draft-tokens",
    "--limit-new-tokens",
    "--limit-prompt-bytes",
    "--limit-message-bytes",
    "--max-waiting",
    "--session-ttl",
)


INTERNAL = ("drafter", "verifier")  # the services only the gateway (and `up`) calls


def tcp_addresses(args: argparse.Namespace) -> dict[str, str]:
    """Each service on --host and its --*-port."""
    return {s: f"{args.host}:{getattr(args, f'{s}_port')}" for s in DEFAULT_PORTS}


def internal_transport(args: argparse.Namespace) -> str:
    """--internal-transport auto: Unix sockets, unless --tls auto (then TLS on TCP loopback)."""
    if args.internal_transport != "auto":
        return str(args.internal_transport)
    return "unix" if args.tls == "off" else "tcp"


@contextlib.contextmanager
def service_addresses(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Where the children listen while `up` runs: the gateway on its TCP port; the drafter and
    verifier on Unix sockets in a private directory (mode 0700, removed on exit), or on their
    TCP ports (internal_transport). A Unix socket takes ~35 us off gRPC's ~210 us round trip
    on loopback (2-core VM, bench/RESULTS.md)."""
    addresses = tcp_addresses(args)
    if internal_transport(args) == "tcp":
        yield addresses
        return
    with tempfile.TemporaryDirectory(prefix="specsplit-up-") as socket_dir:  # mkdtemp: 0700
        yield {**addresses, **{s: f"unix:{socket_dir}/{s}.sock" for s in INTERNAL}}


def logged_addresses(log_text: str) -> dict[str, str]:
    """Where the drafter and verifier of an `up` listen, read back from its log (tests, soak)."""
    return dict(re.findall(rf"({'|'.join(INTERNAL)}) listens on (\S+)", log_text))


def child_commands(
    args: argparse.Namespace, addresses: dict[str, str] | None = None
) -> dict[str, list[str]]:
    """argv of the three service processes `up` starts, verifier first; `addresses`: where each
    listens (service_addresses), by default its TCP port."""
    base = [sys.executable, "-m", "specsplit.cli", "--log-level", args.log_level]
    addr = addresses or tcp_addresses(args)
    model = _opt("--model", args.model)
    engine = [*model, "--dtype", args.dtype, "--page-size", str(args.page_size)]
    engine += ["--engine-calls", args.engine_calls]
    engine += _opt("--idle-poll-ms", args.idle_poll_ms)
    engine += _opt("--num-pages", args.num_pages)
    # graphs for every batch the gateway may send (a larger round would run eagerly)
    engine += ["--graph-max-batch", str(max(args.graph_max_batch, args.max_batch_size))]
    device = ["--device", args.device]
    drafter = ["--drafter", args.drafter, "--device", args.drafter_device or args.device]
    drafter += _opt("--draft-model", args.draft_model) + _opt("--draft-layers", args.draft_layers)
    drafter += ["--draft-cuda-graphs", args.draft_cuda_graphs]
    drafter += _opt("--draft-kv-memory-fraction", drafter_kv_memory_fraction(args))
    gateway = ["--drafter-address", addr["drafter"], "--verifier-address", addr["verifier"]]
    gateway += ["--num-steps", str(args.num_steps), "--topk", str(args.topk)]
    gateway += ["--max-batch-size", str(args.max_batch_size)]
    gateway += _opt("--num-draft-tokens", args.num_draft_tokens)
    gateway += ["--adaptive-spec" if args.adaptive_spec else "--no-adaptive-spec"]
    gateway += _opt("--adaptive-ladder", args.adaptive_ladder)
    gateway += ["--http-listen", args.http_listen or "none"]
    gateway += _opt("--served-model-name", args.served_model_name)
    gateway += ["--verifier-wait", str(args.verifier_wait), "--overlap", gateway_overlap(args)]
    gateway += ["--speculation-gate", gateway_speculation_gate(args)]
    gateway += ["--ahead-guesses", str(args.ahead_guesses), "--ahead-miss", args.ahead_miss]
    gateway += ["--verify-ahead", args.verify_ahead]
    gateway += ["--early-verify" if gateway_early_verify(args) else "--no-early-verify"]
    gateway += ["--ahead-max-batch", str(args.ahead_max_batch)]
    gateway += ["--round-lane", args.round_lane]
    gateway += ["--round-lane-poll-ms", str(gateway_lane_poll_ms(args))]
    gateway += ["--decode-steps", str(gateway_decode_steps(args))]
    adaptive = gateway_decode_steps_adaptive(args)
    gateway += ["--decode-steps-adaptive" if adaptive else "--no-decode-steps-adaptive"]
    gateway += ["--decode-steps-quiet-ms", str(args.decode_steps_quiet_ms)]
    gateway += ["--decode-lookup", str(gateway_decode_lookup(args))]
    gateway += ["--decode-lookup-max-batch", str(args.decode_lookup_max_batch)]
    gateway += ["--prefill-chunk", str(gateway_prefill_chunk(args))]
    gateway += ["--prefill-rounds-one-step" if args.prefill_rounds_one_step
                else "--no-prefill-rounds-one-step"]  # fmt: skip
    for flag in LIMIT_FLAGS:
        gateway += _opt(flag, getattr(args, flag.removeprefix("--").replace("-", "_")))
    metrics = metrics_addresses(args.metrics_listen)
    cores = cpu_affinity(args)
    commands = {
        "verifier": [
            *base,
            "serve-verifier",
            "--listen",
            addr["verifier"],
            *engine,
            *device,
            "--cuda-graphs",
            args.cuda_graphs,
            "--kv-memory-fraction",
            str(args.kv_memory_fraction),
            "--kv-dtype",
            args.kv_dtype,
            "--decode-ahead",
            args.decode_ahead,
            "--decode-ahead-max-batch",
            str(args.decode_ahead_max_batch),
            "--decode-ahead-depth",
            str(args.decode_ahead_depth),
            "--chain-rounds",
            args.chain_rounds,
            "--chain-max-batch",
            str(args.chain_max_batch),
            "--chain-min-guess-rate",
            str(args.chain_min_guess_rate),
            "--lookup-min-ngram",
            str(args.lookup_min_ngram),
            *_opt("--synthetic-acceptance", _rates(args.synthetic_acceptance)),
        ],
        "drafter": [*base, "serve-drafter", "--listen", addr["drafter"], *engine, *drafter],
        "gateway": [*base, "serve-gateway", "--listen", addr["gateway"], *model, *gateway],
    }
    for name, pinned in cores.items():
        commands[name] += ["--cpu-cores", ",".join(map(str, sorted(pinned)))]
    return {name: [*cmd, "--metrics-listen", metrics[name]] for name, cmd in commands.items()}


def gateway_overlap(args: argparse.Namespace) -> str:
    """--overlap auto: gated (pipelined groups, draft-ahead or serial rounds, measured per batch
    size) when the drafter and the verifier each have a GPU (a model drafter), else serial
    rounds. Through the services on two H100s groups ran 1.33x / 1.18x serial at batch 8 / 32
    with SmolLM2 and its EAGLE-3 head but 0.84x / 0.94x with an 8B-shaped target and a
    1B-shaped draft model (a Verify of half the batch costs about what one of the whole batch
    does there), draft-ahead 1.14x-1.46x at batch 1 (misses plain, four runs) and 0.74x-0.92x
    above (SmolLM2); on one GPU the modes contend for it and on a CPU for its cores, and lose
    (bench/RESULTS.md)."""
    if args.overlap != "auto":
        return str(args.overlap)
    return "gated" if _two_gpus(args) and args.drafter != "ngram" else "serial"


def _two_gpus(args: argparse.Namespace) -> bool:
    """Whether the drafter and the verifier run on two different GPUs."""
    drafter_device = args.drafter_device or args.device
    return drafter_device != args.device and all(
        d.startswith("cuda") for d in (drafter_device, args.device)
    )


def gateway_early_verify(args: argparse.Namespace) -> bool:
    """--early-verify auto: on when the drafter and the verifier run on two different GPUs. On
    two H100s with an 8B-shaped target and its one-layer draft (synthetic acceptance) groups
    with the early Verify ran 1.25x / 1.38x groups without it at batch 8 / 32, the verifier's
    GPU busy 0.96 / 0.95 of the rounds against 0.81 / 0.78 (the Verify queued on the device
    behind the round in flight instead of sent after its answer). With SmolLM2 and its head
    (a ~2 ms verify) it ran 0.65x / 0.73x of groups in one run (thirty-sixth session) and
    1.10x / 1.02x on SmolLM2-shaped random weights in the next, so `gated`, `up`'s
    overlap there, measures groups with it and without it (Scheduler `early_verify`); on one
    GPU and on a CPU the groups contend for it (0.75x / 0.83x of groups on one H100;
    bench/RESULTS.md)."""
    if args.early_verify is not None:
        return bool(args.early_verify)
    return gateway_overlap(args) != "serial" and _two_gpus(args)


def gateway_speculation_gate(args: argparse.Namespace) -> str:
    """--speculation-gate auto: on, on every device. On a GPU speculation with the embedded
    SmolLM2 and its head streams 0.57-0.79x of the target alone (two H200s), and a larger target
    or another drafter may win: the gate measures. On the CPU, since the packed weights made a
    one-row step ~6 ms, it streams 0.69x of the target alone on the bundled prompts (1.75 tokens
    a round) and the gate 0.97x (it chooses plain rounds there, and speculation where a prompt's
    drafts are accepted more; bench/RESULTS.md)."""
    if args.speculation_gate != "auto":
        return str(args.speculation_gate)
    return "on"


def gateway_lane_poll_ms(args: argparse.Namespace) -> float:
    """--round-lane-poll-ms auto: 5 when the verifier runs on a GPU (the gateway's loop polls
    for each answer instead of sleeping through the engine call: a Verify round 0.07-0.09 ms
    shorter on an H100 host), 0 on a CPU, where a polling gateway takes a core from the engines
    (3x slower rounds on a 2-core VM; bench/RESULTS.md)."""
    if args.round_lane_poll_ms is not None:
        return float(args.round_lane_poll_ms)
    return LANE_POLL_MS_ON_GPU if args.device.startswith("cuda") else 0.0


def gateway_decode_steps(args: argparse.Namespace) -> int:
    """--decode-steps auto: DECODE_STEPS_ON_GPU, on every device. On a GPU a plain round's trip
    through the gateway costs as much as the step itself; on the CPU, since the packed weights
    made the embedded default's step ~6 ms, the ~1 ms trip and the other processes' work on the
    shared cores cost 1.04x-1.08x the tokens a second of 4-step rounds in three alternating
    pairs (bench/RESULTS.md); before, when a step dwarfed the trip, it was 1 there."""
    if args.decode_steps is not None:
        return int(args.decode_steps)
    return DECODE_STEPS_ON_GPU


def gateway_decode_lookup(args: argparse.Namespace) -> int:
    """--decode-lookup auto: DECODE_LOOKUP_ON_CPU with the verifier on a CPU, else 0. On the
    2-core VM (the embedded default, one stream at a time, 128 tokens) chains of 3 streamed
    1.48-1.50x plain steps' tokens a second on the bundled edits of given text and code and
    1.04-1.05x on the chat questions (chains of 5: 1.49x and 0.95-0.99x; bench/RESULTS.md). On
    a GPU a step that verifies a chain runs nothing ahead (the host must see its tokens before
    the next chain), which plain rounds of a small model live on: not measured there yet, so
    off. Either way only in rounds of at most --decode-lookup-max-batch sequences (2: past two
    streams the chains cost more than they saved on the CPU)."""
    if args.decode_lookup is not None:
        return int(args.decode_lookup)
    return 0 if args.device.startswith("cuda") else DECODE_LOOKUP_ON_CPU


def gateway_prefill_chunk(args: argparse.Namespace) -> int:
    """--prefill-chunk auto: PREFILL_CHUNK_ON_CPU with the verifier on a CPU, else 0. On the
    2-core VM a 3,000-token prompt's prefill took ~7 s, and every stream decoding beside it
    waited that long for its next token; in chunks of 512 each waits ~0.5 s a round while the
    prompt goes in (bench/RESULTS.md). A GPU's prefill of the same prompt takes milliseconds:
    not measured there, so off."""
    if args.prefill_chunk is not None:
        return int(args.prefill_chunk)
    return 0 if args.device.startswith("cuda") else PREFILL_CHUNK_ON_CPU


def gateway_decode_steps_adaptive(args: argparse.Namespace) -> bool:
    """--decode-steps-adaptive auto: on when the verifier runs on a GPU and --decode-steps is
    not given. Through the services on two H200s (random SmolLM2, 32 target-only streams,
    bench/RESULTS.md) rounds grown as measured ran 20.9k tokens/s against 13.9k for rounds of
    DECODE_STEPS_ON_GPU (the step after a round's last run ahead in both): the trip between
    rounds (~2.5 ms there) is longer than a step (~1.2 ms), so the step run ahead does not
    cover it. On a CPU the step dwarfs the trip (and no device time is reported); a given
    --decode-steps is kept as asked."""
    if args.decode_steps_adaptive is not None:
        return bool(args.decode_steps_adaptive)
    return args.decode_steps is None and args.device.startswith("cuda")


def drafter_kv_memory_fraction(args: argparse.Namespace) -> float | None:
    """The drafter's KV share: the user's, else a small one when it shares the verifier's GPU
    (both services size their pools from the free memory, loading at the same time)."""
    if args.draft_kv_memory_fraction is not None:
        return float(args.draft_kv_memory_fraction)
    drafter_device = args.drafter_device or args.device
    if drafter_device == args.device and drafter_device != "cpu":
        return SHARED_DRAFTER_KV_MEMORY_FRACTION
    return None


def metrics_addresses(gateway: str | None) -> dict[str, str]:
    """Distinct /metrics addresses: the gateway's, then the drafter and verifier on the next
    two ports (None = all off)."""
    if gateway is None:
        return dict.fromkeys(DEFAULT_PORTS, "none")
    host, _, port = gateway.rpartition(":")
    offsets = {"gateway": 0, "drafter": 1, "verifier": 2}
    return {name: f"{host}:{int(port) + offset}" for name, offset in offsets.items()}


# OpenMP workers of GNU libgomp (torch's CPU runtime) busy-wait this many spins after a parallel
# region before they sleep. The default (300,000) keeps the cores busy into the next service's
# step; too few make every one of a forward's hundreds of regions wake sleeping threads. Measured
# on the 2-core development VM, verify engine time per target-only round: default 41.9 ms,
# 100,000 32.4 ms, 10,000 33.8 ms, 1,000 38.4 ms.
CPU_SPINCOUNT = "100000"


def child_envs(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """On a CPU the three processes take turns on the same cores. The model compute belongs to
    the verifier: the gateway and a weightless n-gram drafter get one torch thread each; every
    service's idle OpenMP workers stop spinning sooner (CPU_SPINCOUNT). Variables the user set
    are kept."""
    light = ["gateway"] + (["drafter"] if args.drafter == "ngram" else [])
    envs: dict[str, dict[str, str]] = {name: {} for name in DEFAULT_PORTS}
    for name in light:
        envs[name]["OMP_NUM_THREADS"] = "1"
    devices = {resolve_device(args.device), resolve_device(args.drafter_device or args.device)}
    if "cpu" in devices:
        for env in envs.values():
            env["GOMP_SPINCOUNT"] = CPU_SPINCOUNT
    return {
        name: {key: value for key, value in env.items() if key not in os.environ}
        for name, env in envs.items()
    }


def resolve_device(device: str) -> str:
    """--device auto as the children resolve it: cuda when torch sees one, else cpu. A torch
    built for no GPU is not imported to ask (~1 s of `up`'s start on a 2-core VM, before the
    children start: they import it beside each other)."""
    if device != "auto":
        return device
    if "torch" not in sys.modules and not _torch_built_for_a_gpu():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_built_for_a_gpu() -> bool:
    """Whether the installed torch was built for CUDA or ROCm (torch/version.py's `cuda` or
    `hip` set), read without importing torch; True where that file cannot be read."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    try:
        tree = ast.parse(Path(spec.submodule_search_locations[0], "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    built = {"cuda": True, "hip": True}  # (unless the file says otherwise)
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in built and node.value:
                    value = node.value
                    built[target.id] = not (isinstance(value, ast.Constant) and value.value is None)
    return any(built.values())


def cpu_affinity(args: argparse.Namespace) -> dict[str, set[int]]:
    """--cpu-affinity on: each service pinned to cores of its own (`affinity_plan`; the verifier
    first, then the drafter and the gateway), where the machine has enough, once it is SERVING
    (each child's --cpu-cores, `specsplit.affinity.pin_to_cores`: the warm-up's compiles keep
    every core); off (the default): where the OS puts them. Off by default because it did not
    pay: on two H200s, batch-1 draft-ahead rounds through the services (SmolLM2-shaped, the
    shipped head), alternating, ran 574 tokens/s pinned against 572 unpinned (mean of four
    `up`s each; every run within +-15% of its mode's mean, bench/RESULTS.md)."""
    if args.cpu_affinity != "on" or not hasattr(os, "sched_getaffinity"):
        return {}
    plan = affinity_plan(sorted(os.sched_getaffinity(0)), ("verifier", "drafter", "gateway"))
    if not plan:
        log.info("--cpu-affinity: too few cores to give each service its own; not pinned")
    return plan


async def _up(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    security = UpSecurity.from_args(args)  # API keys; --tls auto: a throwaway local CA
    try:
        with service_addresses(args) as addresses:
            for name in INTERNAL:
                log.info("%s listens on %s", name, addresses[name])
            return await _run_services(args, addresses, security, stop)
    finally:
        security.close()


async def _run_services(
    args: argparse.Namespace, addresses: dict[str, str], security: UpSecurity, stop: asyncio.Event
) -> int:
    gateway = addresses["gateway"]
    services = Services(
        security.commands(child_commands(args, addresses)),
        security.envs(child_envs(args)),
        RestartPolicy(args.max_restarts),
    )
    tls = security.client_tls()
    code = 0
    try:
        services.start()
        # (imported once the children start: it brings torch, ~1 s on a 2-core VM)
        from gateway.grpc_clients import wait_ready

        ready = (wait_ready(a, args.ready_timeout, tls=tls) for a in addresses.values())
        all_ready = asyncio.gather(*ready)
        if not all(await services.supervise(all_ready, stop)):
            log.error("not all services SERVING after %.0f s", args.ready_timeout)
            return 1
        print(f"specsplit: gateway listening on {gateway}", file=sys.stderr, flush=True)
        if args.generate is not None:
            code = await services.supervise(
                stream_generation(gateway, args.generate, args, tls), stop
            )
        else:
            await services.supervise(asyncio.Event().wait(), stop)  # until Ctrl-C
    except Interrupted:
        log.info("interrupted")
    except ServiceDied as died:
        log.error("%s; stopping everything", died)
        code = 1
    finally:
        log.info("stopping the services")
        code = max(code, await asyncio.to_thread(services.stop, 30.0))
    return code


def run_up(args: argparse.Namespace) -> int:
    resolve_devices(args)
    return asyncio.run(_up(args))


def resolve_devices(args: argparse.Namespace) -> None:
    """--device auto (and --drafter-device auto) as the children would resolve it: the defaults
    `up` picks per device (overlap, the speculation gate, polling, decode steps) read the
    device, and would take a GPU's `auto` for a CPU."""
    args.device = resolve_device(args.device)
    if args.drafter_device is not None:
        args.drafter_device = resolve_device(args.drafter_device)
