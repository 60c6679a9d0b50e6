"""Metrics and traces of the three real services: the /metrics endpoints count exactly what a
client received, and one trace (exported over OTLP to a receiver in this test) covers a request
on the gateway, its rounds, and their draft and verify spans on the drafter and verifier.

The drafter is the target itself (greedy), so every draft is accepted and rounds are full.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from drafter.draft_rules import RULE_SLOTS
from specsplit.metrics import RPC_STAGES
from specsplit.v1 import common_pb2, gateway_pb2
from tests.integration.services import (
    ROLES,
    Services,
    generate,
    ids_of,
    scrape,
    token_request,
    value,
)
from tests.support import save_tiny_llama
from verifier.rule_rows import MIN_SLOTS

VOCAB = 49152
NUM_PAGES = 512  # Services gives drafter and verifier --num-pages 512
SPEC = common_pb2.SpecParams(num_steps=3, topk=2, num_draft_tokens=5)
PROMPT = [(11 * j) % 4000 + 100 for j in range(9)]
MAX_NEW_TOKENS = 20
FAVOURED = 12345  # the token the bias test favours
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"

T = TypeVar("T")


# -- an OTLP gRPC receiver -------------------------------------------------------------------


@dataclass
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, Any]:
        return _attributes(self.span.attributes)


def _value(value: otlp_common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = _attributes(resource_spans.resource.attributes)["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    self._spans += [ReceivedSpan(service, s) for s in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id in (None, s.span.trace_id.hex())]


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    receiver = Collector()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(0)


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer, collector: tuple[Collector, int]
) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("observability")
    model = save_tiny_llama(root / "target", seed=5, vocab_size=VOCAB, tokenizer=smollm2_tokenizer)
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector[1]}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: spans reach the receiver quickly
    }
    svc = Services(
        str(model),
        root,
        extra={"drafter": ["--drafter", "model", "--draft-model", str(model)]},
        metrics=True,
        env=dict.fromkeys(ROLES, otel),
        unix_dir=root,  # the engines on Unix sockets: the rounds on the lane, timed in stages
    )
    yield from svc.serving()


# -- helpers ---------------------------------------------------------------------------------


def eventually(fn: Callable[[], T], ok: Callable[[T], bool], timeout: float = 15.0) -> T:
    deadline = time.monotonic() + timeout
    while not ok(result := fn()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return result


def first_chunk_tokens(responses: list[gateway_pb2.GenerateResponse]) -> int:
    return next(len(r.token_ids) for r in responses if r.token_ids)


# -- metrics ---------------------------------------------------------------------------------


def test_the_drafter_bends_its_drafts_by_a_requests_bias_over_the_wire(services: Services) -> None:
    """A request's logit bias reaches the drafter with its first Draft (DraftRules, over the
    round lane) and bends its drafts (drafter/draft_rules.py): the drafter here is the target,
    so under a bias alone it drafts the target's biased argmax, and every draft is accepted
    (unbent, none was: the favoured token is the biased target's pick at every place, never the
    plain target's); the drafter's rule tables show in specsplit_rule_rows_bytes."""
    plain = generate(
        services.gateway(), token_request(PROMPT, MAX_NEW_TOKENS, spec=SPEC, ignore_eos=True)
    )
    request = token_request(PROMPT, MAX_NEW_TOKENS, spec=SPEC, ignore_eos=True)
    banned = set(ids_of(plain)[:4])
    for token in banned:
        request.logit_bias[token] = -100.0
    request.logit_bias[FAVOURED] = 12.0
    biased = generate(services.gateway(), request)
    services.wait_no_pages_used()
    ids, stats = ids_of(biased), biased[-1].spec_stats
    assert ids == [FAVOURED] * MAX_NEW_TOKENS != ids_of(plain)
    assert stats.num_accepted_drafts == SPEC.num_steps * stats.rounds  # (every round's 3)
    tables = value(scrape(services, "drafter"), "specsplit_rule_rows_bytes")
    assert tables == (RULE_SLOTS + 1) * VOCAB * (4 + 4 + 1 + 4) + (RULE_SLOTS + 1) * 3 * 4


def test_metrics_count_exactly_what_the_client_received(services: Services) -> None:
    before = {role: scrape(services, role) for role in ROLES}
    responses = generate(services.gateway(), token_request(PROMPT, MAX_NEW_TOKENS, spec=SPEC))
    services.wait_no_pages_used()
    after = {role: scrape(services, role) for role in ROLES}

    def delta(role: str, name: str, **labels: str) -> float:
        return value(after[role], name, **labels) - value(before[role], name, **labels)

    ids, stats = ids_of(responses), responses[-1].spec_stats
    assert len(ids) == MAX_NEW_TOKENS and stats.rounds >= 2
    assert delta("gateway", "specsplit_generated_tokens_total") == len(ids)
    assert delta("gateway", "specsplit_accepted_tokens_per_round_count") == stats.rounds
    num_accepted_tokens = stats.num_accepted_drafts + stats.rounds
    assert delta("gateway", "specsplit_accepted_tokens_per_round_sum") == num_accepted_tokens
    accepted = "specsplit_accepted_drafts_total"
    by_depth = [delta("gateway", accepted, depth=str(d)) for d in (1, 2, 3)]
    assert sum(by_depth) == stats.num_accepted_drafts
    assert by_depth[0] >= by_depth[1] >= by_depth[2]  # depth d accepted => d - 1 accepted
    assert delta("gateway", "specsplit_time_to_first_token_seconds_count") == 1
    itl_count = delta("gateway", "specsplit_inter_token_latency_seconds_count")
    assert itl_count == len(ids) - first_chunk_tokens(responses)
    for role, name in (
        ("gateway", "specsplit_draft_seconds_count"),  # round trips as the gateway sees them
        ("gateway", "specsplit_verify_seconds_count"),
        ("drafter", "specsplit_draft_seconds_count"),  # engine time on the services
        ("verifier", "specsplit_verify_seconds_count"),
        ("gateway", "specsplit_round_seconds_count"),
        ("gateway", "specsplit_round_outside_verify_seconds_count"),
    ):
        assert delta(role, name) == stats.rounds, (role, name)
    for service in ("drafter", "verifier"):  # each round's RPC less its engine time
        overhead = "specsplit_rpc_overhead_seconds_count"
        assert delta("gateway", overhead, service=service) == stats.rounds, service
        # the part of it on the service: request read to response ready, less the engine
        assert delta(service, "specsplit_service_overhead_seconds_count") == stats.rounds
    outside = delta("gateway", "specsplit_round_outside_verify_seconds_sum")
    assert 0 < outside <= delta("gateway", "specsplit_round_seconds_sum")
    for role in ("drafter", "verifier"):
        assert value(after[role], "specsplit_kv_pages_used") == 0, role
        assert value(after[role], "specsplit_kv_pages_free") == NUM_PAGES, role
    # the logit-rules rows' tables at their least: slots x vocabulary x (bias, counts, seen)
    assert value(after["verifier"], "specsplit_rule_rows_bytes") == MIN_SLOTS * VOCAB * (4 + 4 + 1)
    queue = eventually(
        lambda: scrape(services, "gateway"),
        lambda s: value(s, "specsplit_running_sequences") == 0,
    )
    assert value(queue, "specsplit_running_sequences") == 0
    assert value(queue, "specsplit_waiting_sequences") == 0


def test_errors_are_counted_by_grpc_code(services: Services) -> None:
    name = "specsplit_errors_total"
    before = value(scrape(services, "gateway"), name, code="INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError) as err:
        generate(services.gateway(), token_request(PROMPT, 0))  # max_new_tokens must be > 0
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = value(scrape(services, "gateway"), name, code="INVALID_ARGUMENT")
    assert after == before + 1


# -- tracing ---------------------------------------------------------------------------------


def test_one_trace_spans_gateway_drafter_and_verifier(
    services: Services, collector: tuple[Collector, int]
) -> None:
    receiver = collector[0]
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    request = token_request(PROMPT, MAX_NEW_TOKENS, spec=SPEC)
    responses = list(
        services.gateway().Generate(request, metadata=(("traceparent", traceparent),), timeout=120)
    )
    stats = responses[-1].spec_stats

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = [s.name for s in spans]
        return (
            "text_completion target" in names
            and names.count("specsplit.draft") == stats.rounds
            and names.count("specsplit.verify") == stats.rounds
        )

    spans = eventually(lambda: receiver.spans(CLIENT_TRACE_ID), complete)
    assert complete(spans), sorted((s.service, s.name) for s in spans)
    assert {s.service for s in spans} == {f"specsplit-{role}" for role in ROLES}

    (request_span,) = [s for s in spans if s.name == "text_completion target"]
    assert request_span.service == "specsplit-gateway"
    assert request_span.parent_id == CLIENT_SPAN_ID  # the client's traceparent is honoured
    attributes = request_span.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == "target"
    assert attributes["gen_ai.request.max_tokens"] == MAX_NEW_TOKENS
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.top_p"] == 1.0
    assert attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert attributes["gen_ai.usage.output_tokens"] == len(ids_of(responses)) == MAX_NEW_TOKENS
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["specsplit.rounds"] == stats.rounds
    assert attributes["specsplit.num_accepted_drafts"] == stats.num_accepted_drafts
    assert attributes["specsplit.mean_accepted_tokens"] == pytest.approx(stats.mean_accepted_tokens)

    rounds = [s for s in spans if s.name == "specsplit.round"]
    assert len(rounds) == stats.rounds
    for round_span in rounds:
        assert round_span.service == "specsplit-gateway"
        assert round_span.parent_id == request_span.span_id
        assert [link.span_id.hex() for link in round_span.span.links] == [request_span.span_id]
        assert round_span.attributes["specsplit.batch_size"] == 1
        for service in ("drafter", "verifier"):  # each RPC's stages on the lane
            stages = [round_span.attributes[f"specsplit.{service}_rpc.{s}_ns"] for s in RPC_STAGES]
            assert all(ns >= 0 for ns in stages) and stages[2] > 0, (service, stages)
    round_ids = {s.span_id for s in rounds}
    for name, service, timing in (
        ("specsplit.draft", "specsplit-drafter", "specsplit.draft_ns"),
        ("specsplit.verify", "specsplit-verifier", "specsplit.verify_ns"),
    ):
        children = [s for s in spans if s.name == name]
        assert {s.service for s in children} == {service}
        assert {s.parent_id for s in children} == round_ids  # one per round
        assert all(s.attributes[timing] > 0 for s in children), name
        assert all(s.attributes["specsplit.batch_size"] == 1 for s in children), name

    assert {s.name for s in spans} == {
        "text_completion target",
        "specsplit.round",
        "specsplit.draft",
        "specsplit.verify",
    }
    # Services.wait_serving polled every service's health: none of it is traced
    assert not [s for s in receiver.spans() if "health" in s.name.lower()]
