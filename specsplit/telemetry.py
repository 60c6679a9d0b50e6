"""Tracing (OpenTelemetry): one trace per client request across gateway, drafter and verifier.

    gateway  text_completion {model}   the request (GenAI semantic conventions), child of the
             │                         client's W3C context from the Generate metadata
             └ specsplit.round         one per round, child of the batch's oldest request and
               │                       linked to every request in the batch
               ├ specsplit.draft       on the drafter  (parent from DraftRequest.trace_context)
               └ specsplit.verify      on the verifier (parent from VerifyRequest.trace_context)

Nothing is installed unless OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
OTEL_TRACES_EXPORTER is set (then an OTLP gRPC exporter, configured by the standard OTEL_*
variables): every helper here is then a no-op returning the API's non-recording span.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

if TYPE_CHECKING:  # types only: no torch for a telemetry import
    from specsplit.sampling import SamplingParams

log = logging.getLogger(__name__)

ENABLING_ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
)
_NO_SPAN = trace.INVALID_SPAN
_enabled = False
_tracer: trace.Tracer = trace.NoOpTracer()


def init(service: str) -> bool:
    """Install the SDK with an OTLP exporter for `service` ("gateway", "drafter", "verifier")
    when the OTEL_* environment asks for it; False (nothing installed) otherwise."""
    global _enabled, _tracer
    exporter_kind = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not any(os.environ.get(name) for name in ENABLING_ENV) or exporter_kind == "none":
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    exporter: SpanExporter
    if exporter_kind == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, insecure: OTEL_EXPORTER_OTLP_*
    name = os.environ.get("OTEL_SERVICE_NAME") or f"specsplit-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))  # flushed at exit
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("specsplit")
    _enabled = True
    log.info("tracing: exporting spans of %s (%s)", name, exporter_kind or "otlp")
    return True


def enabled() -> bool:
    return _enabled


# -- the gateway's request span --------------------------------------------------------------


class TracedRequest(Protocol):
    """What the request span reads of a request (gateway.request.GenerationRequest)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def sampling(self) -> SamplingParams: ...


class RequestStats(Protocol):
    """A request's speculation counts (gateway.request.SpecStats)."""

    @property
    def rounds(self) -> int: ...

    @property
    def num_accepted_drafts(self) -> int: ...

    @property
    def num_reused_tokens(self) -> int: ...

    @property
    def mean_accepted_tokens(self) -> float: ...


class TracedSequence(Protocol):
    """What `end_request` reads of a gateway sequence (gateway.sequence.Sequence)."""

    @property
    def span(self) -> Any: ...  # the request span from `start_request`, or None

    @property
    def num_generated_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def stats(self) -> RequestStats: ...


def incoming(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context | None:
    """The client's W3C context (`traceparent` in gRPC metadata or HTTP headers), or None."""
    if not _enabled or not metadata:
        return None
    return propagate.extract({k.lower(): v for k, v in metadata if isinstance(v, str)})


@contextlib.contextmanager
def client_context(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make the client's context current while the request span is started."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def start_request(model: str, request: TracedRequest) -> Span:
    """The request span, child of the current (client's) context; ended by `end_request`."""
    if not _enabled:
        return _NO_SPAN
    sampling = request.sampling
    return _tracer.start_span(
        f"text_completion {model}",
        kind=SpanKind.SERVER,
        attributes={
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": request.max_new_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.usage.input_tokens": len(request.prompt_ids),
        },
    )


def end_request(seq: TracedSequence, error: BaseException | None = None) -> None:
    """Usage, speculation stats and the outcome of a gateway sequence on its request span (from
    `start_request`), then end it."""
    span: Span | None = seq.span
    if span is None or not span.is_recording():
        return
    span.set_attributes(
        {
            "gen_ai.usage.output_tokens": seq.num_generated_tokens,
            "gen_ai.response.finish_reasons": [seq.finish_reason or "cancelled"],
            "specsplit.rounds": seq.stats.rounds,
            "specsplit.num_accepted_drafts": seq.stats.num_accepted_drafts,
            "specsplit.mean_accepted_tokens": seq.stats.mean_accepted_tokens,
            "specsplit.num_reused_tokens": seq.stats.num_reused_tokens,  # a session's kept KV
        }
    )
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


# -- rounds ----------------------------------------------------------------------------------


@contextlib.contextmanager
def round_span(request_spans: Sequence[Span]) -> Iterator[Span]:
    """A round's span, current while it runs (the clients inject it into the round requests):
    child of the batch's oldest request, linked to all of them."""
    if not _enabled:
        yield _NO_SPAN
        return
    spans = [span for span in request_spans if span is not None]
    parent = trace.set_span_in_context(spans[0]) if spans else None
    links = [Link(span.get_span_context()) for span in spans]
    attributes = {"specsplit.batch_size": len(request_spans)}
    with _tracer.start_as_current_span(
        "specsplit.round", context=parent, links=links, attributes=attributes
    ) as span:
        yield span


def annotate(attributes: Mapping[str, int]) -> None:
    """Attributes on the current span (a round's: its RPCs' stages), when tracing is on."""
    if _enabled:
        trace.get_current_span().set_attributes(attributes)


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current context (the round span) into a round request's trace_context."""
    if _enabled:
        propagate.inject(carrier)


@contextlib.contextmanager
def service_span(name: str, request: Any) -> Iterator[Span]:
    """`specsplit.draft` / `specsplit.verify` on a service for a DraftRequest / VerifyRequest:
    child of the gateway's round span carried in its trace_context."""
    if not _enabled:
        yield _NO_SPAN
        return
    parent = propagate.extract(dict(request.trace_context))
    attributes = {"specsplit.batch_size": len(request.seq_ids)}
    with _tracer.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span
