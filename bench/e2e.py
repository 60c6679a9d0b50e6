"""End-to-end tokens/s: `specsplit up` (three processes) with speculation vs the same services with
speculation off (target only), vs HF transformers `generate` (plain, prompt lookup, assisted), one
run.

Each prompt of the bundled set is generated alone (one stream at a time, greedy), as a chat user
would. Runs are interleaved prompt by prompt, in an order that rotates from prompt to prompt, so a
shared machine's drift in speed hits every row alike; the services sit idle while HF generates
(in this process). --passes repeats the whole sweep; the table counts each row's streams whose
tokens in a later pass were not their first pass's (at batch > 1 a stream's bf16 numerics depend
on the batch it was prefilled in, and random weights' logits tie near often: on an H200 one
stream did in pass 2).

--batch B (one table each, default 1): the prompts in groups of B (cycled to fill the last), a
group's prompts as B streams at once through the services, and as one left-padded batch through
HF `generate` (plain and with the static cache + compile; HF's prompt lookup and assisted
generation take one sequence at a time, so they run at batch 1 only); tokens/s over the
groups' wall time. A padded batch's greedy tokens may part from the unpadded ones at near-ties.
--ignore-eos: every stream, specsplit's and HF's, runs to --max-new-tokens past EOS, so a
batch's streams are all as long (no tail where the last few run alone) and both sides time the
same tokens; labelled in each table's header.

    PYTHONPATH=. python bench/e2e.py --max-new-tokens 64 [--model PATH] [--device cuda:1]
        [--drafter-device cuda:0] [--batch 1 8 32] [--ignore-eos]
        [--drafter KIND] [--spec 5 5x2x8 ...] [--assistant-layers 8] [--passes 2]

After the table: the split's cost per round on the gateway's critical path (its histograms
specsplit_round_outside_verify_seconds and specsplit_rpc_overhead_seconds, read around each run),
p50 and p99 as bucket upper bounds.

--spec takes draft shapes STEPS[xTOPK[xNODES]] sent per request (default: the gateway's default
shape); each is one row. HF assisted generation uses a copy of the target cut to its first
--assistant-layers layers as `assistant_model` (there is no smaller SmolLM2 to use).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, CompileConfig, StaticCache

from bench.acceptance import PROMPT_SETS, bundled_prompts
from gateway.adaptive import format_ladder, parse_ladder
from specsplit import convert
from specsplit.metrics import GATE_ROUND_KINDS
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import from_pretrained_args, load_tokenizer
from specsplit.prompt import apply_chat_template
from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def wait_gateway(address: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"specsplit up exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError("gateway not serving")


def wait_for_drafter(
    stub: gateway_pb2_grpc.GatewayStub, prompt: list[int], timeout: float = 300.0
) -> None:
    """Short streams of `prompt` until the drafter has answered a Draft: the gateway serves
    once the verifier does and decodes without drafts until the drafter is ready, so a run
    timed before that measures target-only rounds (a drafter's warm-up can outlast the
    verifier's: two serial runs of bench/overlap.py sent no Draft, thirty-ninth session)."""
    deadline = time.monotonic() + timeout
    while scrape_totals()[("drafter", "specsplit_draft_seconds_count")] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the drafter answered no Draft")
        request = gateway_pb2.GenerateRequest(  # its own spec: drafts whatever the default
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            max_new_tokens=8,
            spec=common_pb2.SpecParams(num_steps=3, topk=1, num_draft_tokens=3),
        )
        for _ in stub.Generate(request):
            pass
        time.sleep(0.5)


# a group of prompts at once -> per prompt (tokens, rounds, accepted tokens)
Runner = Callable[[list[list[int]]], list[tuple[list[int], int, int]]]
METRICS_PORT = 50170  # the gateway's /metrics; the drafter's and the verifier's on the next two
# a round's parts: label -> (process, histogram, its labels)
ROUND_PARTS = {
    "round (gateway)": ("gateway", "specsplit_round_seconds", ()),
    "verify engine": ("verifier", "specsplit_verify_seconds", ()),
    "draft engine": ("drafter", "specsplit_draft_seconds", ()),
    "round outside verify engine": ("gateway", "specsplit_round_outside_verify_seconds", ()),
    "verify RPC less engine": (
        "gateway",
        "specsplit_rpc_overhead_seconds",
        (("service", "verifier"),),
    ),
    "  of it on the verifier": ("verifier", "specsplit_service_overhead_seconds", ()),
    "draft RPC less engine": (
        "gateway",
        "specsplit_rpc_overhead_seconds",
        (("service", "drafter"),),
    ),
    "  of it on the drafter": ("drafter", "specsplit_service_overhead_seconds", ()),
}
METRICS_OFFSETS = {"gateway": 0, "drafter": 1, "verifier": 2}  # as `up` assigns them
# (process, name, labels, le) -> count
Buckets = Counter[tuple[str, str, tuple[tuple[str, str], ...], float]]


def _samples() -> Iterator[tuple[str, Any]]:
    """(process, sample) of every metric sample the three processes export now."""
    for process, offset in METRICS_OFFSETS.items():
        url = f"http://127.0.0.1:{METRICS_PORT + offset}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                yield process, sample


def scrape_overlap_modes() -> dict[int, str]:
    """The gateway's overlap gate's choice per batch bucket (`specsplit_overlap_mode`)."""
    return {
        int(sample.labels["batch_bucket"]): sample.labels["mode"]
        for process, sample in _samples()
        if process == "gateway" and sample.name == "specsplit_overlap_mode" and sample.value == 1
    }


def scrape_buckets() -> Buckets:
    """The three processes' histogram buckets (cumulative counts) by (process, name, labels,
    upper bound)."""
    buckets: Buckets = Counter()
    for process, sample in _samples():
        if sample.name.endswith("_bucket"):
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            name = sample.name.removesuffix("_bucket")
            buckets[(process, name, labels, float(sample.labels["le"]))] = int(sample.value)
    return buckets


Totals = Counter[tuple[str, str]]


def scrape_totals() -> Totals:
    """The three processes' histogram sums and counts, unlabelled ones only, by (process,
    "<name>_sum" / "<name>_count"): exact means over an interval (two scrapes' difference);
    draft-ahead's rounds, decode steps and hinted rounds run ahead by outcome, (process,
    "specsplit_draft_ahead_total:<outcome>" / "specsplit_decode_ahead_total:<outcome>" /
    "specsplit_round_ahead_total:<outcome>"), the verifier's rounds with none run ahead by
    reason, its decode steps run ahead and dropped by reason and the gateway's hints by outcome
    ("specsplit_round_not_ahead_total:<reason>", "specsplit_decode_ahead_dropped_total:<reason>",
    "specsplit_hints_total:<outcome>"), the verifier's host work between rounds by phase
    ("specsplit_verifier_gap_seconds_sum:<phase>" / "..._count:<phase>"), the gateway's rounds by
    kind ("specsplit_rounds_total:<kind>"), the verifier's and the drafter's forwards by path
    and their eager ones by why ("specsplit_verifier_forwards_total:<path>",
    "specsplit_verifier_eager_forwards_total:<why>", the same for "drafter"); and
    the gateway's RPC overhead by service, (process, "specsplit_rpc_overhead_seconds_sum:<service>"
    / "..._count:<service>"), its RPCs' stages on the round lane, (process,
    "specsplit_rpc_stage_seconds_sum:<service>:<stage>" / "..._count:..."), and each process's
    garbage collections by generation, (process, "specsplit_gc_pause_seconds_sum:<generation>"
    / "..._count:<generation>")."""
    totals: Totals = Counter()
    for process, sample in _samples():
        if sample.name.endswith(("_sum", "_count")) and not sample.labels:
            totals[(process, sample.name)] = float(sample.value)
        elif sample.name in (
            "specsplit_draft_ahead_total",
            "specsplit_decode_ahead_total",
            "specsplit_round_ahead_total",
        ):
            key = f"{sample.name}:{sample.labels['outcome']}"
            totals[(process, key)] = float(sample.value)
        elif (labels := _LABELLED.get(_histogram_of(sample.name))) is not None:
            key = ":".join([sample.name, *(sample.labels[label] for label in labels)])
            totals[(process, key)] = float(sample.value)
    return totals


def _histogram_of(sample_name: str) -> str:
    """The histogram a "<name>_sum" / "<name>_count" sample belongs to (else the name itself)."""
    return sample_name.removesuffix("_sum").removesuffix("_count")


# labelled histograms whose sums and counts scrape_totals keeps, keyed by their labels in order
_LABELLED = {
    "specsplit_rpc_overhead_seconds": ("service",),
    "specsplit_rpc_stage_seconds": ("service", "stage"),
    "specsplit_gc_pause_seconds": ("generation",),
    "specsplit_round_not_ahead_total": ("reason",),
    "specsplit_decode_ahead_dropped_total": ("reason",),
    "specsplit_hints_total": ("outcome",),
    "specsplit_verifier_gap_seconds": ("phase",),
    "specsplit_rounds_total": ("kind",),
    "specsplit_verifier_forwards_total": ("path",),
    "specsplit_verifier_eager_forwards_total": ("why",),
    "specsplit_drafter_forwards_total": ("path",),
    "specsplit_drafter_eager_forwards_total": ("why",),
}


def cumulative_counts(
    buckets: Buckets, key: tuple[str, str, tuple[tuple[str, str], ...]]
) -> list[tuple[float, int]]:
    """(upper bound in seconds, cumulative count) of the histogram `key`'s buckets, in order."""
    return sorted((le, n) for (*k, le), n in buckets.items() if tuple(k) == key)


def quantile(
    buckets: Buckets, key: tuple[str, str, tuple[tuple[str, str], ...]], q: float
) -> float:
    """Upper bound (seconds) of the bucket holding the q-quantile of the histogram `key`
    (process, name, labels); nan without samples."""
    cumulative = cumulative_counts(buckets, key)
    total = cumulative[-1][1] if cumulative else 0
    return (
        next((le for le, n in cumulative if n >= q * total), float("nan"))
        if total
        else float("nan")
    )


@dataclass
class Row:
    seconds: float = 0.0
    rounds: int = 0
    num_accepted_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # each stream's, of the first pass
    num_changed: int = 0  # streams' runs in a later pass whose tokens were not the first's
    num_timed_tokens: int = 0  # every pass's tokens (a changed stream may differ in length)
    buckets: Buckets = field(default_factory=Counter)  # the services', during this row's runs
    totals: Totals = field(default_factory=Counter)  # their histogram sums and counts, the same


@contextlib.contextmanager
def services(
    args: argparse.Namespace, extra: tuple[str, ...] = ()
) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """`specsplit up` on local ports (`extra`: more of its flags); the gateway's stub once it
    serves."""
    port = 50151
    cmd = [sys.executable, "-m", "specsplit.cli", "up", "--gateway-port", str(port),
           "--drafter-port", "50161", "--verifier-port", "50162",
           "--device", args.device, "--verifier-wait", "30",
           "--metrics-listen", f"127.0.0.1:{METRICS_PORT}",
           # requests naming their spec are never gated; those that do not are, when on
           "--speculation-gate", getattr(args, "speculation_gate", "off")]  # fmt: skip
    if args.drafter_device:
        cmd += ["--drafter-device", args.drafter_device]
    if getattr(args, "dtype", None):
        cmd += ["--dtype", args.dtype]
    cmd += extra
    if args.model:
        cmd += ["--model", args.model]
    if args.drafter:
        cmd += ["--drafter", args.drafter] + (
            ["--draft-model", args.draft_model] * bool(args.draft_model)
        )
    log_path = getattr(args, "services_log", None)  # the services' output, appended, or none
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log_path else log)
    try:
        address = f"127.0.0.1:{port}"
        wait_gateway(address, proc, 900)
        yield gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        if not isinstance(log, int):
            log.close()


