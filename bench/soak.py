"""Load and soak: many concurrent streams through the gateway, some cancelled at random, some
bad requests, and the drafter killed (SIGKILL) once half of the streams are under way. After
them: no KV page used in either service, every completed greedy stream equal to its reference
(the target alone: spec off), the services still serving.

    PYTHONPATH=. python bench/soak.py --streams 64 [--model PATH] [--max-new-tokens 32]
        [--seed 0] [--device cpu] [--mix]

--mix: the prompts take the request options a server's clients mix (`FLAVOURS`, one a prompt
in turn): logit rules (presence / frequency, repetition, a bias, min_tokens with a stop
string), guides (a regex, any JSON object) and seeded sampling; each greedy one is compared
with the target alone under the same options, a sampled one only has to end well.

Runs `specsplit up` (the embedded default unless --model), its gateway on a free loopback port
(the drafter and verifier on `up`'s Unix sockets, found in its log); `up` restarts
the killed drafter. Prints the figures and exits 1 when a check failed. The CI form
(tests/integration/test_soak.py) runs the same `soak` against the gateway's servicer over the
in-process engines, with the drafter's death simulated.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc

from specsplit.up import logged_addresses
from specsplit.v1 import (
    common_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2_grpc,
)

Kind = Literal["complete", "cancel", "bad"]
Flavour = Callable[[gateway_pb2.GenerateRequest], None]
TARGET_ONLY = common_pb2.SpecParams(num_steps=0, topk=1, num_draft_tokens=0)
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Count from one to ten.",
    "Why is the sky blue? Answer briefly.",
    "List four fruits.",
    "What is two plus two?",
    "Describe a cat in one sentence.",
    "What is the opposite of cold?",
    "Say hello in Spanish.",
    "Name a planet in the solar system.",
    "What colour is grass?",
    "Recommend a book for children.",
]


def _options(**fields: object) -> Flavour:
    def apply(request: gateway_pb2.GenerateRequest) -> None:
        for name, value in fields.items():
            if isinstance(value, dict):
                getattr(request, name).update(value)
            elif isinstance(value, list):
                getattr(request, name).extend(value)
            elif isinstance(value, common_pb2.SamplingParams | gateway_pb2.Guide):
                getattr(request, name).CopyFrom(value)
            else:
                setattr(request, name, value)

    return apply


# the request options `--mix` gives the prompts in turn, by name; "plain" first (the check
# that the services still serve sends prompt 0). Token ids in the bias are below 500: in every
# vocabulary here (the tests' tiny models' 512 too)
FLAVOURS: dict[str, Flavour] = {
    "plain": _options(),
    "penalties": _options(presence_penalty=0.5, frequency_penalty=0.5),
    "repetition": _options(repetition_penalty=1.3),
    "bias": _options(logit_bias={13: 4.0, 17: -100.0, 29: 2.5}),
    "min_tokens, stop": _options(min_tokens=6, stop=["."]),
    "regex": _options(guide=gateway_pb2.Guide(regex=r"[A-Za-z ,]{1,24}\.")),
    "json": _options(guide=gateway_pb2.Guide(json_object=True)),
    "sampled": _options(sampling=common_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=7)),
}
UNCHECKED = {"sampled"}  # not compared with the target alone: only the same distribution


def flavoured(
    prompts: list[gateway_pb2.GenerateRequest],
) -> tuple[list[gateway_pb2.GenerateRequest], list[str]]:
    """The prompts with `FLAVOURS` applied in turn (prompt i the i-th modulo their number), and
    each one's flavour."""
    names = list(FLAVOURS)
    out, labels = [], []
    for i, prompt in enumerate(prompts):
        request = gateway_pb2.GenerateRequest()
        request.CopyFrom(prompt)
        name = names[i % len(names)]
        FLAVOURS[name](request)
        out.append(request)
        labels.append(name)
    return out, labels


