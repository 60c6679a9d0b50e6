"""docker-compose.yml (+ the CPU override) run as its containers would run it, without Docker:
each service's own command and environment, the `sockets` volume a temporary directory, the
host's TCP listeners moved to free loopback ports and tracing off (no Jaeger here). The
drafter and the verifier come up on their Unix sockets with their round lanes beside them, the
compose health probes answer SERVING on those sockets, and the gateway, finding them by the
addresses compose gives it, streams the embedded default's greedy tokens equal to target-only
decoding through the same services."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.services import NO_SPEC, free_ports, generate, ids_of
from tests.unit.test_compose import (
    COMPOSE,
    COMPOSE_CPU,
    command,
    environment,
    load,
    merge,
    probe,
)

SOCKETS = "/run/specsplit"  # the compose volume's mount point
TCP_LISTENERS = (
    "SPECSPLIT_GATEWAY_LISTEN",
    "SPECSPLIT_HTTP_LISTEN",
    "SPECSPLIT_METRICS_LISTEN",
)
CHAIN = common_pb2.SpecParams(num_steps=3, topk=1, num_draft_tokens=3)


def _env(service: dict[str, Any], sockets: Path, ports: Iterator[int]) -> dict[str, str]:
    """The container's environment here: the volume's path replaced, TCP listeners on free
    loopback ports, no SPECSPLIT_* / OTEL_* variable of this shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECSPLIT_", "OTEL_"))}
    for key, value in environment(service).items():
        if key.startswith("OTEL_"):
            continue
        if key in TCP_LISTENERS and value not in ("", "none"):
            value = f"127.0.0.1:{next(ports)}"
        env[key] = value.replace(SOCKETS, str(sockets))
    return env


def _healthy(service: dict[str, Any], address: str, timeout: float) -> None:
    """The service's compose health probe, again until it exits 0."""
    source, _ = probe(service)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        argv = [sys.executable, "-c", source, address]
        if subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0:
            return
        time.sleep(1.0)
    raise AssertionError(f"not healthy on {address} after {timeout:.0f} s")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    import grpc

    compose = merge(load(COMPOSE), load(COMPOSE_CPU))
    root = tmp_path_factory.mktemp("compose")
    sockets = root / "run"
    sockets.mkdir()
    ports = iter(free_ports(8))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in ("verifier", "drafter", "gateway"):  # as depends_on orders them
            service = compose["services"][name]
            env = _env(service, sockets, ports)
            log = open(root / f"{name}.log", "wb")  # noqa: SIM115 (lives with the process)
            argv = [sys.executable, "-m", "specsplit.cli", *command(service)]
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, probed = probe(service)
            address = probed.replace(SOCKETS, str(sockets))
            if name == "gateway":  # probed on its own port inside the container
                address = env["SPECSPLIT_GATEWAY_LISTEN"]
            _healthy(service, address, timeout=600)
        for name in ("verifier", "drafter"):
            assert (sockets / f"{name}.sock.rounds").exists(), f"{name}: no round lane"
        channel = grpc.insecure_channel(env["SPECSPLIT_GATEWAY_LISTEN"])
        yield gateway_pb2_grpc.GatewayStub(channel)
        channel.close()
    finally:
        for proc in reversed(list(procs.values())):
            proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"{name} did not stop on SIGTERM") from None


def test_compose_services_stream_target_only_tokens_over_their_lanes(
    gateway: gateway_pb2_grpc.GatewayStub,
) -> None:
    # repeated: the CPU override's drafter is prompt lookup (`--drafter auto` on a CPU)
    prompt = [1, 9690, 28, 1059, 314, 260, 6429, 3071, 47, 2] * 3
    runs = {}
    for label, spec in (("speculative", CHAIN), ("target only", NO_SPEC)):
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            max_new_tokens=24,
            spec=spec,
            ignore_eos=True,
        )
        runs[label] = generate(gateway, request, timeout=300)
    assert ids_of(runs["speculative"]) == ids_of(runs["target only"])
    assert len(ids_of(runs["speculative"])) == 24
    stats = runs["speculative"][-1].spec_stats
    assert stats.mean_accepted_tokens > 1.0, stats  # the drafter drafted, and was accepted