def service_runners(
    stub: gateway_pb2_grpc.GatewayStub, args: argparse.Namespace
) -> dict[str, Runner]:
    specs: dict[str, common_pb2.SpecParams | None] = {}
    for shape in parse_ladder(",".join(args.spec)) if args.spec else []:
        specs[f"specsplit {format_ladder([shape])}"] = convert.spec_to_proto(shape)
    # the gateway's default spec (not named by the request): the speculation gate's, when on
    gate = " (speculation gate)" if args.speculation_gate == "on" else ""
    specs[f"specsplit default shape{gate}"] = None
    specs["specsplit target only"] = common_pb2.SpecParams(num_steps=0, topk=1)

    def runner(spec: common_pb2.SpecParams | None) -> Runner:
        def one(prompt: list[int]) -> tuple[list[int], int, int]:
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=prompt),
                max_new_tokens=args.max_new_tokens,
                spec=spec,
                ignore_eos=args.ignore_eos,
            )
            responses = list(stub.Generate(request))
            stats = responses[-1].spec_stats
            tokens = [t for r in responses for t in r.token_ids]
            return tokens, stats.rounds, stats.num_accepted_drafts + stats.rounds

        def run(prompts: list[list[int]]) -> list[tuple[list[int], int, int]]:
            if len(prompts) == 1:
                return [one(prompts[0])]
            with ThreadPoolExecutor(len(prompts)) as pool:  # B streams at once
                return list(pool.map(one, prompts))

        return run

    return {name: runner(spec) for name, spec in specs.items()}


