"""Entry point of the verifier service (`specsplit serve-verifier`)."""

from __future__ import annotations

from functools import partial

from specsplit import metrics
from specsplit.cli_flags import CHAIN_MAX_BATCH, CHAIN_MIN_GUESS_RATE, DECODE_AHEAD_DEPTH
from specsplit.engine_servicer import calls_on_loop
from specsplit.lookup import LOOKUP_MIN_NGRAM
from specsplit.server import serve as serve_host
from specsplit.tls import TLSFiles
from specsplit.wire_tensors import torch_dtype
from verifier.ahead_depth import AheadDepth
from verifier.engine import VerifierEngine
from verifier.servicer import VerifierServicer
from verifier.warmup import GRAPH_QUERY_LENS


async def serve(
    address: str,
    model_path: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    num_pages: int | None = None,
    page_size: int = 16,
    grace: float = 5.0,
    tls: TLSFiles | None = None,
    engine_calls: str = "auto",
    idle_poll_s: float = 0.0,
    graph_query_lens: tuple[int, ...] = GRAPH_QUERY_LENS,
    graph_max_batch: int = 64,
    kv_memory_fraction: float = 0.8,
    kv_dtype: str | None = None,
    decode_ahead: bool = False,
    decode_ahead_max_batch: int = 64,
    decode_ahead_depth: int = DECODE_AHEAD_DEPTH,
    chain_rounds: str = "off",
    chain_max_batch: int = CHAIN_MAX_BATCH,
    chain_min_guess_rate: float = CHAIN_MIN_GUESS_RATE,
    synthetic_acceptance: tuple[float, ...] | None = None,
    lookup_min_ngram: int = LOOKUP_MIN_NGRAM,
    cpu_cores: frozenset[int] | None = None,
) -> None:
    """Listen on `address`, load the target model off the event loop, SERVING once warm;
    return after SIGTERM / SIGINT and a graceful stop. tls: mutual TLS (specsplit.tls), None =
    plaintext. graph_query_lens, graph_max_batch (the engine's max_batch_size: its graphs'
    largest batch), kv_memory_fraction, kv_dtype (a torch dtype's name, None: the model's),
    decode_ahead, decode_ahead_max_batch,
    decode_ahead_depth (verifier/ahead_depth.py, 0 = auto), lookup_min_ngram,
    synthetic_acceptance (benchmarks only, not lossless): VerifierEngine.load's. engine_calls:
    --engine-calls (specsplit.engine_servicer.calls_on_loop); idle_poll_s: --idle-poll-ms
    (specsplit.lane.LoopPoll). chain_rounds ("auto", "on", "off"), chain_max_batch,
    chain_min_guess_rate: --chain-rounds, --chain-max-batch, --chain-min-guess-rate
    (VerifierEngine's, chaining where the engine's calls run on the event loop). cpu_cores:
    --cpu-cores."""
    load_engine = partial(
        VerifierEngine.load,
        model_path,
        device=device,
        dtype=torch_dtype(dtype),
        num_pages=num_pages,
        page_size=page_size,
        kv_memory_fraction=kv_memory_fraction,
        kv_dtype=None if kv_dtype is None else torch_dtype(kv_dtype),
        graph_query_lens=graph_query_lens,
        max_batch_size=graph_max_batch,
        decode_ahead=decode_ahead,
        decode_ahead_max_batch=decode_ahead_max_batch,
        synthetic_acceptance=synthetic_acceptance,
        lookup_min_ngram=lookup_min_ngram,
    )

    on_loop = calls_on_loop(engine_calls, device)

    def load() -> VerifierEngine:
        engine = load_engine()
        engine.on_decode_ahead = metrics.count_decode_ahead
        engine.on_decode_ahead_dropped = metrics.count_decode_ahead_dropped
        engine.on_round_ahead = metrics.count_round_ahead
        engine.hints.on_not_ahead = metrics.count_round_not_ahead
        engine.on_wait = metrics.observe_verifier_wait
        engine.on_idle = metrics.observe_verifier_idle
        engine.on_step_idle = metrics.observe_verifier_step_idle
        engine.on_gap = metrics.observe_verifier_gap
        # a hint (on the loop) may launch a round only where the engine's calls run there too
        engine.launch_on_hint = on_loop
        engine.chain_rounds = chain_rounds != "off" and on_loop
        engine.chain_gate.auto = chain_rounds == "auto"
        engine.chain_max_batch = chain_max_batch
        engine.ahead_depth = AheadDepth(decode_ahead_depth)
        engine.chain_min_guess_rate = chain_min_guess_rate
        return engine

    servicer = VerifierServicer(load, calls_on_loop=on_loop, idle_poll_s=idle_poll_s)
    await serve_host(servicer, address, grace=grace, tls=tls, cpu_cores=cpu_cores)
