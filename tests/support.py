"""Test helpers: tiny random checkpoints and the in-process stack with leak checks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from gateway.clients import DrafterClient, VerifierClient
from gateway.health import Health
from gateway.request import Chunk, GenerationRequest
from gateway.scheduler import Scheduler
from gateway.servicer import GatewayServicer
from inprocess.stack import LocalStack, build_local_stack, token_ids
from specsplit.errors import Code, ServiceError
from specsplit.kv_cache import SeqKV
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    NextTrees,
    SpecParams,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)
from specsplit.sampling import SamplingParams
from specsplit.step import SeqStep
from specsplit.v1 import gateway_pb2_grpc

TINY_VOCAB = 512


def save_tiny_llama(
    path: Path,
    seed: int,
    vocab_size: int = TINY_VOCAB,
    num_layers: int = 2,
    hidden_size: int = 64,
    tokenizer: object | None = None,
) -> Path:
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


def make_stack(
    target_dir: Path,
    drafter: str,
    tokenizer: PreTrainedTokenizerBase,
    spec: SpecParams,
    draft_dir: Path | None = None,
    page_size: int = 16,
    dtype: torch.dtype = torch.float64,
    num_pages: int = 256,
    adaptive_rungs: tuple[SpecParams, ...] | None = None,
    adaptive_spec: bool = False,
    overlap: str = "serial",
    decode_ahead: bool = False,
    decode_steps: int = 1,
    early_verify: bool = False,
    decode_lookup: int = 0,
    decode_lookup_max_batch: int = 64,
) -> LocalStack:
    """drafter: "model" (draft_dir, or the target itself when None) or "ngram"; invariants are
    checked after every engine call. adaptive_*: adaptive speculation starting on `spec`.
    decode_ahead: the verifier's; decode_steps, early_verify, decode_lookup(_max_batch): the
    scheduler's (the tests' batches look up at any size)."""
    return build_local_stack(
        str(target_dir),
        drafter,
        tokenizer,
        spec,
        draft_path=str(draft_dir) if draft_dir else None,
        page_size=page_size,
        num_pages=num_pages,
        dtype=dtype,
        check_integrity=True,
        adaptive_spec=adaptive_spec,
        adaptive_rungs=adaptive_rungs,
        overlap=overlap,
        decode_ahead=decode_ahead,
        decode_steps=decode_steps,
        early_verify=early_verify,
        decode_lookup=decode_lookup,
        decode_lookup_max_batch=decode_lookup_max_batch,
    )


@contextlib.asynccontextmanager
async def gateway_stub(
    stack: LocalStack, servicer: GatewayServicer
) -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    """The gateway's real gRPC servicer on a loopback port over the stack's scheduler
    (started), and a stub to it; everything stopped and closed after."""
    server = grpc.aio.server()
    servicer.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await stack.scheduler.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel)
    finally:
        await stack.scheduler.stop()
        await server.stop(0)
        servicer.close()


def check_no_leaks(stack: LocalStack) -> None:
    stack.verifier.check_integrity()
    stack.drafter.check_integrity()
    assert stack.verifier.num_pages_used == 0, stack.verifier.num_pages_used
    assert stack.drafter.num_pages_used == 0, stack.drafter.num_pages_used
    assert not stack.verifier.seqs and not stack.drafter.seqs


def check_session_kv(stack: LocalStack, seq_id: str, tokens: list[int]) -> None:
    """Between turns (DESIGN.md §2, §7): the verifier holds the KV of every token of the session
    but the last (the pending bonus token) in exactly the pages that takes, the drafter a prefix
    of its tokens, and neither service holds anything but open sessions."""
    stack.verifier.check_integrity()
    stack.drafter.check_integrity()
    kv = stack.verifier.seqs[seq_id].kv
    assert kv.kv_committed_len == len(tokens) - 1, (kv.kv_committed_len, len(tokens))
    page_size = stack.verifier.kv.page_size
    assert len(kv.page_table) == -(-kv.kv_committed_len // page_size)
    sessions = {s.seq_id for s in stack.scheduler.sessions.sessions.values()}
    assert set(stack.verifier.seqs) <= sessions and set(stack.drafter.seqs) <= sessions
    if seq_id in stack.drafter.seqs:
        drafted = stack.drafter.seqs[seq_id].tokens
        assert drafted == tokens[: len(drafted)]


async def collect(scheduler: Scheduler, request: GenerationRequest) -> list[Chunk]:
    return [chunk async for chunk in scheduler.generate(request)]


class Conversation:
    """Turns on one session, each checked against a fresh request on the same stack."""

    def __init__(self, stack: LocalStack, sampling: SamplingParams) -> None:
        self.stack = stack
        self.scheduler = stack.scheduler
        self.sampling = sampling
        self.session = self.scheduler.sessions.open()
        self.tokens: list[int] = []  # the conversation as a fresh request carries it

    def request(
        self, prompt: list[int], max_new_tokens: int, **kwargs: object
    ) -> GenerationRequest:
        return GenerationRequest(prompt, max_new_tokens, self.sampling, **kwargs)  # type: ignore[arg-type]

    def turn_request(
        self, prompt: list[int], max_new_tokens: int, **kwargs: object
    ) -> GenerationRequest:
        """The session's next turn: `prompt` (token ids) after everything it holds."""
        request = self.request(prompt, max_new_tokens, **kwargs)
        request.session_id = self.session.session_id  # token ids: turn_prompt not needed
        return request

    async def fresh(self, prompt: list[int], max_new_tokens: int, **kwargs: object) -> list[Chunk]:
        return await collect(
            self.scheduler, self.request(self.tokens + prompt, max_new_tokens, **kwargs)
        )

    async def turn(self, prompt: list[int], max_new_tokens: int, **kwargs: object) -> list[Chunk]:
        """One turn, compared with a fresh request of the whole conversation run first."""
        expected = await self.fresh(prompt, max_new_tokens, **kwargs)
        held = len(self.tokens) - 1 if self.session.holds_kv else 0  # the pending bonus aside
        got = await collect(self.scheduler, self.turn_request(prompt, max_new_tokens, **kwargs))
        await self.session.ready.wait()  # the turn is put away: the services truncated
        assert generated_ids(got) == generated_ids(expected)
        assert got[-1].finish_reason == expected[-1].finish_reason
        assert got[-1].prompt_tokens == len(self.tokens) + len(prompt)
        assert got[-1].completion_tokens == expected[-1].completion_tokens
        # the session holds prompt + generated tokens, the stop token included
        self.tokens += prompt + generated_ids(got)
        assert self.session.tokens == self.tokens
        assert got[-1].stats is not None and got[-1].stats.num_reused_tokens == held
        check_session_kv(self.stack, self.session.seq_id, self.tokens)
        return got