def hf_model(args: argparse.Namespace, path: str) -> Any:
    """The target as an HF model on --device (bf16 on a GPU, float32 on the CPU)."""
    name, kwargs = from_pretrained_args(path)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs).to(args.device)


def hf_runners(
    args: argparse.Namespace, model: Any, max_len: int, batch: int = 1
) -> dict[str, Runner]:
    """HF `generate` variants on the same weights for groups of `batch` prompts (prompt lookup
    and assisted generation at batch 1 only: HF takes one sequence there); max_len: the longest
    prompt + new tokens."""
    variants: dict[str, dict[str, object]] = {"HF generate": {}}
    if batch == 1:
        variants["HF generate prompt_lookup 3"] = {"prompt_lookup_num_tokens": 3}
    # transformers compiles the decode step of a static cache (on the CPU too when its compile
    # config says so: by default only on accelerators); one cache of one length for every
    # group (reset per call), so the step compiles once, not once per prompt length (the CPU's
    # first call takes ~20 s: the warm-up group)
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    variants["HF generate static cache + compile"] = {
        "past_key_values": cache,
        "compile_config": compile_config,
    }
    if args.assistant_layers and batch == 1:
        assistant = copy.deepcopy(model)
        assistant.model.layers = assistant.model.layers[: args.assistant_layers]
        assistant.config.num_hidden_layers = args.assistant_layers
        variants[f"HF assisted (first {args.assistant_layers} layers)"] = {
            "assistant_model": assistant
        }
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else min(eos_ids, default=0)
    if args.ignore_eos:  # no stop on EOS: every row runs to max_new_tokens, as specsplit's streams
        variants = {label: {**extra, "eos_token_id": None} for label, extra in variants.items()}

    def runner(extra: dict[str, object]) -> Runner:
        def run(prompts: list[list[int]]) -> list[tuple[list[int], int, int]]:
            cache = extra.get("past_key_values")
            if isinstance(cache, StaticCache):
                cache.reset()
            ids, mask = left_padded(prompts, pad)
            out = model.generate(
                ids.to(args.device),
                attention_mask=mask.to(args.device),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                **extra,
            )
            rows = out[:, ids.shape[1] :].tolist()
            return [(row if args.ignore_eos else through_eos(row, eos_ids), 0, 0) for row in rows]

        return run

    return {label: runner(extra) for label, extra in variants.items()}


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, longest] input ids padded on the left with `pad`, and their attention mask."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.tensor(prompt)
        mask[b, width - len(prompt) :] = 1
    return ids, mask


