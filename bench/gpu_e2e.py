"""The whole system in one process on one GPU with random weights: target + draft model through
the real scheduler, drafter engine and verifier engine, SYNTHETIC ACCEPTANCE (draft positions
accepted at the given rates: the output is not the target's; labelled in every line). Measures
tokens/s of speculative rounds vs target-only rounds through the same stack, serial and
pipelined-groups scheduling, at several batch sizes.

    PYTHONPATH=. python bench/gpu_e2e.py --target llama-8b --draft llama-1b --rates 0.8 0.7 0.6

What it leaves out: the RPCs of a real deployment (drafter and verifier share one process;
their engine calls run on two threads, as the in-process clients do). On one GPU they also share
it, so pipelined groups contend for it; `--device cuda:1 --drafter-device cuda:0` puts them on
two, as deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.gpu_engine import SHAPES
from bench.profile_step import EngineTime
from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.tree_draft import CATCH_UP_LENS
from gateway.request import Chunk, GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.clients import LocalDrafterClient, LocalVerifierClient
from inprocess.stack import token_ids
from specsplit.messages import SpecParams
from specsplit.model.config import ModelConfig
from specsplit.model.llama import LlamaModel, make_kv_cache, state_dict_from_hf
from verifier.engine import VerifierEngine

VOCAB = 49152  # SmolLM2's tokenizer detokenizes the stream (the only one that travels)


def random_model(shape: str, device: str, dtype: torch.dtype, seed: int) -> LlamaModel:
    torch.manual_seed(seed)
    sizes = SHAPES[shape] | {"vocab_size": VOCAB, "tie_word_embeddings": False}
    hf_config = LlamaConfig(**sizes, max_position_embeddings=8192, rms_norm_eps=1e-5)
    with torch.device(device):
        hf = LlamaForCausalLM(hf_config).to(dtype).eval()
    config = ModelConfig.from_hf(hf_config)
    model = LlamaModel.from_state_dict(
        config, state_dict_from_hf(config, hf.state_dict(), dtype, device), device
    )
    del hf
    return model


def run(scheduler: Scheduler, requests: list[GenerationRequest]) -> tuple[int, float, float]:
    """(tokens, seconds, accepted tokens per round) for the requests run concurrently."""

    async def collect(request: GenerationRequest) -> list[Chunk]:
        return [chunk async for chunk in scheduler.generate(request)]

    async def go() -> tuple[int, float, float]:
        await scheduler.start()
        try:
            start = time.perf_counter()
            outs = await asyncio.gather(*(collect(r) for r in requests))
            seconds = time.perf_counter() - start
        finally:
            await scheduler.stop()
        stats = [o[-1].stats for o in outs if o[-1].stats]
        rounds = sum(s.rounds for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats) / max(rounds, 1)
        return sum(len(token_ids(o)) for o in outs), seconds, accepted

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--draft", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.8, 0.7, 0.6])
    parser.add_argument("--spec", type=int, default=3, help="chain length")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tokenizer", default=".gpu/tokenizer")
    parser.add_argument("--device", default=None, help="the verifier's; default cuda (or cpu)")
    parser.add_argument("--drafter-device", default=None, help="default: --device")
    parser.add_argument("--eager-drafter", action="store_true", help="no drafter CUDA graphs")
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft_device = args.drafter_device or device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    target = random_model(args.target, device, dtype, seed=0)
    draft = random_model(args.draft, draft_device, dtype, seed=1)
    max_batch = max(args.batch)
    pages = max_batch * (-(-(args.prompt_len + args.max_new_tokens + 64) // 16)) + 64
    verifier = VerifierEngine(
        target,
        make_kv_cache(target.config, pages, 16, dtype, device),
        8192,
        VOCAB,
        graph_query_lens=(1, 1 + args.spec),
        max_batch_size=max_batch,
        synthetic_acceptance=tuple(args.rates),
    )
    verifier.warmup()
    proposer = ModelProposer(
        draft, make_kv_cache(draft.config, pages, 16, dtype, draft_device), VOCAB, 8192
    )
    drafter = DrafterEngine(
        proposer,
        graph_catch_up_lens=() if args.eager_drafter else CATCH_UP_LENS,
        max_batch_size=max_batch,
    )
    drafter.warmup()  # and its CUDA graphs
    label = f"SYNTHETIC acceptance {args.rates}"
    print(
        f"{args.target} target on {device}, {args.draft} draft on {draft_device}, {dtype}, "
        f"{label}, prompt {args.prompt_len}, {args.max_new_tokens} new tokens, chain "
        f"{args.spec}, drafter {'eager' if args.eager_drafter else 'CUDA graphs'}"
    )
    gen = torch.Generator().manual_seed(0)
    draft_time, verify_time = EngineTime(drafter, "draft"), EngineTime(verifier, "verify")
    assert verifier.graphs is not None
    parts = {  # where an engine call's time goes: graph replays, eager forwards, acceptance
        "verify graph": EngineTime(verifier.graphs, "forward"),
        "verify eager": EngineTime(verifier.model, "forward"),
        "accept": EngineTime(verifier, "_accept"),
        "draft eager": EngineTime(proposer.model, "forward"),
    }
    if proposer.graphs is not None:
        parts["draft graph"] = EngineTime(proposer.graphs, "forward")
    print(
        "| scheduling | spec | batch | tokens/s | accepted tokens/round | vs target-only "
        "| draft ms/call | verify ms/call |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        prompts = [
            torch.randint(3, VOCAB, (args.prompt_len,), generator=gen).tolist()
            for _ in range(batch)
        ]
        requests = [GenerationRequest(p, args.max_new_tokens, ignore_eos=True) for p in prompts]
        base = None
        for overlap, spec in (("serial", 0), ("serial", args.spec), ("groups", args.spec)):
            scheduler = Scheduler(
                LocalDrafterClient(drafter),
                LocalVerifierClient(verifier),
                tokenizer,
                eos_token_ids=(),
                default_spec=SpecParams(spec, 1, spec),
                max_batch_size=max_batch,
                overlap=overlap,
            )
            # warm-up: the same batch once (the eager prefill's compiled kernels for its shapes,
            # the allocator), then the timed run
            run(scheduler, requests)
            for timer in (draft_time, verify_time, *parts.values()):
                timer.reset()
            tokens, seconds, accepted = run(scheduler, requests)
            rate = tokens / seconds
            base = base or rate
            name = "target only" if spec == 0 else f"chain {spec}"
            print(
                f"| {overlap} | {name} | {batch} | {rate:.1f} | {accepted:.2f} | "
                f"{rate / base:.2f}x | {draft_time.ms_per_call:.2f} | "
                f"{verify_time.ms_per_call:.2f} |",
                flush=True,
            )
            details = ", ".join(
                f"{name} {t.calls} x {t.ms_per_call:.2f} ms" for name, t in parts.items()
            )
            print(f"|  | ({details}) | | | | | | |", flush=True)
        assert verifier.num_pages_used == 0 and drafter.num_pages_used == 0


if __name__ == "__main__":
    main()