def generate_all(stack: LocalStack, requests: list[GenerationRequest]) -> list[list[Chunk]]:
    """Run the requests concurrently through the stack; checks no KV leaked."""
    results = stack.generate_all(requests)
    check_no_leaks(stack)
    return results


def generated_ids(chunks: list[Chunk]) -> list[int]:
    return token_ids(chunks)


def record_verifies(scheduler: Scheduler) -> list[list[VerifyInput]]:
    """Every Verify's inputs from now on (the scheduler's verifier wrapped)."""
    rounds: list[list[VerifyInput]] = []
    verify: Any = scheduler.verifier.verify

    async def recorded(inputs: list[VerifyInput]) -> Any:
        rounds.append([*inputs])
        return await verify(inputs)

    scheduler.verifier.verify = recorded  # type: ignore[method-assign]
    return rounds


def second_mid_stream(
    scheduler: Scheduler, first: GenerationRequest, second: GenerationRequest
) -> list[list[int]]:
    """Request `second` sent once `first` has streamed a chunk (the scheduler started and
    stopped here): both streams' tokens."""

    async def collect(stream: Any) -> list[Chunk]:
        return [chunk async for chunk in stream]

    async def main() -> list[list[int]]:
        await scheduler.start()
        try:
            stream_a = scheduler.generate(first)
            chunks_a = [await anext(stream_a)]  # the first decodes
            chunks_b = asyncio.ensure_future(collect(scheduler.generate(second)))
            chunks_a += [chunk async for chunk in stream_a]
            return [generated_ids(chunks_a), generated_ids(await chunks_b)]
        finally:
            await scheduler.stop()

    return asyncio.run(main())