def through_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """`tokens` up to and with the first end-of-sequence token (a batch's row runs on with
    padding after it)."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in eos_ids), len(tokens))
    return tokens[:end]


def prompt_groups(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts in groups of `batch`, in order, cycled to fill the last group (the whole
    set at least once)."""
    num_groups = -(-len(prompts) // batch)
    return [
        [prompts[(g * batch + j) % len(prompts)] for j in range(batch)] for g in range(num_groups)
    ]


def measure(
    runners: dict[str, Runner], groups: list[list[list[int]]], passes: int
) -> dict[str, Row]:
    """Every runner on every group of prompts (`prompt_groups`; one prompt a group at batch 1),
    interleaved: group i runs the runners in an order rotated by i (and by the pass). One
    warm-up group each first. The gateway's histograms are read around each specsplit run
    (outside its timing) and kept per row."""
    names = list(runners)
    for name in names:
        runners[name](groups[0])
    rows = {name: Row() for name in names}
    for sweep in range(passes):
        for i, group in enumerate(groups):
            shift = (i + sweep) % len(names)
            for name in names[shift:] + names[:shift]:
                probe = name.startswith("specsplit")
                before = scrape_buckets() if probe else Counter()
                before_totals = scrape_totals() if probe else Counter()
                start = time.perf_counter()
                results = runners[name](group)
                row = rows[name]
                row.seconds += time.perf_counter() - start
                if probe:
                    row.buckets.update(scrape_buckets())
                    row.buckets.subtract(before)
                    row.totals.update(scrape_totals())
                    row.totals.subtract(before_totals)
                for j, (tokens, rounds, accepted) in enumerate(results):
                    row.num_timed_tokens += len(tokens)
                    row.rounds += rounds
                    row.num_accepted_tokens += accepted
                    k = i * len(group) + j
                    if sweep == 0:
                        row.outputs.append(tokens)
                    elif tokens != row.outputs[k]:
                        row.num_changed += 1  # reported: random bf16 weights tie near often
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="verifier's (and HF's) device")
    parser.add_argument("--drafter-device", default=None, help="default: --device")
    parser.add_argument("--no-hf", action="store_true", help="no HF rows (specsplit's only)")
    parser.add_argument("--services-log", default=None, help="append the services' output here")
    parser.add_argument("--dtype", default=None, help="specsplit up --dtype (default: its own)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument(
        "--prompts",
        choices=PROMPT_SETS,
        default="chat",
        help="bundled prompt set: chat questions, or grounded edits of given text (prompt lookup's"
        " case); named in each table's header",
    )
    parser.add_argument("--drafter", default=None, help="specsplit up --drafter (default: its own)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--spec", nargs="*", default=None, help="draft shapes, one row each")
    parser.add_argument(
        "--speculation-gate",
        choices=("on", "off"),
        default="off",
        help="the gateway's --speculation-gate: the default-shape row is gated when on",
    )
    parser.add_argument("--assistant-layers", type=int, default=8, help="0 = no assisted row")
    parser.add_argument("--passes", type=int, default=1, help="sweeps over the prompts")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[1], help="streams at once, a table each"
    )
    parser.add_argument(
        "--round-lane", choices=("on", "off"), default="on", help="`up --round-lane`"
    )
    parser.add_argument(
        "--decode-ahead",
        choices=("auto", "on", "off"),
        default="auto",
        help="`up --decode-ahead` (the verifier runs decode steps ahead)",
    )
    parser.add_argument(
        "--decode-steps",
        default=None,
        help="`up --decode-steps` (tokens a plain round decodes; default: its own)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every stream, specsplit's and HF's, runs to --max-new-tokens past EOS (the same"
        " tokens each, no tail of a batch's streams ending early: throughput at a fixed length,"
        " as vLLM's benchmarks' ignore_eos); labelled in each table's header",
    )
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="one more `up` argument, repeatable (e.g. --up-arg=--decode-ahead-max-batch=64);"
        " named in each table's header",
    )
    args = parser.parse_args()
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [apply_chat_template(tokenizer, m) for m in bundled_prompts(args.prompts)][
        : args.num_prompts
    ]

    flags: tuple[str, ...] = ("--round-lane", args.round_lane, "--decode-ahead", args.decode_ahead)
    if args.decode_steps is not None:
        flags += ("--decode-steps", args.decode_steps)
    flags += tuple(args.up_arg)
    with services(args, flags) as stub:
        wait_for_drafter(stub, prompts[0])
        model = None if args.no_hf else hf_model(args, path)
        max_len = max(map(len, prompts)) + args.max_new_tokens
        for batch in args.batch:
            runners = service_runners(stub, args)
            if model is not None:
                runners.update(hf_runners(args, model, max_len, batch))
            rows = measure(runners, prompt_groups(prompts, batch), args.passes)
            report(args, path, len(prompts), batch, rows)


