"""All three roles in one process over the real engines (tests, benchmarks, train-drafter's
held-out report): the one place the gateway's scheduler meets the torch engines directly."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from drafter.eagle import load_eagle3
from drafter.eagle_proposer import Eagle3Proposer
from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.ngram import NgramProposer
from gateway.request import Chunk, GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.clients import LocalDrafterClient, LocalVerifierClient
from specsplit.messages import SpecParams
from specsplit.model.config import ModelConfig
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from verifier.engine import VerifierEngine


@dataclass
class LocalStack:
    verifier: VerifierEngine
    drafter: DrafterEngine
    scheduler: Scheduler

    def generate_all(self, requests: list[GenerationRequest]) -> list[list[Chunk]]:
        """Run the requests concurrently; returns each one's chunks."""

        async def collect(request: GenerationRequest) -> list[Chunk]:
            return [chunk async for chunk in self.scheduler.generate(request)]

        async def run() -> list[list[Chunk]]:
            await self.scheduler.start()
            try:
                return list(await asyncio.gather(*(collect(r) for r in requests)))
            finally:
                await self.scheduler.stop()

        return asyncio.run(run())


def requests_for(prompts: list[list[int]], max_new_tokens: int) -> list[GenerationRequest]:
    """Requests for token-id prompts, greedy, the gateway's defaults otherwise."""
    return [GenerationRequest(prompt_ids, max_new_tokens) for prompt_ids in prompts]


def token_ids(chunks: list[Chunk]) -> list[int]:
    """The tokens a request's chunks streamed, in order."""
    return [t for chunk in chunks for t in chunk.token_ids]


def accepted_tokens_per_round(results: list[list[Chunk]]) -> float:
    """Accepted tokens (drafts + bonus) per round over all requests' final stats."""
    stats = [chunks[-1].stats for chunks in results if chunks[-1].stats]
    rounds = sum(s.rounds for s in stats)
    return sum(s.num_accepted_tokens for s in stats) / rounds if rounds else float("nan")


def build_local_stack(
    target_path: str,
    drafter: str,
    tokenizer: PreTrainedTokenizerBase,
    spec: SpecParams,
    *,
    draft_path: str | None = None,
    draft_layers: int | None = None,
    page_size: int = 16,
    num_pages: int = 1024,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    check_integrity: bool = False,
    target: tuple[LlamaModel, ModelConfig] | None = None,
    adaptive_spec: bool = False,
    adaptive_rungs: tuple[SpecParams, ...] | None = None,
    graph_query_lens: tuple[int, ...] = (),
    draft_graph_lens: tuple[int, ...] = (),
    overlap: str = "serial",
    decode_ahead: bool = False,
    decode_steps: int = 1,
    early_verify: bool = False,
    decode_lookup: int = 0,
    decode_lookup_max_batch: int = 64,
) -> LocalStack:
    """drafter: "model" (draft_path, default the target itself), "self" (the target's first
    draft_layers layers, sharing its weights), "eagle3" (draft_path = the head; the scheduler
    asks the verifier for the head's hidden_state_layers) or "ngram". `target` reuses a loaded
    model. adaptive_spec / adaptive_rungs: adaptive speculation (gateway/adaptive.py), `spec` the
    rung sequences start on. graph_query_lens / draft_graph_lens: the verifier's and the
    drafter's CUDA graphs (on a GPU; VerifierEngine, DrafterEngine). overlap: the scheduler's
    ("serial", "groups", "gated", "ahead" or "both"). decode_ahead: the verifier's (VerifierEngine).
    decode_steps: tokens a plain round decodes, decode_lookup: the prompt-lookup chains its
    further steps verify, in rounds of at most decode_lookup_max_batch sequences (the
    scheduler's), early_verify: groups send the other group's
    Verify while one is in flight (the scheduler's)."""
    model, config = (
        target if target is not None else load_model(target_path, dtype=dtype, device=device)
    )
    verifier = VerifierEngine(
        model,
        make_kv_cache(config, num_pages, page_size, dtype, device),
        config.max_position_embeddings,
        config.vocab_size,
        graph_query_lens=graph_query_lens,
        decode_ahead=decode_ahead,
    )
    if graph_query_lens:
        verifier.warmup()  # captures the CUDA graphs on a GPU
    proposer: ModelProposer | NgramProposer | Eagle3Proposer
    if drafter == "ngram":
        proposer = NgramProposer(
            vocab_size=config.vocab_size, max_context=config.max_position_embeddings
        )
    elif drafter == "eagle3":
        assert draft_path, "drafter 'eagle3' needs draft_path (the head)"
        head = load_eagle3(draft_path, target_path, dtype, device, target=model)
        proposer = Eagle3Proposer(head, head.make_kv_cache(num_pages, page_size))
    else:
        if drafter == "self":
            assert draft_layers, "drafter 'self' needs draft_layers"
            d_model = model.truncated(draft_layers)
            d_config = d_model.config
        else:
            d_model, d_config = load_model(draft_path or target_path, dtype=dtype, device=device)
        kv = make_kv_cache(d_config, num_pages, page_size, dtype, device)
        proposer = ModelProposer(d_model, kv, d_config.vocab_size, d_config.max_position_embeddings)
    drafter_engine = DrafterEngine(proposer, graph_catch_up_lens=draft_graph_lens)
    if draft_graph_lens:
        drafter_engine.warmup()  # captures the CUDA graphs on a GPU
    # on a GPU both engines' calls take turns on one thread: a CUDA graph one of them captures
    # on first use (global capture mode) must not meet the other's synchronising calls, and
    # two threads on one device would only contend (overlap needs two GPUs: the services)
    shared = ThreadPoolExecutor(1, thread_name_prefix="engines") if device != "cpu" else None
    scheduler = Scheduler(
        LocalDrafterClient(drafter_engine, check_integrity=check_integrity, executor=shared),
        LocalVerifierClient(verifier, check_integrity=check_integrity, executor=shared),
        tokenizer,
        eos_token_ids=config.eos_token_ids,
        default_spec=spec,
        hidden_state_layers=drafter_engine.hidden_state_layers,
        adaptive_spec=adaptive_spec,
        adaptive_rungs=adaptive_rungs,
        overlap=overlap,
        max_context=config.max_position_embeddings,
        decode_steps=decode_steps,
        early_verify=early_verify,
        decode_lookup=decode_lookup,
        decode_lookup_max_batch=decode_lookup_max_batch,
    )
    return LocalStack(verifier, drafter_engine, scheduler)
