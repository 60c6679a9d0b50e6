"""The serve commands: one service per process, built from its parsed flags (the composition
root of each service). Service modules and torch are imported inside each command: only the
one it starts is loaded."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from specsplit.cli_flags import (
    DRAFTER_KV_MEMORY_FRACTION,
    IDLE_POLL_MS_ON_GPU,
    adaptive_rungs,
    decode_ahead,
    default_spec,
    graph_query_lens,
)
from specsplit.cli_server_flags import request_limits, tls_files

log = logging.getLogger(__name__)


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from specsplit.model.embedded import embedded_default_model_path

    return embedded_default_model_path()


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX512-BF16; elsewhere it is
    emulated, slower than float32). `--dtype auto` still takes float32 on a CPU, and says so:
    the embedded default through `specsplit up` on the 2-core VM (8 bundled prompts) ran 39.9
    tok/s in bfloat16 against 35.9 in float32 (float32's fixed-order kernel,
    specsplit/model/cpu_gemm.c; 34.4 against 18.6 with the weight-major route before it), but
    only 4 of 8 streams kept target-only decoding's tokens (8 of 8 in float32): a 4-row verify
    and a 1-row step tip bf16 near-ties differently, as on a GPU (bench/RESULTS.md)."""
    import torch

    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


def idle_poll_ms(given: float | None, device: str) -> float:
    """--idle-poll-ms for a service on `device`: as given, else IDLE_POLL_MS_ON_GPU on a GPU
    (a loop asleep between rounds wakes ~0.1 ms late for the next request) and 0 on the CPU,
    where a polling loop takes a core from the engine."""
    if given is not None:
        return given
    return IDLE_POLL_MS_ON_GPU if device.startswith("cuda") else 0.0


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """device, dtype ("auto" resolved), num_pages, page_size, grace, tls, engine_calls,
    idle_poll_s and cpu_cores of a serve command."""
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    sizes = {"num_pages": args.num_pages, "page_size": args.page_size}
    return {
        "device": device,
        "dtype": dtype,
        **sizes,
        "grace": args.grace,
        "tls": tls_files(args),
        "engine_calls": args.engine_calls,
        "cpu_cores": args.cpu_cores,
        "idle_poll_s": idle_poll_ms(args.idle_poll_ms, device) / 1e3,  # (0: LoopPoll never polls)
    }


def serve_drafter(args: argparse.Namespace) -> int:
    from drafter.main import serve

    model_path = args.draft_model if args.drafter in ("model", "eagle3") else None
    if args.drafter == "self":  # the target's first layers
        model_path = _model_path(args)
    target_path = _model_path(args) if args.drafter == "eagle3" else None  # its embeddings
    kwargs = _engine_kwargs(args)
    asyncio.run(
        serve(
            args.listen,
            args.drafter,
            model_path,
            draft_layers=args.draft_layers,
            target_path=target_path,
            graph_catch_up_lens=graph_query_lens(args, "draft_cuda_graphs"),
            graph_max_batch=args.graph_max_batch,
            kv_memory_fraction=(
                DRAFTER_KV_MEMORY_FRACTION
                if args.draft_kv_memory_fraction is None
                else args.draft_kv_memory_fraction
            ),
            **kwargs,
        )
    )
    return 0


def serve_verifier(args: argparse.Namespace) -> int:
    from verifier.main import serve

    kwargs = _engine_kwargs(args)
    if args.dtype == "auto" and kwargs["dtype"] == "float32" and cpu_has_bf16():
        log.info(
            "this CPU multiplies bfloat16 natively: --dtype bfloat16 may run ~10% faster, but "
            "greedy output may then part from target-only decoding at bf16 near-ties (float32, the "
            "default on a CPU, keeps it token for token)"
        )
    graphs = {
        "graph_query_lens": graph_query_lens(args),
        "graph_max_batch": args.graph_max_batch,
        "kv_memory_fraction": args.kv_memory_fraction,
        "kv_dtype": None if args.kv_dtype == "auto" else args.kv_dtype,
        "decode_ahead": decode_ahead(args, kwargs["device"]),
        "decode_ahead_max_batch": args.decode_ahead_max_batch,
        "decode_ahead_depth": args.decode_ahead_depth,
        "chain_rounds": args.chain_rounds,
        "chain_max_batch": args.chain_max_batch,
        "chain_min_guess_rate": args.chain_min_guess_rate,
        "synthetic_acceptance": args.synthetic_acceptance,
        "lookup_min_ngram": args.lookup_min_ngram,
    }
    asyncio.run(serve(args.listen, _model_path(args), **kwargs, **graphs))
    return 0


def serve_gateway(args: argparse.Namespace) -> int:
    from gateway.auth import ApiKeys
    from gateway.main import serve

    backends = {"drafter_address": args.drafter_address, "verifier_address": args.verifier_address}
    limits = {"max_batch_size": args.max_batch_size, "grace": args.grace}
    adaptive = {"adaptive_spec": args.adaptive_spec, "adaptive_rungs": adaptive_rungs(args)}
    http = {"http_listen": args.http_listen, "served_model_name": args.served_model_name}
    keys = ApiKeys(args.api_key, args.max_concurrent_per_key)
    model_path = _model_path(args)
    asyncio.run(
        serve(
            args.listen,
            model_path,
            **backends,
            default_spec=default_spec(args),
            **adaptive,
            **limits,
            **http,
            api_keys=keys,
            tls=tls_files(args),
            backend_tls=tls_files(args, "backend_tls"),
            limits=request_limits(args),
            max_waiting=args.max_waiting,
            session_ttl_s=args.session_ttl,
            verifier_wait_s=args.verifier_wait,
            overlap="serial" if args.overlap == "auto" else args.overlap,
            ahead_guesses=args.ahead_guesses,
            ahead_miss=args.ahead_miss,
            verify_ahead=args.verify_ahead == "on",
            ahead_max_batch=args.ahead_max_batch,
            round_lane=args.round_lane == "on",
            lane_poll_s=(args.round_lane_poll_ms or 0.0) / 1e3,
            decode_steps=args.decode_steps or 1,
            adaptive_decode_steps=bool(args.decode_steps_adaptive),
            decode_steps_quiet_s=args.decode_steps_quiet_ms / 1e3,
            decode_lookup=args.decode_lookup or 0,
            decode_lookup_max_batch=args.decode_lookup_max_batch,
            prefill_chunk=args.prefill_chunk or 0,
            prefill_rounds_one_step=args.prefill_rounds_one_step,
            early_verify=bool(args.early_verify),  # auto: off (the devices are not seen here)
            speculation_gate=args.speculation_gate == "on",
            cpu_cores=args.cpu_cores,
        )
    )
    return 0


def quiet_progress_bars() -> None:
    """No tqdm bars in a service (transformers draws one converting a GGUF file): the services
    of `specsplit up` share a terminal, where their bars overwrite each other on one line; the
    engine logs its loading progress instead. Before anything imports tqdm (it reads its
    TQDM_* environment once); TQDM_DISABLE=0 keeps them."""
    os.environ.setdefault("TQDM_DISABLE", "1")


def start_observability(service: str, metrics_listen: str | None) -> None:
    """Prometheus /metrics (unless "none") and OpenTelemetry tracing (when OTEL_* ask for it)."""
    from specsplit import metrics, telemetry

    metrics.serve(metrics_listen)
    telemetry.init(service)
