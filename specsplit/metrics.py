"""Prometheus metrics: one /metrics endpoint per service (`--metrics-listen`, "none" = off).

Recording them: the gateway's rounds, commits, gates, queue and sessions; the drafter's and
verifier's forwards, run-ahead outcomes and waits; RPC errors; GC pauses (`watch_gc`); `serve`
starts the endpoint. The metrics themselves (names, help texts, buckets) are in
specsplit/metric_defs.py; those callers read as `metrics.NAME` are imported here.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from specsplit.metric_defs import (
    ACCEPTED_DRAFTS,
    ACCEPTED_TOKENS_PER_ROUND,
    DECODE_AHEAD,
    DECODE_AHEAD_DROPPED,
    DECODE_STEPS,
    DECODED_TOKENS,
    DRAFT_AHEAD,
    DRAFTER_EAGER_FORWARDS,
    DRAFTER_FORWARDS,
    ERRORS,
    GATE_ROUND_SECONDS,
    GC_PAUSE_SECONDS,
    GENERATED_TOKENS,
    HINTS,
    INTER_TOKEN_LATENCY,
    KV_PAGES_FREE,
    KV_PAGES_USED,
    OVERLAP_MODE,
    PREEMPTIONS,
    ROUND_AHEAD,
    ROUND_NOT_AHEAD,
    ROUND_OUTSIDE_DEVICE_SECONDS,
    ROUND_OUTSIDE_VERIFY_SECONDS,
    ROUND_SECONDS,
    ROUNDS,
    RULE_ROWS_BYTES,
    RUNNING_SEQUENCES,
    SESSION_EVICTIONS,
    SESSION_KV_PAGES,
    SESSION_TOKENS_REUSED,
    SESSIONS_OPEN,
    SPECULATING,
    TIME_TO_FIRST_TOKEN,
    VERIFIER_EAGER_FORWARDS,
    VERIFIER_EAGER_RULES_ROUNDS,
    VERIFIER_FORWARDS,
    VERIFIER_GAP_SECONDS,
    VERIFIER_IDLE_SECONDS,
    VERIFIER_LOOKUP_TOKENS,
    VERIFIER_RULES_ROUNDS,
    VERIFIER_STEP_IDLE_SECONDS,
    VERIFIER_WAIT_SECONDS,
    WAITING_SEQUENCES,
)

# read by callers as metrics.NAME: the services' own timings, the RPC stages, the gate's round kinds
from specsplit.metric_defs import DRAFT_SECONDS as DRAFT_SECONDS
from specsplit.metric_defs import GATE_ROUND_KINDS as GATE_ROUND_KINDS
from specsplit.metric_defs import RPC_OVERHEAD_SECONDS as RPC_OVERHEAD_SECONDS
from specsplit.metric_defs import RPC_STAGE_SECONDS as RPC_STAGE_SECONDS
from specsplit.metric_defs import RPC_STAGES as RPC_STAGES
from specsplit.metric_defs import SERVICE_OVERHEAD_SECONDS as SERVICE_OVERHEAD_SECONDS
from specsplit.metric_defs import VERIFY_DEVICE_SECONDS as VERIFY_DEVICE_SECONDS
from specsplit.metric_defs import VERIFY_SECONDS as VERIFY_SECONDS

if TYPE_CHECKING:  # types only: no torch for a metrics import
    from specsplit.messages import VerifyOutput

log = logging.getLogger(__name__)


@functools.cache
def watch_gc() -> None:
    """Time every collection of this process's garbage collector (`gc.callbacks`; once)."""
    started: list[float] = []
    pauses = [GC_PAUSE_SECONDS.labels(str(generation)) for generation in range(3)]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses[info["generation"]].observe(time.perf_counter() - started.pop())

    gc.callbacks.append(timed)


def serve(listen: str | None) -> int | None:
    """Serve /metrics on `listen` ("host:port"; None = off) from a daemon thread; the port."""
    if listen is None:
        return None
    host, _, port = listen.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0")
    bound = int(server.server_port)
    log.info("Prometheus metrics on http://%s:%d/metrics", host or "0.0.0.0", bound)
    return bound


# -- gateway ---------------------------------------------------------------------------------


