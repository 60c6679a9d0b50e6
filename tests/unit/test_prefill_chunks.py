"""--prefill-chunk (gateway/sequence.py, Sequence.prefilling): a run of tokens the verifier lacks
longer than the chunk (a long prompt, a sequence it takes again after a restart) goes to it a
chunk a round, with no tree and nothing kept of what the verifier draws past it, beside the other
sequences' rounds, until the rest fits one round. The output is the target's own (greedy: the
same tokens; a seeded sampler the same tokens too, since chunk rounds draw nothing), in every
overlap mode and through a verifier restart; a stream decoding beside a long prompt gets its
tokens between the chunks; a request cancelled mid-prefill leaves no KV."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.stack import LocalStack
from specsplit import cli, up
from specsplit.cli_flags import PREFILL_CHUNK_ON_CPU
from specsplit.messages import DraftInput, SpecParams, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.eagle_random import save_target_and_drafters
from tests.support import (
    RestartingVerifier,
    check_no_leaks,
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    record_verifies,
    save_tiny_llama,
    second_mid_stream,
    target_only_ids,
)

CHUNK = 4
MAX_NEW_TOKENS = 12
TARGET_ONLY = SpecParams(0, 1, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefill_chunks")
    return {
        "target": save_tiny_llama(root / "target", seed=21),
        "draft": save_tiny_llama(root / "draft", seed=22, num_layers=1),
    }


def _requests(count: int, seed: int, **kwargs: Any) -> list[GenerationRequest]:
    """Prompts of 6-16 tokens: most longer than a chunk."""
    return mixed_requests(count, seed, MAX_NEW_TOKENS, **kwargs)


def _stack(
    models: dict[str, Path],
    tokenizer: Any,
    drafter: str,
    spec: SpecParams,
    overlap: str = "serial",
    page_size: int = 16,
) -> LocalStack:
    stack = make_stack(
        models["target"],
        drafter,
        tokenizer,
        spec,
        draft_dir=models["draft"] if drafter == "model" else None,
        page_size=page_size,
        overlap=overlap,
    )
    stack.scheduler.prefill_chunk = CHUNK
    return stack


def _items(rounds: list[list[VerifyInput]]) -> list[VerifyInput]:
    return [item for r in rounds for item in r]


@pytest.mark.parametrize(
    ("drafter", "spec", "overlap", "page_size"),
    [
        ("ngram", SpecParams(2, 1, 2), "serial", 16),
        ("model", SpecParams(3, 1, 3), "serial", 1),
        ("model", SpecParams(3, 2, 6), "groups", 16),
        ("model", SpecParams(3, 1, 3), "both", 16),
    ],
)
def test_chunked_prompts_give_the_targets_tokens(
    models: dict[str, Path],
    smollm2_tokenizer: Any,
    drafter: str,
    spec: SpecParams,
    overlap: str,
    page_size: int,
) -> None:
    """Every round brings at most a chunk of pending tokens (decoding rounds one), the chunk
    rounds no tree; the streams are the target alone's; no KV is left."""
    requests = _requests(5, seed=3)
    assert sum(len(r.prompt_ids) > 2 * CHUNK for r in requests) >= 3
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    stack = _stack(models, smollm2_tokenizer, drafter, spec, overlap, page_size)
    rounds = record_verifies(stack.scheduler)
    out = generate_all(stack, _requests(5, seed=3))
    assert [generated_ids(c) for c in out] == expected
    items = _items(rounds)
    assert all(len(item.pending_tokens) <= CHUNK for item in items)
    chunks = [i for i in items if len(i.pending_tokens) == CHUNK and not i.tree]
    # a prompt of n tokens: (n - 1) // CHUNK chunk rounds before the one that draws its first
    want = sum((len(r.prompt_ids) - 1) // CHUNK for r in requests)
    assert len(chunks) >= want
    assert sum(item.begin for item in items) == len(requests)


def test_a_seeded_sampler_draws_the_same_tokens_chunked(
    models: dict[str, Path], smollm2_tokenizer: Any
) -> None:
    """Chunk rounds are greedy: the verifier's sampler draws nothing for them, so a seeded
    request's tokens are those of the same request prefilled in one round."""
    sampling = [SamplingParams(temperature=0.9, seed=100 + i) for i in range(4)]

    def requests() -> list[GenerationRequest]:
        reqs = _requests(4, seed=5, spec=TARGET_ONLY)
        for request, params in zip(reqs, sampling, strict=True):
            request.sampling = params
        return reqs

    whole = make_stack(models["target"], "ngram", smollm2_tokenizer, TARGET_ONLY)
    want = [generated_ids(c) for c in generate_all(whole, requests())]
    chunked = _stack(models, smollm2_tokenizer, "ngram", TARGET_ONLY)
    rounds = record_verifies(chunked.scheduler)
    got = [generated_ids(c) for c in generate_all(chunked, requests())]
    assert got == want
    assert any(len(i.pending_tokens) == CHUNK and i.begin for i in _items(rounds))


def test_a_stream_decodes_between_a_long_prompts_chunks(
    models: dict[str, Path], smollm2_tokenizer: Any
) -> None:
    """B (a 41-token prompt: ten chunk rounds) arrives while A decodes: A's sequence is in every
    round that carries one of B's chunks, and both streams are the target alone's."""
    (first,) = _requests(1, seed=9, spec=TARGET_ONLY)
    first.max_new_tokens = 40
    second = GenerationRequest(list(range(3, 44)), 8, ignore_eos=True, spec=TARGET_ONLY)
    expected = target_only_ids(models["target"], smollm2_tokenizer, [first, second])
    stack = _stack(models, smollm2_tokenizer, "ngram", TARGET_ONLY)
    scheduler = stack.scheduler
    rounds = record_verifies(scheduler)
    assert second_mid_stream(scheduler, first, second) == expected
    check_no_leaks(stack)
    b_prompt = second.prompt_ids
    b_rounds = [
        r for r in rounds if any(i.pending_tokens and i.pending_tokens[0] in b_prompt for i in r)
    ]
    chunk_rounds = [
        r for r in b_rounds if any(len(i.pending_tokens) == CHUNK and not i.tree for i in r)
    ]
    assert len(chunk_rounds) == (len(b_prompt) - 1) // CHUNK
    assert all(len(r) == 2 for r in chunk_rounds)  # A's decode step beside each chunk


def test_a_request_cancelled_mid_prefill_leaves_no_kv(
    models: dict[str, Path], smollm2_tokenizer: Any
) -> None:
    """B's stream is cancelled after two of its chunk rounds: its KV goes, A's stream is the
    target alone's."""
    (first,) = _requests(1, seed=13, spec=TARGET_ONLY)
    first.max_new_tokens = 30
    second = GenerationRequest(list(range(3, 60)), 8, ignore_eos=True, spec=TARGET_ONLY)
    (expected,) = target_only_ids(models["target"], smollm2_tokenizer, [first])
    stack = _stack(models, smollm2_tokenizer, "ngram", TARGET_ONLY)
    scheduler = stack.scheduler
    rounds = record_verifies(scheduler)

    def b_chunks() -> int:
        starts = [[3 + CHUNK * k] for k in range(14)]
        return sum(i.pending_tokens[:1] in starts for i in _items(rounds))

    async def main() -> list[int]:
        await scheduler.start()
        try:
            stream_a = scheduler.generate(first)
            chunks_a = [await anext(stream_a)]
            stream_b = scheduler.generate(second)
            waiting_b = asyncio.ensure_future(anext(stream_b))
            async with asyncio.timeout(60):
                while b_chunks() < 2:
                    await asyncio.sleep(0.001)
            assert not waiting_b.done()  # B is still in its prefill
            waiting_b.cancel()
            chunks_a += [chunk async for chunk in stream_a]
            async with asyncio.timeout(60):
                while scheduler.running or scheduler.waiting:
                    await asyncio.sleep(0.01)
            return generated_ids(chunks_a)
        finally:
            await scheduler.stop()

    assert asyncio.run(main()) == expected
    check_no_leaks(stack)


@pytest.mark.parametrize("fail_at", [2, 4])
def test_a_verifier_restart_mid_prefill_takes_the_tokens_again_in_chunks(
    models: dict[str, Path], smollm2_tokenizer: Any, fail_at: int
) -> None:
    requests = _requests(4, seed=17)
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    stack = _stack(models, smollm2_tokenizer, "model", SpecParams(3, 1, 3))
    restarting = RestartingVerifier.installed(stack, fail_at)
    rounds = record_verifies(stack.scheduler)
    out = generate_all(stack, _requests(4, seed=17))
    assert [generated_ids(c) for c in out] == expected
    assert restarting.calls > fail_at
    assert all(len(item.pending_tokens) <= CHUNK for item in _items(rounds))


def test_a_request_asking_for_its_prompts_logprobs_is_not_chunked(
    smollm2_tokenizer: Any,
) -> None:
    """Its first round reads every prompt row: it goes whole."""
    scheduler = Scheduler(
        None, None, smollm2_tokenizer, (), TARGET_ONLY,  # type: ignore[arg-type]
        prefill_chunk=CHUNK,
    )  # fmt: skip
    plain = scheduler._new_sequence(GenerationRequest(list(range(3, 20)), 4))
    asking = scheduler._new_sequence(GenerationRequest(list(range(3, 20)), 4, prompt_logprobs=1))
    inputs = scheduler._verify_inputs([plain, asking], [DraftTree(), DraftTree()])
    assert [len(item.pending_tokens) for item in inputs] == [CHUNK, 17]
    assert plain.prefilling and not asking.prefilling


def test_chunk_rounds_keep_the_others_steps_and_the_last_asks_one(smollm2_tokenizer: Any) -> None:
    """--prefill-rounds-one-step: a chunk round draws no token, so the sequences beside it keep
    their decode steps; the round that ends the prefill (draws its first token) asks one."""
    scheduler = Scheduler(
        None, None, smollm2_tokenizer, (), TARGET_ONLY,  # type: ignore[arg-type]
        decode_steps=4, prefill_chunk=CHUNK,
    )  # fmt: skip
    running = scheduler._new_sequence(GenerationRequest([5, 6, 7], 32))
    running.verifier_begun = True  # decoding: its prompt is in the verifier's KV
    long = scheduler._new_sequence(GenerationRequest(list(range(3, 13)), 32))  # 10 tokens
    for committed in (0, CHUNK):  # two chunk rounds
        inputs = scheduler._verify_inputs([running, long], [DraftTree(), DraftTree()])
        assert [item.decode_steps for item in inputs] == [4, 1]
        assert inputs[1].pending_tokens == long.tokens[committed : committed + CHUNK]
        long.commit_chunk(VerifyOutput(long.seq_id, [], 99, committed + CHUNK))
        assert long.tokens == list(range(3, 13))  # the drawn token dropped
    inputs = scheduler._verify_inputs([running, long], [DraftTree(), DraftTree()])
    assert [item.decode_steps for item in inputs] == [1, 1]
    assert inputs[1].pending_tokens == long.tokens[2 * CHUNK :] and not long.prefilling


@pytest.fixture(scope="module")
def eagle_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("prefill_chunks_eagle"))


