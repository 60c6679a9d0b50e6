"""Entry point of the drafter service (`specsplit serve-drafter`)."""

from __future__ import annotations

from functools import partial
from typing import Any

from drafter.engine import DrafterEngine
from drafter.servicer import DrafterServicer
from specsplit.engine_servicer import calls_on_loop
from specsplit.server import serve as serve_host
from specsplit.tls import TLSFiles
from specsplit.wire_tensors import torch_dtype


async def serve(
    address: str,
    kind: str,
    model_path: str | None,
    *,
    draft_layers: int | None = None,
    target_path: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    num_pages: int | None = None,
    page_size: int = 16,
    graph_catch_up_lens: tuple[int, ...] = (),
    graph_max_batch: int = 64,
    kv_memory_fraction: float = 0.8,
    grace: float = 5.0,
    tls: TLSFiles | None = None,
    engine_calls: str = "auto",
    idle_poll_s: float = 0.0,
    cpu_cores: frozenset[int] | None = None,
) -> None:
    """Listen on `address`, load the drafter (kind "model", "self", "ngram" or "eagle3") off
    the event loop, SERVING once warm; return after SIGTERM / SIGINT and a graceful stop.
    tls: mutual TLS (specsplit.tls), None = plaintext. graph_catch_up_lens: the draft steps'
    CUDA graphs (DrafterEngine; on a GPU), for batches up to graph_max_batch. num_pages None:
    the KV pool takes `kv_memory_fraction` of the GPU's free memory (2048 pages on the CPU).
    engine_calls:
    --engine-calls (specsplit.engine_servicer.calls_on_loop). idle_poll_s: --idle-poll-ms
    (specsplit.lane.LoopPoll). cpu_cores: --cpu-cores."""
    sizes: dict[str, Any] = {"page_size": page_size, "kv_memory_fraction": kv_memory_fraction}
    if num_pages is not None:
        sizes["num_pages"] = num_pages
    load = partial(
        DrafterEngine.load,
        kind,
        model_path,
        draft_layers=draft_layers,
        target_path=target_path,
        device=device,
        dtype=torch_dtype(dtype),
        graph_catch_up_lens=graph_catch_up_lens,
        max_batch_size=graph_max_batch,
        **sizes,
    )
    on_loop = calls_on_loop(engine_calls, device)
    servicer = DrafterServicer(load, calls_on_loop=on_loop, idle_poll_s=idle_poll_s)
    await serve_host(servicer, address, grace=grace, tls=tls, cpu_cores=cpu_cores)