class StreamedChunk(Protocol):
    """What the metrics read of a chunk the gateway streams (gateway.request.Chunk)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def elapsed_ns(self) -> int: ...  # since the request's arrival


class TokenClock(Protocol):
    """What the metrics keep on a gateway sequence (gateway.sequence.Sequence)."""

    last_token_ns: int | None  # elapsed_ns of its last chunk with tokens; None before the first


def observe_queue(num_running: int, num_waiting: int) -> None:
    RUNNING_SEQUENCES.set(num_running)
    WAITING_SEQUENCES.set(num_waiting)


def observe_gated_round(kind: str, seconds: float) -> None:
    GATE_ROUND_SECONDS[kind].observe(seconds)


def observe_speculation_gate(batch_bucket: int, speculating: bool) -> None:
    _child(SPECULATING, str(batch_bucket)).set(1 if speculating else 0)


def observe_overlap_gate(batch_bucket: int, mode: str, modes: tuple[str, ...]) -> None:
    for each in modes:
        _child(OVERLAP_MODE, str(batch_bucket), each).set(1 if each == mode else 0)


def observe_draft_ahead(hits: int, misses: int) -> None:
    if hits:
        _child(DRAFT_AHEAD, "hit").inc(hits)
    if misses:
        _child(DRAFT_AHEAD, "miss").inc(misses)


def observe_preemption() -> None:
    PREEMPTIONS.inc()


def watch_sessions(state: Callable[[], tuple[int, int]]) -> None:
    """Read (open sessions, their verifier KV pages) at scrape time."""
    SESSIONS_OPEN.set_function(lambda: state()[0])
    SESSION_KV_PAGES.set_function(lambda: state()[1])


def observe_session_eviction(reason: str) -> None:
    SESSION_EVICTIONS.labels(reason=reason).inc()


def observe_session_turn(num_reused_tokens: int) -> None:
    SESSION_TOKENS_REUSED.observe(num_reused_tokens)


def observe_commits(rounds: Iterable[tuple[TokenClock, VerifyOutput, StreamedChunk]]) -> None:
    """Sequences' round outcomes (after each seq.commit): acceptance, tokens, TTFT, ITL. The
    counters move once per call, by the rounds' totals (a labelled child and an increment cost
    ~2-5 us each on the host: per sequence and depth they were ~1 ms a round at batch 32)."""
    decoded = generated = 0
    by_depth: list[int] = []  # sequences whose drafts were accepted to depth d + 1
    for seq, out, chunk in rounds:
        ACCEPTED_TOKENS_PER_ROUND.observe(out.num_accepted_tokens)
        decoded += len(out.decoded_tokens)
        drafts = out.num_accepted_drafts
        if drafts > len(by_depth):
            by_depth += [0] * (drafts - len(by_depth))
        for depth in range(drafts):
            by_depth[depth] += 1
        num_tokens = len(chunk.token_ids)
        if num_tokens == 0:
            continue
        generated += num_tokens
        if seq.last_token_ns is None:
            TIME_TO_FIRST_TOKEN.observe(chunk.elapsed_ns / 1e9)
        else:
            gap = (chunk.elapsed_ns - seq.last_token_ns) / 1e9 / num_tokens
            for _ in range(num_tokens):
                INTER_TOKEN_LATENCY.observe(gap)
        seq.last_token_ns = chunk.elapsed_ns
    if decoded:
        DECODED_TOKENS.inc(decoded)
    for depth, count in enumerate(by_depth, start=1):
        _child(ACCEPTED_DRAFTS, str(depth)).inc(count)
    if generated:
        GENERATED_TOKENS.inc(generated)


@functools.cache
def _child(metric: Counter | Gauge | Histogram, *values: str) -> Any:
    """`metric.labels(*values)`, made once: each labels() call checks the values and takes the
    metric's lock (~2-5 us on a host), and a round reports several (the gateway's hints and
    draft-ahead outcomes, the verifier's gap phases). Label values come from small fixed sets
    (outcomes, reasons, phases, batch buckets), so the cache stays small; no metric here ever
    removes a child, so a cached one is always the registry's."""
    return metric.labels(*values)


def observe_decode_steps(steps: int) -> None:
    DECODE_STEPS.observe(steps)