def test_an_eagle_heads_features_come_chunk_by_chunk(
    eagle_models: dict[str, Path], smollm2_tokenizer: Any
) -> None:
    """Chunk rounds ask for the target's features of their tokens: the drafter gets the rows of
    the chunks with its first Draft (the tree of the round that ends the prefill), then each
    row once; the streams are the target alone's."""
    requests = _requests(3, seed=23)
    expected = target_only_ids(eagle_models["target"], smollm2_tokenizer, requests)
    stack = make_stack(
        eagle_models["target"], "eagle3", smollm2_tokenizer, SpecParams(3, 1, 3),
        draft_dir=eagle_models["eagle3"], dtype=torch.float32,
    )  # fmt: skip
    stack.scheduler.prefill_chunk = CHUNK
    rounds = record_verifies(stack.scheduler)
    rows: dict[str, list[tuple[int, int]]] = {}  # per sequence: (start, rows) of each Draft
    draft: Any = stack.scheduler.drafter.draft

    async def recorded(inputs: list[DraftInput]) -> Any:
        for item in inputs:
            sent = item.target_hidden_states
            if sent is not None and sent.shape[0]:
                rows.setdefault(item.seq_id, []).append((item.start, sent.shape[0]))
        return await draft(inputs)

    stack.scheduler.drafter.draft = recorded  # type: ignore[method-assign]
    out = generate_all(stack, _requests(3, seed=23))
    assert [generated_ids(c) for c in out] == expected
    items = _items(rounds)
    assert all(len(item.pending_tokens) <= CHUNK for item in items)
    assert any(item.hidden_state_layers and len(item.pending_tokens) == CHUNK for item in items)
    for sent in rows.values():  # each Draft's rows start where the last one's ended
        assert [start for start, _ in sent] == [0, *itertools.accumulate(n for _, n in sent[:-1])]
    # the first Draft (the tree of the round that ends the prefill) has the chunks' rows
    prompts = sorted(len(r.prompt_ids) for r in requests)
    assert sorted(sent[0][1] for sent in rows.values()) == [
        (n - 1) // CHUNK * CHUNK for n in prompts
    ]


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], PREFILL_CHUNK_ON_CPU),
        (["--device", "cuda:0"], 0),
        (["--prefill-chunk", "64"], 64),
        (["--prefill-chunk", "0"], 0),
    ],
)
def test_up_passes_the_chunk_to_the_gateway(argv: list[str], want: int) -> None:
    gateway = up.child_commands(cli.parse_args(["up", *argv]))["gateway"]
    assert cli.parse_args(gateway[3:]).prefill_chunk == want