def report(
    args: argparse.Namespace, path: str, num_prompts: int, batch: int, rows: dict[str, Row]
) -> None:
    """One batch size's table: tokens/s and accepted tokens a round against target-only, HF
    generate and HF's best row, then a round's parts and the split's cost on the services."""
    reference = rows["specsplit target only"].outputs
    tps = {name: row.num_timed_tokens / row.seconds for name, row in rows.items()}
    base = {"target only": tps["specsplit target only"], "HF": tps.get("HF generate", math.nan)}
    best_hf = max((v for k, v in tps.items() if k.startswith("HF")), default=math.nan)
    streams = "one at a time" if batch == 1 else f"{batch} streams at once (HF: one batch)"
    print(
        f"\n== batch {batch}: model {path}; {num_prompts} {args.prompts} prompts {streams}, "
        f"greedy, max_new_tokens {args.max_new_tokens}, device {args.device}, "
        f"{os.cpu_count()} CPUs, {args.passes} pass(es), runs interleaved, round lane "
        f"{args.round_lane}, decode ahead {args.decode_ahead}, decode steps "
        f"{args.decode_steps or 'default'}"
        + (", IGNORE EOS (every stream runs to max_new_tokens)" if args.ignore_eos else "")
        + (f", up {' '.join(args.up_arg)}" if args.up_arg else "")
    )
    print(
        f"{'run':<36}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'acc/round':>10}"
        f"{'vs target-only':>16}{'vs HF':>8}{'vs HF best':>12}  same tokens as target-only"
    )
    for name, row in rows.items():
        acc = row.num_accepted_tokens / row.rounds if row.rounds else float("nan")
        same = sum(o == r for o, r in zip(row.outputs, reference, strict=True))
        print(
            f"{name:<36}{row.num_timed_tokens:>8}{row.seconds:>9.2f}{tps[name]:>10.1f}{acc:>10.2f}"
            f"{tps[name] / base['target only']:>15.2f}x{tps[name] / base['HF']:>7.2f}x"
            f"{tps[name] / best_hf:>11.2f}x  {same}/{len(row.outputs)}"
        )
    if args.passes > 1:  # a stream's tokens can change with the batch it prefilled in (bf16)
        changed = ", ".join(f"{name} {row.num_changed}" for name, row in rows.items())
        print(f"streams' later passes whose tokens differ from their first pass's: {changed}")
    print("a round's parts and the split's cost, ms: exact means (unlabelled histograms' sums")
    print("over counts), p50 and p99 as histogram bucket upper bounds")
    print(f"{'run':<30}{'cost':<32}{'mean':>8}{'p50':>8}{'p99':>8}")
    for name, row in rows.items():
        if not name.startswith("specsplit"):
            continue
        for label, key in ROUND_PARTS.items():
            p50, p99 = (1e3 * quantile(row.buckets, key, q) for q in (0.5, 0.99))
            process, metric, labels = key
            calls = row.totals[(process, metric + "_count")]
            mean = math.nan  # scrape_totals keeps unlabelled histograms only
            if calls and not labels:
                mean = 1e3 * row.totals[(process, metric + "_sum")] / calls
            print(f"{name:<30}{label:<32}{mean:>8.2f}{p50:>8.2f}{p99:>8.2f}")
    if args.speculation_gate == "on":
        print_gated_rounds(rows)