def observe_round(
    kind: str, seconds: float, verify_engine_seconds: float, device_seconds: float
) -> None:
    """A round of `kind` (ROUNDS), its wall time on the gateway, and what of it the verifier's
    engine did not take (its call, and where measured its device)."""
    _child(ROUNDS, kind).inc()
    ROUND_SECONDS.observe(seconds)
    ROUND_OUTSIDE_VERIFY_SECONDS.observe(max(seconds - verify_engine_seconds, 0.0))
    if device_seconds > 0:
        ROUND_OUTSIDE_DEVICE_SECONDS.observe(max(seconds - device_seconds, 0.0))


class timed:
    """`with timed(DRAFT_SECONDS):` observes the block's wall time unless it raised."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.histogram.observe(time.perf_counter() - self._start)


# -- drafter and verifier --------------------------------------------------------------------


def watch_kv_pages(pages: Callable[[], tuple[int, int]]) -> None:
    """Read (used, free) KV pages at scrape time (two lengths: safe from the scrape thread)."""
    KV_PAGES_USED.set_function(lambda: pages()[0])
    KV_PAGES_FREE.set_function(lambda: pages()[1])


def watch_rule_rows(nbytes: Callable[[], int]) -> None:
    """Read the service's logit-rules rows' bytes at scrape time (verifier/rule_rows.py, the
    drafter's drafter/draft_rules.py)."""
    RULE_ROWS_BYTES.set_function(nbytes)


def count_decode_ahead(outcome: str) -> None:
    _child(DECODE_AHEAD, outcome).inc()


def count_verifier_forward(eager_why: str | None) -> None:
    """A verifier forward: a graph's replay (None), or eager and why (VERIFIER_EAGER_FORWARDS)."""
    _count_forward(VERIFIER_FORWARDS, VERIFIER_EAGER_FORWARDS, eager_why)


def count_drafter_forward(eager_why: str | None) -> None:
    """A drafter forward: a graph's replay (None), or eager and why (DRAFTER_EAGER_FORWARDS)."""
    _count_forward(DRAFTER_FORWARDS, DRAFTER_EAGER_FORWARDS, eager_why)


def count_lookup_tokens(drafted: int, accepted: int) -> None:
    """Prompt lookup's drafts of a verifier's round (VERIFIER_LOOKUP_TOKENS)."""
    if drafted:
        _child(VERIFIER_LOOKUP_TOKENS, "drafted").inc(drafted)
    if accepted:
        _child(VERIFIER_LOOKUP_TOKENS, "accepted").inc(accepted)


def count_rules_round(eager_why: str | None) -> None:
    """A verifier round bent by rules: by a rules graph (None), or eagerly and why
    (VERIFIER_EAGER_RULES_ROUNDS)."""
    _count_forward(VERIFIER_RULES_ROUNDS, VERIFIER_EAGER_RULES_ROUNDS, eager_why)


def _count_forward(paths: Counter, whys: Counter, eager_why: str | None) -> None:
    if eager_why is None:
        _child(paths, "graph").inc()
        return
    _child(paths, "eager").inc()
    _child(whys, eager_why).inc()


def count_decode_ahead_dropped(reason: str) -> None:
    _child(DECODE_AHEAD_DROPPED, reason).inc()


def count_round_ahead(outcome: str) -> None:
    _child(ROUND_AHEAD, outcome).inc()


def count_round_not_ahead(reason: str) -> None:
    _child(ROUND_NOT_AHEAD, reason).inc()


def count_hint(outcome: str) -> None:
    _child(HINTS, outcome).inc()


def observe_verifier_wait(seconds: float) -> None:
    VERIFIER_WAIT_SECONDS.observe(seconds)


def observe_verifier_idle(seconds: float) -> None:
    VERIFIER_IDLE_SECONDS.observe(seconds)


def observe_verifier_step_idle(seconds: float) -> None:
    VERIFIER_STEP_IDLE_SECONDS.observe(seconds)


def observe_verifier_gap(phase: str, seconds: float) -> None:
    _child(VERIFIER_GAP_SECONDS, phase).observe(seconds)


def count_error(code_name: str) -> None:
    ERRORS.labels(code=code_name).inc()
