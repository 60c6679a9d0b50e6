"""Start the three services as real processes on loopback ports, and talk to them over gRPC."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from specsplit.v1 import (
    common_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2_grpc,
)

ROLES = ("verifier", "drafter", "gateway")
TINY_VOCAB_SIZE = 49152  # SmolLM2's tokenizer: text and chat prompts work on tiny models
TINY_MODEL_NAME = "tiny-target"  # what the tiny_http_services fixture serves
NO_SPEC = common_pb2.SpecParams(num_steps=0, topk=1, num_draft_tokens=0)  # target-only rounds


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now. Each socket stays bound until all are drawn: ports drawn
    one after another can repeat (a port just closed is free again for the next draw)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


@dataclass
class Services:
    model: str
    log_dir: Path
    extra: dict[str, list[str]] = field(default_factory=dict)
    http: bool = False  # the gateway's OpenAI HTTP API on a free port (ports["http"]), else off
    metrics: bool = False  # each role's /metrics on a free port (ports["<role>-metrics"])
    env: dict[str, dict[str, str]] = field(default_factory=dict)  # extra environment per role
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # TLS credentials per role for the test's own clients (none = plaintext)
    credentials: dict[str, grpc.ChannelCredentials] = field(default_factory=dict)
    # the drafter and verifier on Unix sockets here (the gateway on their round lanes), else TCP
    unix_dir: Path | None = None

    def channel(self, role: str) -> grpc.Channel:
        credentials = self.credentials.get(role)
        if credentials is None:
            return grpc.insecure_channel(self.address(role))
        return grpc.secure_channel(self.address(role), credentials)

    def address(self, role: str) -> str:
        if self.unix_dir is not None and role in ("drafter", "verifier"):
            return f"unix:{self.unix_dir}/{role}.sock"
        return f"127.0.0.1:{self.ports[role]}"

    def command(self, role: str) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "specsplit.cli",
            f"serve-{role}",
            "--listen",
            self.address(role),
            "--model",
            self.model,
            "--grace",
            "1",
        ]
        if role != "gateway":
            cmd += ["--device", "cpu", "--dtype", "float32", "--num-pages", "512"]
        else:
            cmd += [
                "--drafter-address",
                self.address("drafter"),
                "--verifier-address",
                self.address("verifier"),
                "--http-listen",
                self.address("http") if self.http else "none",
            ]
        metrics = self.address(f"{role}-metrics") if self.metrics else "none"
        return [*cmd, "--metrics-listen", metrics, *self.extra.get(role, [])]

    def start(self, role: str) -> None:
        names = [role, f"{role}-metrics"] if self.metrics else [role]
        self.draw_ports(names)
        log = open(self.log_dir / f"{role}.log", "ab")  # noqa: SIM115 (lives with the process)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env |= self.env.get(role, {})
        self.procs[role] = subprocess.Popen(self.command(role), stdout=log, stderr=log, env=env)

    def start_all(self, timeout: float = 240.0, attempts: int = 3) -> None:
        """Start the three roles and wait until they serve. A port that `free_port` found free
        can be taken by another process before a service binds it: then start over on new
        ports (up to `attempts` times)."""
        chosen = dict(self.ports)  # ports a test fixed itself are kept
        for attempt in range(attempts):
            names = [*ROLES, "http"] if self.http else list(ROLES)
            if self.metrics:
                names += [f"{role}-metrics" for role in ROLES]
            self.draw_ports(names)
            for role in ROLES:
                self.start(role)
            try:
                for role in ROLES:
                    self.wait_serving(role, timeout)
                return
            except RuntimeError as e:
                if attempt + 1 == attempts or "bind" not in str(e).lower():
                    raise
                self.stop_all()
                self.ports = dict(chosen)

    def draw_ports(self, names: list[str]) -> None:
        """Free ports for the names that have none, distinct from each other and from those
        drawn before."""
        missing = [name for name in names if name not in self.ports]
        taken = set(self.ports.values())
        ports = [p for p in free_ports(len(missing) + len(taken)) if p not in taken]
        self.ports |= dict(zip(missing, ports, strict=False))

    def serving(self, timeout: float = 240.0) -> Iterator[Services]:
        """For a fixture (`yield from svc.serving()`): start all three, hand them over, stop
        them; every role must exit 0."""
        self.start_all(timeout)
        yield self
        codes = self.stop_all()
        assert all(code == 0 for code in codes.values()), (codes, {r: self.log(r) for r in codes})

    def wait_serving(self, role: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.channel(role) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                proc = self.procs[role]
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} exited with {proc.returncode}:\n{self.log(role)}")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise TimeoutError(f"{role} not SERVING after {timeout} s:\n{self.log(role)}")

    def stop(self, role: str, sig: int = signal.SIGTERM) -> int:
        proc = self.procs.pop(role)
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop_all(self) -> dict[str, int]:
        return {role: self.stop(role) for role in list(self.procs)}

    def log(self, role: str, whole: bool = False) -> str:
        """The service's log: its last 4000 characters (what an assertion shows), or `whole`
        (a line from its start-up, before the warm-up's)."""
        path = self.log_dir / f"{role}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text if whole else text[-4000:]

    # -- clients -----------------------------------------------------------------------------

    def gateway(self) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(self.channel("gateway"))

    def pages_used(self) -> dict[str, int]:
        """KV pages in use on drafter and verifier (an empty Release reports them)."""
        used = {}
        for role, stub_type in (
            ("drafter", drafter_pb2_grpc.DrafterStub),
            ("verifier", verifier_pb2_grpc.VerifierStub),
        ):
            with self.channel(role) as channel:
                used[role] = (
                    stub_type(channel)
                    .Release(common_pb2.ReleaseRequest(), timeout=10)
                    .num_pages_used
                )
        return used

    def wait_no_pages_used(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while (used := self.pages_used()) != {"drafter": 0, "verifier": 0}:
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pages still used: {used}")
            time.sleep(0.2)


def token_request(
    ids: list[int], max_new_tokens: int, **kwargs: object
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=ids), max_new_tokens=max_new_tokens, **kwargs
    )


def generate(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, timeout: float = 120.0
) -> list[gateway_pb2.GenerateResponse]:
    return list(stub.Generate(request, timeout=timeout))


def ids_of(responses: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def scrape(services: Services, role: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a role's /metrics."""
    url = f"http://{services.address(f'{role}-metrics')}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def target_only(
    services: Services, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Each prompt's tokens with speculation off, one stream at a time: the reference."""
    stub = services.gateway()
    return [
        ids_of(generate(stub, token_request(p, max_new_tokens, spec=NO_SPEC, ignore_eos=True)))
        for p in prompts
    ]


def check_eagle_rounds_equal_target_only(
    services: Services, prompts: list[list[int]], max_new_tokens: int, spec: Any
) -> None:
    """Each prompt speculated with an EAGLE head (`spec`) gives its target-only tokens, after
    rounds that drafted; then no KV is left, and the drafter got its features and drafted (a
    failing Draft is logged as "drafter failed (...)", one before the drafter is warm as "the
    drafter is still loading", and its round goes on without drafts)."""
    stub = services.gateway()
    for prompt in prompts:
        speculative = generate(
            stub, token_request(prompt, max_new_tokens, spec=spec, ignore_eos=True)
        )
        plain = generate(stub, token_request(prompt, max_new_tokens, spec=NO_SPEC, ignore_eos=True))
        assert ids_of(speculative) == ids_of(plain)
        assert speculative[-1].spec_stats.rounds >= 1
    services.wait_no_pages_used()
    log = services.log("gateway")
    assert "drafter failed" not in log and "drafter is still loading" not in log
    assert "Traceback" not in services.log("drafter")


def streams_with_a_fault(
    services: Services,
    prompts: list[list[int]],
    max_new_tokens: int,
    spec: common_pb2.SpecParams,
    fault: Callable[[], None],
) -> list[list[int]]:
    """Every prompt as its own stream, at once; `fault()` once the first stream has 6 tokens,
    while all of them run. The tokens each stream received."""
    stub = services.gateway()
    first_tokens = threading.Event()

    def run(i: int) -> list[int]:
        received: list[int] = []
        call = stub.Generate(
            token_request(prompts[i], max_new_tokens, spec=spec, ignore_eos=True), timeout=300
        )
        for response in call:
            received += response.token_ids
            if i == 0 and len(received) >= 6:
                first_tokens.set()
        return received

    with ThreadPoolExecutor(len(prompts)) as pool:
        running = [pool.submit(run, i) for i in range(len(prompts))]
        assert first_tokens.wait(120)
        assert not all(r.done() for r in running)  # the fault lands mid-stream
        fault()
        return [r.result() for r in running]


def check_drafter_killed_mid_stream(
    services: Services, prompts: list[list[int]], max_new_tokens: int, spec: common_pb2.SpecParams
) -> None:
    """Streams at once, the drafter killed mid-stream: each keeps target-only's tokens (decoded
    without drafts meanwhile), no KV is left; the drafter is started again."""
    expected = target_only(services, prompts, max_new_tokens)
    try:
        received = streams_with_a_fault(
            services,
            prompts,
            max_new_tokens,
            spec,
            lambda: services.stop("drafter", signal.SIGKILL),
        )
    finally:
        services.start("drafter")
        services.wait_serving("drafter", 240)
    assert received == expected
    services.wait_no_pages_used()


def check_verifier_restarted_mid_stream(
    services: Services, prompts: list[list[int]], max_new_tokens: int, spec: common_pb2.SpecParams
) -> None:
    """Streams at once, the verifier killed and restarted mid-stream (every sequence's KV gone,
    the gateway re-prefills each from its own tokens): nothing lost or repeated, no KV left."""
    expected = target_only(services, prompts, max_new_tokens)

    def restart() -> None:
        services.stop("verifier", signal.SIGKILL)
        services.start("verifier")

    received = streams_with_a_fault(services, prompts, max_new_tokens, spec, restart)
    assert received == expected
    services.wait_serving("verifier", 240)
    services.wait_no_pages_used()