def print_gated_rounds(rows: dict[str, Row]) -> None:
    """With the speculation gate on: each specsplit row's rounds by the gate's kind (count x
    mean ms, from the gateway's gate histograms): what its probes of speculation cost there
    (the resume rounds re-verify every token since the last features)."""
    print("the speculation gate's rounds by kind, count x mean ms")
    print(f"{'run':<44}" + "".join(f"{kind:>20}" for kind in GATE_ROUND_KINDS))
    for name, row in rows.items():
        if name.startswith("specsplit"):
            print(f"{name:<44}" + "".join(f"{c:>20}" for c in gated_round_cells(row.totals)))


def gated_round_cells(totals: Totals) -> list[str]:
    """The speculation gate's rounds by kind (GATE_ROUND_KINDS), each "count x mean ms" ("-":
    none), from the gateway's gate histograms in `totals` (scrape_totals)."""
    cells = []
    for kind in GATE_ROUND_KINDS:
        name = f"specsplit_gate_{kind}_round_seconds"
        calls = totals[("gateway", f"{name}_count")]
        mean = f"{1e3 * totals[('gateway', f'{name}_sum')] / calls:.2f}" if calls else "-"
        cells.append(f"{calls:.0f} x {mean}")
    return cells


if __name__ == "__main__":
    main()