def _bad_requests(prompt: gateway_pb2.GenerateRequest) -> dict[str, gateway_pb2.GenerateRequest]:
    """Requests the gateway must refuse with INVALID_ARGUMENT, by what is wrong with them."""

    def variant(**fields: object) -> gateway_pb2.GenerateRequest:
        request = gateway_pb2.GenerateRequest()
        request.CopyFrom(prompt)
        for name, value in fields.items():
            if isinstance(value, common_pb2.SamplingParams | common_pb2.SpecParams):
                getattr(request, name).CopyFrom(value)
            else:
                setattr(request, name, value)
        return request

    return {
        "empty prompt": gateway_pb2.GenerateRequest(max_new_tokens=4),
        "max_new_tokens 0": variant(max_new_tokens=0),
        "over the context": variant(max_new_tokens=10**6),
        "token outside the vocabulary": gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[2**30]), max_new_tokens=4
        ),
        "negative temperature": variant(sampling=common_pb2.SamplingParams(temperature=-1.0)),
        "inconsistent spec": variant(
            spec=common_pb2.SpecParams(num_steps=2, topk=1, num_draft_tokens=5)
        ),
    }


@dataclass(frozen=True)
class StreamPlan:
    """What one client does: its prompt, when it starts, and how it ends."""

    kind: Kind
    prompt: int  # index into the prompts
    start_s: float  # after the soak starts
    cancel_after: int = 0  # "cancel": tokens received before cancelling
    bad: str = ""  # "bad": which bad request (_bad_requests)


