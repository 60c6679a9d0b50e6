"""Adaptive speculation through the real engines: greedy output == target-only output while the
draft shape moves between chains and trees from round to round, the final spec stats count every
round, the drafter's KV ends empty, and requests with their own spec keep it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from gateway.adaptive import MIN_ROUNDS_PER_RUNG
from gateway.clients import DrafterClient
from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.stack import LocalStack
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from tests.support import TINY_VOCAB, generate_all, generated_ids, make_stack, save_tiny_llama

MAX_NEW_TOKENS = 40
CHAIN_1, CHAIN_2, TREE_2, TREE_3 = (
    SpecParams(1, 1, 1),
    SpecParams(2, 1, 2),
    SpecParams(2, 2, 4),
    SpecParams(3, 4, 8),
)
LADDER = (CHAIN_1, CHAIN_2, TREE_2, TREE_3)  # short rungs: several switches in 40 tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adaptive_models")
    return {
        "target": save_tiny_llama(root / "target", seed=0),
        "draft": save_tiny_llama(root / "draft", seed=1, num_layers=1),
    }


class _RecordingDrafter:
    """Passes Draft calls through, recording each sequence's spec and ladder rung (None = not
    adaptive) round by round."""

    def __init__(self, inner: DrafterClient, scheduler: Scheduler) -> None:
        self.inner = inner
        self.scheduler = scheduler
        self.specs: dict[str, list[SpecParams]] = defaultdict(list)
        self.rungs: dict[str, list[int | None]] = defaultdict(list)

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        running = {seq.seq_id: seq for seq in self.scheduler.running}
        for item in inputs:
            adaptive = running[item.seq_id].adaptive
            self.specs[item.seq_id].append(item.spec)
            self.rungs[item.seq_id].append(None if adaptive is None else adaptive.rung)
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)


def _prompts(batch_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(200 + batch_size)
    prompts = [
        torch.randint(3, TINY_VOCAB, (3 + 4 * i,), generator=gen).tolist()
        for i in range(batch_size)
    ]
    return [p + p[:3] for p in prompts]  # a repeat for the n-gram proposer


def _requests(
    prompts: list[list[int]], spec: SpecParams | None = None, max_new_tokens: int = MAX_NEW_TOKENS
) -> list[GenerationRequest]:
    return [GenerationRequest(p, max_new_tokens, spec=spec, ignore_eos=True) for p in prompts]


def _target_only(
    models: dict[str, Path], tokenizer: object, requests: list[GenerationRequest]
) -> list[list[int]]:
    stack = make_stack(models["target"], "ngram", tokenizer, SpecParams(0, 1, 0))
    return [generated_ids(chunks) for chunks in generate_all(stack, requests)]


def _adaptive_stack(
    models: dict[str, Path],
    tokenizer: object,
    drafter: str,
    start: SpecParams,
    page_size: int = 16,
    rungs: tuple[SpecParams, ...] | None = LADDER,
) -> tuple[LocalStack, _RecordingDrafter]:
    draft_dir = {"self": None, "random": models["draft"], "ngram": None}[drafter]
    stack = make_stack(
        models["target"],
        "ngram" if drafter == "ngram" else "model",
        tokenizer,
        start,
        draft_dir=draft_dir,
        page_size=page_size,
        adaptive_spec=True,
        adaptive_rungs=rungs,
    )
    recorder = _RecordingDrafter(stack.scheduler.drafter, stack.scheduler)
    stack.scheduler.drafter = recorder
    return stack, recorder


CASES = [
    # (drafter, start, batch_size, page_size): the target as its own drafter climbs, a random
    # draft model descends, the n-gram proposer's acceptance lies in between
    ("self", CHAIN_2, 3, 16),
    ("self", TREE_2, 2, 1),
    ("random", TREE_3, 4, 1),
    ("random", CHAIN_2, 5, 16),
    ("ngram", CHAIN_2, 6, 16),
    ("ngram", TREE_3, 3, 1),
]


@pytest.mark.parametrize(("drafter", "start", "batch_size", "page_size"), CASES)
def test_adaptive_greedy_equals_target_greedy(
    models, smollm2_tokenizer, drafter: str, start: SpecParams, batch_size: int, page_size: int
) -> None:
    requests = _requests(_prompts(batch_size))
    expected = _target_only(models, smollm2_tokenizer, requests)
    stack, recorder = _adaptive_stack(models, smollm2_tokenizer, drafter, start, page_size)
    out = generate_all(stack, requests)  # checks no KV page is left
    assert [generated_ids(chunks) for chunks in out] == expected
    stats = [chunks[-1].stats for chunks in out]
    assert all(s is not None and s.num_accepted_tokens == MAX_NEW_TOKENS for s in stats)
    # one Draft per round and sequence, but for a last round with one token left (no drafts:
    # the drafter is skipped); the stats count every round
    num_rounds = sum(s.rounds for s in stats if s)
    num_drafts = sum(map(len, recorder.specs.values()))
    assert num_rounds - len(stats) <= num_drafts <= num_rounds
    assert all(spec.num_steps > 0 for specs in recorder.specs.values() for spec in specs)
    for seq_id, specs in recorder.specs.items():
        rungs = recorder.rungs[seq_id]
        assert specs[0] == start
        # each round drafts its rung's shape, capped to the tokens left
        assert all(LADDER[r].capped(s.num_steps) == s for r, s in zip(rungs, specs, strict=True))
        if drafter == "self":  # every draft accepted: only ever deeper
            assert rungs == sorted(rungs) and rungs[-1] > rungs[0]
        if drafter == "random":  # next to nothing accepted: only ever cheaper, to the bottom
            assert rungs == sorted(rungs, reverse=True) and rungs[-1] == 0


def test_full_acceptance_climbs_the_ladder_round_by_round(models, smollm2_tokenizer) -> None:
    from gateway.servicer import chunk_to_proto

    chain_3, chain_5 = SpecParams(3, 1, 3), SpecParams(5, 1, 5)
    chains = (CHAIN_1, CHAIN_2, chain_3, chain_5)  # the target drafting chains: all accepted
    stack, recorder = _adaptive_stack(models, smollm2_tokenizer, "self", CHAIN_1, rungs=chains)
    (chunks,) = generate_all(stack, _requests(_prompts(1)))
    (specs,) = recorder.specs.values()
    n = MIN_ROUNDS_PER_RUNG
    # 4 rounds of 2 tokens, 4 of 3, 4 of 4, then chain 5 capped to the 4 tokens left = 40
    assert n == 4 and specs == [CHAIN_1] * n + [CHAIN_2] * n + [chain_3] * n + [chain_3]
    last = chunk_to_proto(chunks[-1], chunks[-1].elapsed_ns)
    assert last.spec_stats.rounds == len(specs) == 13
    assert last.spec_stats.num_accepted_drafts == sum(s.num_steps for s in specs) == 27
    assert last.spec_stats.mean_accepted_tokens == pytest.approx(MAX_NEW_TOKENS / 13)


def test_the_default_ladder_reaches_its_tree(models, smollm2_tokenizer) -> None:
    chain_3, chain_5, tree = SpecParams(3, 1, 3), SpecParams(5, 1, 5), SpecParams(5, 4, 16)
    stack, recorder = _adaptive_stack(models, smollm2_tokenizer, "self", chain_3, rungs=None)
    requests = _requests(_prompts(2), max_new_tokens=64)
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == _target_only(models, smollm2_tokenizer, requests)
    n = MIN_ROUNDS_PER_RUNG
    for specs in recorder.specs.values():  # 4 rounds of 4 tokens, 4 of 6, then the tree
        assert specs[: 2 * n + 1] == [chain_3] * n + [chain_5] * n + [tree]


def test_a_request_with_its_own_spec_keeps_it(models, smollm2_tokenizer) -> None:
    prompts = _prompts(2)
    stack, recorder = _adaptive_stack(models, smollm2_tokenizer, "self", CHAIN_1)
    requests = _requests(prompts[:1], spec=CHAIN_2) + _requests(prompts[1:])
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == _target_only(models, smollm2_tokenizer, requests)
    by_kind = {rungs[0] is None: recorder.specs[seq_id] for seq_id, rungs in recorder.rungs.items()}
    fixed, adaptive = by_kind[True], by_kind[False]
    assert all(spec == CHAIN_2.capped(spec.num_steps) for spec in fixed)
    # 13 drafted rounds of 3 tokens; the 14th, with one token left, skips the drafter
    assert fixed[0] == CHAIN_2 and len(fixed) == MAX_NEW_TOKENS // 3
    assert {spec.num_steps for spec in adaptive} >= {1, 2, 3}  # it climbed past chain 2