def mixed_requests(
    batch_size: int, seed: int, max_new_tokens: int, **kwargs: Any
) -> list[GenerationRequest]:
    """`batch_size` random prompts of mixed lengths (each ends by repeating its first three
    tokens, for prompt lookup), ignoring EOS."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, TINY_VOCAB, (3 + (5 * i) % 11,), generator=gen).tolist()
        for i in range(batch_size)
    ]
    return [
        GenerationRequest(p + p[:3], max_new_tokens, ignore_eos=True, **kwargs) for p in prompts
    ]


def target_only_ids(
    target_dir: Path, tokenizer: PreTrainedTokenizerBase, requests: list[GenerationRequest]
) -> list[list[int]]:
    """What the target alone generates for each request (speculation off)."""
    stack = make_stack(target_dir, "ngram", tokenizer, SpecParams(0, 1, 0))
    return [generated_ids(c) for c in generate_all(stack, requests)]


def dense_step(
    seq: SeqKV,
    input_ids: list[int],
    positions: list[int],
    storage: list[int],
    mask: torch.Tensor,  # [q, kv_len] bool over the whole attended storage
    logit_rows: list[int],
) -> SeqStep:
    """A step given by a dense mask (tests): everything is its new region, no fixed prefix."""
    return SeqStep(seq, input_ids, positions, storage, int(mask.shape[1]), 0, mask, logit_rows)


class PassThroughDrafter:
    """A drafter client that hands every call to `inner`; a double subclasses it and overrides
    what it changes (a timed or modelled Draft: TimedClients, bench/groups_model.py)."""

    def __init__(self, inner: DrafterClient) -> None:
        self.inner = inner

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        return await self.inner.truncate(items)


class PassThroughVerifier:
    """A verifier client that hands every call to `inner`; a test double subclasses it and
    overrides what it changes (a slow, failing, restarting or watched Verify)."""

    def __init__(self, inner: VerifierClient) -> None:
        self.inner = inner

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        return await self.inner.verify(inputs)

    async def hint(self, hints: list[NextTrees]) -> None:
        await self.inner.hint(hints)

    @property
    def last_engine_seconds(self) -> float:
        return self.inner.last_engine_seconds

    @property
    def last_device_seconds(self) -> float:
        return self.inner.last_device_seconds

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        return await self.inner.truncate(items)

    async def health(self) -> Health:
        return await self.inner.health()


class TimedClients:
    """Wraps the drafter and the verifier clients; records each call's (start, end) and the
    inputs of each. The Verify takes `verify_delay` seconds more, as on a GPU; each call
    `per_seq_delay` seconds more per sequence in it (a batch's cost that grows with it)."""

    def __init__(
        self,
        drafter: DrafterClient,
        verifier: VerifierClient,
        verify_delay: float = 0.01,
        per_seq_delay: float = 0.0,
    ) -> None:
        self.drafter, self.verifier = drafter, verifier
        self.verify_delay = verify_delay
        self.per_seq_delay = per_seq_delay
        self.drafts: list[tuple[float, float]] = []
        self.draft_inputs: list[list[DraftInput]] = []
        self.verifies: list[tuple[float, float]] = []
        self.verify_inputs: list[list[VerifyInput]] = []

    async def _timed(self, calls: list[tuple[float, float]], coro):
        start = time.perf_counter()
        try:
            return await coro
        finally:
            calls.append((start, time.perf_counter()))

    def drafter_client(self) -> DrafterClient:
        timed = self

        class Drafter(PassThroughDrafter):
            async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
                timed.draft_inputs.append(inputs)
                return await timed._timed(timed.drafts, self._slow(inputs))

            async def _slow(self, inputs: list[DraftInput]) -> list[DraftOutput]:
                if timed.per_seq_delay:
                    await asyncio.sleep(timed.per_seq_delay * len(inputs))
                return await self.inner.draft(inputs)

        return Drafter(timed.drafter)

    def verifier_client(self) -> VerifierClient:
        timed = self

        class Verifier(PassThroughVerifier):
            async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
                timed.verify_inputs.append(inputs)
                return await timed._timed(timed.verifies, self._slow(inputs))

            async def _slow(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
                # a verify that takes a while
                await asyncio.sleep(timed.verify_delay + timed.per_seq_delay * len(inputs))
                return await self.inner.verify(inputs)

        return Verifier(timed.verifier)

    def overlapping_drafts(self) -> int:
        return sum(any(v0 < d0 < v1 for v0, v1 in self.verifies) for d0, _ in self.drafts)

    def early_verifies(self) -> int:
        """Verifies sent while another was still in flight."""
        return sum(any(v0 < s < v1 for v0, v1 in self.verifies) for s, _ in self.verifies)


def cancel_half_mid_generation(stack: LocalStack, requests: list[GenerationRequest]) -> None:
    """Start every request, close every other stream after its first chunk (cancelled
    mid-generation), read the rest to the end and wait until the scheduler holds nothing."""
    scheduler = stack.scheduler

    async def run() -> None:
        await scheduler.start()
        try:
            streams = [scheduler.generate(r) for r in requests]
            firsts = await asyncio.gather(*(anext(s) for s in streams))
            assert all(first.token_ids for first in firsts)
            for stream in streams[::2]:
                await stream.aclose()
            async with asyncio.timeout(60):
                for stream in streams[1::2]:
                    async for _ in stream:
                        pass
                while scheduler.running or scheduler.waiting:
                    await asyncio.sleep(0.01)
        finally:
            await scheduler.stop()

    asyncio.run(run())


class RestartingVerifier(PassThroughVerifier):
    """The real verifier, which loses every sequence (a restart) before its `fail_at`-th Verify
    and answers that one UNAVAILABLE."""

    def __init__(self, inner: VerifierClient, engine: Any, fail_at: int) -> None:
        super().__init__(inner)
        self.engine, self.fail_at = engine, fail_at
        self.calls = 0

    @classmethod
    def installed(cls, stack: LocalStack, fail_at: int) -> RestartingVerifier:
        """One in place of the stack scheduler's verifier (its engine the stack's)."""
        restarting = cls(stack.scheduler.verifier, stack.verifier, fail_at)
        stack.scheduler.verifier = restarting
        return restarting

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        self.calls += 1
        if self.calls == self.fail_at:
            self.engine.release(list(self.engine.seqs))
            raise ServiceError(Code.UNAVAILABLE, "verifier restarted")
        return await self.inner.verify(inputs)


class BrokenDrafter:
    """Stands in for a drafter that fails every call with `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        self.calls += 1
        raise self.error

    async def release(self, seq_ids: list[str]) -> None:
        raise self.error

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        raise self.error


def stack_on(
    device: str,
    models: dict[str, Path],
    tokenizer: object,
    drafter: str,
    spec: SpecParams,
    graphs: bool,
    overlap: str = "serial",
) -> LocalStack:
    """A float32 stack on `device` over tests.eagle_random.save_target_and_drafters' models
    (`drafter` "model", "eagle3" or "ngram"), with both services' CUDA graphs when `graphs`;
    invariants checked after every engine call."""
    from drafter.tree_draft import CATCH_UP_LENS

    return build_local_stack(
        str(models["target"]),
        drafter,
        tokenizer,  # type: ignore[arg-type]
        spec,
        draft_path=str(models[drafter]) if drafter in models else None,
        dtype=torch.float32,
        device=device,
        check_integrity=True,
        graph_query_lens=(1, 1 + spec.num_draft_tokens) if graphs else (),
        draft_graph_lens=CATCH_UP_LENS if graphs else (),
        overlap=overlap,
    )
