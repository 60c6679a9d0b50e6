"""Does a CUDA graph's launch delay its execution? A SmolLM2-shaped decode step (random bf16,
batch 1, 512-token context) replayed as one graph, and as k graphs over consecutive layer ranges
launched one after another (the GPU can start the first while the host launches the next).

    PYTHONPATH=. python bench/graph_launch.py --chunks 1 2 3 5 10 --steps 200

Per k, medians over --steps: the host time of the k `replay()` calls, the wall time of the
launches + synchronize, and the GPU time between events recorded before and after. If the
launch held the GPU back, wall ~ launch + GPU; if not, wall ~ GPU. Also the engine's whole step
(`VerifierEngine.verify`, target-only and a 1 + 8 chain, with and without the EAGLE-3 layers'
hidden states) for reference, back to back and with --gap-ms between steps (the thread asleep or
spinning): a service's engine waits between rounds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.gpu_engine import SHAPES, EngineBench
from specsplit.model.batch import ForwardBatch
from specsplit.model.config import ModelConfig, default_aux_layers
from specsplit.model.linear import linear
from specsplit.model.llama import LlamaModel
from specsplit.model.rope import rope_cos_sin


def forward_layers(
    model: LlamaModel, batch: ForwardBatch, kv: Any, lo: int, hi: int, state: dict[str, Any]
) -> None:
    """LlamaModel.forward's layers [lo, hi), with the embedding before layer 0 and the final
    norm + LM head after the last; `state` carries the residual stream between ranges."""
    layers = list(model.layers)
    if lo == 0:
        hidden = model.embed_tokens(batch.input_ids)
        state["cos"], state["sin"] = rope_cos_sin(batch.positions, model.inv_freq, hidden.dtype)
        state["hidden"], state["normed"] = hidden, layers[0].input_layernorm(hidden)
    for index in range(lo, hi):
        next_norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else None
        state["hidden"], state["normed"] = layers[index](
            state["hidden"], state["normed"], state["cos"], state["sin"], batch, kv, next_norm
        )
    if hi == len(layers):
        last = model.norm(state["hidden"][batch.logit_indices])
        state["logits"] = linear(last, model.lm_head_weight).float()


def capture_chunks(
    model: LlamaModel, batch: ForwardBatch, kv: Any, k: int
) -> tuple[list[torch.cuda.CUDAGraph], dict[str, Any]]:
    num_layers = len(model.layers)
    bounds = [round(i * num_layers / k) for i in range(k + 1)]
    state: dict[str, Any] = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = []
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(stream):
        for _ in range(2):
            for lo, hi in itertools.pairwise(bounds):
                forward_layers(model, batch, kv, lo, hi, state)
        for lo, hi in itertools.pairwise(bounds):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                forward_layers(model, batch, kv, lo, hi, state)
            graphs.append(graph)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs, state


def time_replays(graphs: list[torch.cuda.CUDAGraph], steps: int) -> tuple[float, float, float]:
    """(launch host ms, launch + synchronize wall ms, GPU ms between events): medians."""
    launch, wall, gpu = [], [], []
    for i in range(steps + 10):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for graph in graphs:
            graph.replay()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 10:
            launch.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
            gpu.append(start.elapsed_time(end))
    return statistics.median(launch), statistics.median(wall), statistics.median(gpu)


def idle(gap: str, seconds: float) -> None:
    """Between two steps, as in a service waiting for its next request: nothing, the thread
    asleep, or the thread spinning (the CPU kept busy)."""
    if gap == "sleep":
        time.sleep(seconds)
    elif gap == "spin":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 3, 5, 10])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=1.0, help="idle time between steps")
    args = parser.parse_args()
    torch.manual_seed(0)
    hf_config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    bench_args = argparse.Namespace(
        batch=[1],
        verify_n=[8],
        context=512,
        steps=12 * args.steps,
        page_size=16,
        hidden_states=False,
    )
    bench = EngineBench(hf, ModelConfig.from_hf(hf_config), bench_args, graphs=True)
    del hf
    engine = bench.engine
    assert engine.graphs is not None
    state = bench.open(1)
    for hidden in (False, True):
        layers = default_aux_layers(engine.model.config.num_layers)
        bench.hidden_state_layers = layers if hidden else ()
        for n in (0, 8):
            for gap in ("none", "sleep", "spin"):
                times = []
                for i in range(args.steps + 10):
                    torch.cuda.synchronize()
                    idle(gap, args.gap_ms / 1e3)
                    t0 = time.perf_counter()
                    bench.step(state, n)
                    if i >= 10:
                        times.append((time.perf_counter() - t0) * 1e3)
                label = f"n {n}{' + hidden states' if hidden else ''}, gap {gap}"
                print(f"engine step, {label}: {statistics.median(times):.3f} ms", flush=True)
    bench.hidden_state_layers = ()
    bench.step(state, 0)  # the decode buffers now hold a real step's metadata
    with torch.inference_mode():
        batch = engine.graphs.buffers[(1, ())].batch(1, engine.kv.page_size)
        whole = engine.graphs.graphs[(1, (), 1)]
        launch, wall, gpu = time_replays([whole], args.steps)
        print(f"engine's graph: launch {launch:.3f} ms, wall {wall:.3f} ms, GPU {gpu:.3f} ms")
        for k in args.chunks:
            graphs, _ = capture_chunks(engine.model, batch, engine.kv, k)
            launch, wall, gpu = time_replays(graphs, args.steps)
            print(
                f"{k:2d} graphs: launch {launch:.3f} ms, wall {wall:.3f} ms, GPU {gpu:.3f} ms",
                flush=True,
            )
            del graphs
    bench.close(state)


if __name__ == "__main__":
    main()