def make_plan(
    num_streams: int,
    num_prompts: int,
    max_new_tokens: int,
    seed: int = 0,
    cancel_fraction: float = 0.25,
    bad_fraction: float = 0.125,
    spread_s: float = 1.0,
) -> list[StreamPlan]:
    """A seeded plan: `cancel_fraction` of the streams cancelled after a random number of
    tokens, `bad_fraction` bad requests, the rest run to the end; starts spread over
    `spread_s`."""
    rng = random.Random(seed)
    bad_names = list(_bad_requests(gateway_pb2.GenerateRequest()))
    plan = []
    for _ in range(num_streams):
        roll, start = rng.random(), rng.uniform(0.0, spread_s)
        prompt = rng.randrange(num_prompts)
        if roll < bad_fraction:
            plan.append(StreamPlan("bad", prompt, start, bad=rng.choice(bad_names)))
        elif roll < bad_fraction + cancel_fraction:
            cancel_after = rng.randint(1, max(max_new_tokens // 2, 1))
            plan.append(StreamPlan("cancel", prompt, start, cancel_after=cancel_after))
        else:
            plan.append(StreamPlan("complete", prompt, start))
    return plan


@dataclass
class SoakReport:
    streams: int
    completed: int = 0
    mismatched: list[int] = field(default_factory=list)  # plan indices
    cancelled: int = 0
    ended_before_cancel: int = 0  # "cancel" streams that finished first
    refused: Counter[str] = field(default_factory=Counter)  # bad requests' status codes
    errors: Counter[str] = field(default_factory=Counter)  # codes of streams that should finish
    tokens: int = 0  # streamed, all streams
    drafter_killed_after_s: float | None = None
    pages_after: dict[str, int] = field(default_factory=dict)
    still_serving: bool = False
    wall_s: float = 0.0
    by_flavour: Counter[str] = field(default_factory=Counter)  # completed streams (--mix)

    def failures(self) -> list[str]:
        """What broke the soak's promises (empty: all held)."""
        problems = []
        if self.mismatched:
            problems.append(f"{len(self.mismatched)} completed streams differ from the reference")
        if self.errors:
            problems.append(f"streams failed: {dict(self.errors)}")
        if set(self.refused) - {"INVALID_ARGUMENT"}:
            problems.append(f"bad requests answered {dict(self.refused)}")
        if any(self.pages_after.values()):
            problems.append(f"KV pages still used: {self.pages_after}")
        if not self.still_serving:
            problems.append("not serving afterwards")
        return problems

    def table(self) -> str:
        killed = self.drafter_killed_after_s
        unchecked = sum(self.by_flavour[name] for name in UNCHECKED)
        rows = [
            ("streams", str(self.streams)),
            (
                "completed (equal to reference)",
                f"{self.completed - len(self.mismatched) - unchecked}",
            ),
            ("completed, not compared", f"{unchecked} ({', '.join(sorted(UNCHECKED))})"),
            ("completed, differing", str(len(self.mismatched))),
            ("completed, by flavour", _codes(self.by_flavour)),
            ("cancelled mid-stream", str(self.cancelled)),
            ("cancel planned, finished first", str(self.ended_before_cancel)),
            ("bad requests, by status", _codes(self.refused)),
            ("other errors, by status", _codes(self.errors)),
            ("tokens streamed", str(self.tokens)),
            ("drafter killed after", "no" if killed is None else f"{killed:.1f} s"),
            ("KV pages used after", _codes(Counter(self.pages_after))),
            ("still serving", "yes" if self.still_serving else "NO"),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _codes(counts: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _ids(responses: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def references(
    stub: gateway_pb2_grpc.GatewayStub, prompts: list[gateway_pb2.GenerateRequest]
) -> list[list[int]]:
    """Each prompt's greedy output from the target alone (spec off), all at once."""

    async def one(prompt: gateway_pb2.GenerateRequest) -> list[int]:
        request = gateway_pb2.GenerateRequest()
        request.CopyFrom(prompt)
        request.spec.CopyFrom(TARGET_ONLY)
        return _ids([r async for r in stub.Generate(request, timeout=600)])

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def soak(
    stub: gateway_pb2_grpc.GatewayStub,
    prompts: list[gateway_pb2.GenerateRequest],
    expected: list[list[int]],
    plan: list[StreamPlan],
    *,
    kill_drafter: Callable[[], Awaitable[None]] | None,
    pages_used: Callable[[], Awaitable[dict[str, int]]],
    timeout_s: float = 600.0,
    settle_s: float = 20.0,
    flavours: list[str] | None = None,
) -> SoakReport:
    """Run `plan` against the gateway; `kill_drafter` once half of the streams that are to
    produce tokens have their first one; then wait up to `settle_s` for both services' KV pages
    to be free and check the gateway still serves. `flavours`: each prompt's (`flavoured`);
    those in UNCHECKED are not compared with `expected`."""
    report = SoakReport(streams=len(plan))
    num_streaming = sum(p.kind != "bad" for p in plan)
    started = asyncio.Event()  # half of them have their first token
    num_started = 0
    begin = time.monotonic()

    async def run(index: int, p: StreamPlan) -> None:
        nonlocal num_started
        await asyncio.sleep(p.start_s)
        request = prompts[p.prompt]
        if p.kind == "bad":
            request = _bad_requests(prompts[p.prompt])[p.bad]
        call = stub.Generate(request, timeout=timeout_s)
        received: list[int] = []
        try:
            async for response in call:
                if not received and response.token_ids:
                    num_started += 1
                    if num_started * 2 >= num_streaming:
                        started.set()
                received += response.token_ids
                if p.kind == "cancel" and len(received) >= p.cancel_after:
                    call.cancel()
                    report.cancelled += 1
                    break
            else:
                if p.kind == "bad":
                    report.refused["OK"] += 1
                elif p.kind == "cancel":
                    report.ended_before_cancel += 1
                if p.kind != "bad":
                    report.completed += 1
                    flavour = "plain" if flavours is None else flavours[p.prompt]
                    report.by_flavour[flavour] += 1
                    if flavour not in UNCHECKED and received != expected[p.prompt]:
                        report.mismatched.append(index)
        except grpc.aio.AioRpcError as err:
            (report.refused if p.kind == "bad" else report.errors)[err.code().name] += 1
        report.tokens += len(received)

    async def killer() -> None:
        if kill_drafter is None:
            return
        await started.wait()
        report.drafter_killed_after_s = time.monotonic() - begin
        await kill_drafter()

    kill = asyncio.create_task(killer())
    await asyncio.gather(*(run(i, p) for i, p in enumerate(plan)))
    if not kill.done():  # too few streams got going to reach half
        kill.cancel()
    report.wall_s = time.monotonic() - begin
    deadline = time.monotonic() + settle_s
    report.pages_after = await pages_used()
    while any(report.pages_after.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        report.pages_after = await pages_used()
    check = [r async for r in stub.Generate(prompts[0], timeout=timeout_s)]
    report.still_serving = _ids(check) == expected[0]
    return report


# -- the full form: `specsplit up` ------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class UpProcess:
    """`specsplit up`, its gateway on a free loopback port; its log in a file (the children's pids
    and the drafter's and verifier's sockets in it)."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.ports = {"gateway": _free_port()}  # the drafter and verifier: Unix sockets
        argv = [sys.executable, "-m", "specsplit.cli", "up", "--device", args.device]
        argv += ["--metrics-listen", "none", "--http-listen", "none"]
        argv += [f"--{name}-port={port}" for name, port in self.ports.items()]
        argv += ["--model", args.model] if args.model else []
        self.log_path = log_dir / "up.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log)

    def address(self, name: str) -> str:
        """The gateway's port; the drafter's and verifier's Unix socket, from `up`'s log."""
        if name in self.ports:
            return f"127.0.0.1:{self.ports[name]}"
        return logged_addresses(self.log_path.read_text(errors="replace"))[name]

    def pid(self, name: str) -> int:
        log = self.log_path.read_text(errors="replace")
        return int(re.findall(rf"started {name} \(pid (\d+)\)", log)[-1])

    async def wait_serving(self, timeout: float) -> None:
        from gateway.grpc_clients import wait_ready

        for name in ("gateway", "verifier", "drafter"):  # the gateway's: `up` logged the rest
            if not await wait_ready(self.address(name), timeout):
                raise TimeoutError(f"{name} not SERVING after {timeout} s; see {self.log_path}")

    async def kill_drafter(self) -> None:
        os.kill(self.pid("drafter"), signal.SIGKILL)

    async def pages_used(self) -> dict[str, int]:
        used = {}
        for name, stub in (
            ("drafter", drafter_pb2_grpc.DrafterStub),
            ("verifier", verifier_pb2_grpc.VerifierStub),
        ):
            async with grpc.aio.insecure_channel(self.address(name)) as channel:
                try:
                    reply = await stub(channel).Release(common_pb2.ReleaseRequest(), timeout=5)
                    used[name] = reply.num_pages_used
                except grpc.aio.AioRpcError as err:  # e.g. the drafter still loading
                    used[name] = -1 if err.code() != grpc.StatusCode.UNAVAILABLE else -2
        return used

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def chat_prompts(max_new_tokens: int) -> list[gateway_pb2.GenerateRequest]:
    prompts = []
    for text in CHAT_PROMPTS:
        request = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
        request.chat.messages.add(role="user", content=text)
        prompts.append(request)
    return prompts


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        up = UpProcess(args, Path(tmp))
        try:
            await up.wait_serving(900)
            async with grpc.aio.insecure_channel(up.address("gateway")) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                prompts, flavours = chat_prompts(args.max_new_tokens), None
                if args.mix:
                    prompts, flavours = flavoured(prompts)
                expected = await references(stub, prompts)
                plan = make_plan(args.streams, len(prompts), args.max_new_tokens, args.seed)
                report = await soak(
                    stub,
                    prompts,
                    expected,
                    plan,
                    kill_drafter=None if args.no_kill else up.kill_drafter,
                    pages_used=up.pages_used,
                    settle_s=args.settle,
                    flavours=flavours,
                )
        finally:
            code = up.stop()
        log = up.log_path.read_text(errors="replace")
    restarts = log.count("drafter exited with -9: restarting it")
    print(report.table())
    print(f"{'drafter restarts by up':<31}  {restarts}; up exited with {code}")
    for problem in report.failures():
        print(f"FAILED: {problem}")
    return 1 if report.failures() else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=64, help="concurrent client streams")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the plan's random choices")
    parser.add_argument("--model", default=None, help="target checkpoint (default: embedded)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-kill", action="store_true", help="leave the drafter alone")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds for KV to be freed")
    parser.add_argument("--mix", action="store_true", help="logit rules, guides and sampling")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))
