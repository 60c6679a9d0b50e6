"""Observability wiring without services: tracing stays off unless OTEL_* ask for it, and each
service gets its own /metrics address (`specsplit up` included)."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from gateway.request import GenerationRequest
from specsplit import cli, telemetry, up
from specsplit.v1 import drafter_pb2


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*telemetry.ENABLING_ENV, "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)


def test_no_otel_env_installs_nothing(no_otel_env: None) -> None:
    assert telemetry.init("gateway") is False
    assert not telemetry.enabled()
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"  # the API default
    span = telemetry.start_request("m", GenerationRequest(prompt_ids=[1, 2], max_new_tokens=4))
    assert span is trace.INVALID_SPAN and not span.is_recording()
    with telemetry.round_span([span]) as round_span:
        assert round_span is trace.INVALID_SPAN
        request = drafter_pb2.DraftRequest()
        telemetry.inject(request.trace_context)
        assert dict(request.trace_context) == {}  # nothing travels to the services
    with telemetry.service_span("specsplit.draft", request) as service_span:
        assert service_span is trace.INVALID_SPAN
    assert telemetry.incoming((("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),)) is None


def test_traces_exporter_none_installs_nothing(
    no_otel_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert telemetry.init("verifier") is False
    assert not telemetry.enabled()


@pytest.mark.parametrize(
    ("service", "port"), [("gateway", 9400), ("drafter", 9401), ("verifier", 9402)]
)
def test_each_service_has_its_own_default_metrics_port(
    service: str, port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECSPLIT_METRICS_LISTEN", raising=False)
    assert cli.parse_args([f"serve-{service}"]).metrics_listen == f"127.0.0.1:{port}"  # loopback
    monkeypatch.setenv("SPECSPLIT_METRICS_LISTEN", "none")
    assert cli.parse_args([f"serve-{service}"]).metrics_listen is None


def test_up_gives_each_service_a_distinct_metrics_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSPLIT_METRICS_LISTEN", raising=False)
    commands = up.child_commands(cli.parse_args(["up", "--metrics-listen", "127.0.0.1:9500"]))
    listen = {name: cli.parse_args(argv[3:]).metrics_listen for name, argv in commands.items()}
    assert listen == {
        "gateway": "127.0.0.1:9500",
        "drafter": "127.0.0.1:9501",
        "verifier": "127.0.0.1:9502",
    }
    commands = up.child_commands(cli.parse_args(["up", "--metrics-listen", "none"]))
    assert all(cli.parse_args(argv[3:]).metrics_listen is None for argv in commands.values())
