"""Test helpers: tiny random checkpoints and an in-process gateway over the real engines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.ngram import NgramProposer
from gateway.clients import LocalDrafterClient, LocalVerifierClient
from gateway.request import Chunk, GenerationRequest
from gateway.scheduler import Scheduler
from specsplit.messages import SpecParams
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from verifier.engine import VerifierEngine

TINY_VOCAB = 512


def save_tiny_llama(path: Path, seed: int, vocab_size: int = TINY_VOCAB, num_layers: int = 2,
                    hidden_size: int = 64, tokenizer: object | None = None) -> Path:
    """A random Llama checkpoint (GQA, untied) saved as safetensors; returns its directory."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    # random init is nearly uniform; sharpen it so greedy paths are unambiguous
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
    return path


@dataclass
class Stack:
    """Verifier + drafter engines and a scheduler, in this process."""

    verifier: VerifierEngine
    drafter: DrafterEngine
    scheduler: Scheduler

    def check_no_leaks(self) -> None:
        self.verifier.check_integrity()
        self.drafter.check_integrity()
        assert self.verifier.num_pages_used == 0, self.verifier.num_pages_used
        assert self.drafter.num_pages_used == 0, self.drafter.num_pages_used
        assert not self.verifier.seqs and not self.drafter.seqs


def make_stack(target_dir: Path, drafter: str, tokenizer: object, spec: SpecParams,
               draft_dir: Path | None = None, page_size: int = 16,
               dtype: torch.dtype = torch.float64, num_pages: int = 256) -> Stack:
    """drafter: "model" (draft_dir, or the target itself when None) or "ngram"."""
    model, config = load_model(str(target_dir), dtype=dtype, device="cpu")
    verifier = VerifierEngine(model, make_kv_cache(config, num_pages, page_size, dtype, "cpu"),
                              config.max_position_embeddings, config.vocab_size)
    if drafter == "ngram":
        proposer: ModelProposer | NgramProposer = NgramProposer()
    else:
        d_model, d_config = load_model(str(draft_dir or target_dir), dtype=dtype, device="cpu")
        proposer = ModelProposer(d_model, make_kv_cache(d_config, num_pages, page_size, dtype, "cpu"),
                                 d_config.vocab_size, d_config.max_position_embeddings)
    drafter_engine = DrafterEngine(proposer)
    scheduler = Scheduler(
        LocalDrafterClient(drafter_engine, check_integrity=True),
        LocalVerifierClient(verifier, check_integrity=True),
        tokenizer,
        eos_token_ids=config.eos_token_ids,
        default_spec=spec,
    )
    return Stack(verifier, drafter_engine, scheduler)


async def collect(scheduler: Scheduler, request: GenerationRequest) -> list[Chunk]:
    return [chunk async for chunk in scheduler.generate(request)]


def generate_all(stack: Stack, requests: list[GenerationRequest]) -> list[list[Chunk]]:
    """Run the requests concurrently through the stack's scheduler; checks no KV leaked."""

    async def run() -> list[list[Chunk]]:
        await stack.scheduler.start()
        try:
            return list(await asyncio.gather(*(collect(stack.scheduler, r) for r in requests)))
        finally:
            await stack.scheduler.stop()

    results = asyncio.run(run())
    stack.check_no_leaks()
    return results


def generated_ids(chunks: list[Chunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]
