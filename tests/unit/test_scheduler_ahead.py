"""Draft-ahead (overlap "ahead", DESIGN.md §3): while a round is verified, the drafter drafts the
next round's trees for its likely outcomes; a round whose outcome was guessed sends no Draft
before its Verify. Named invariants: the output is the target's own greedy output (model,
EAGLE-3 and n-gram drafters, chains and trees, page sizes 1 and 16, faults of either service,
cancellations); rounds hit when the drafts are right; a hit round's only drafter call runs while
its Verify is in flight; sampled chains draft ahead too (seeded: the same tokens run after run;
their distribution: tests/unit/test_lossless_sampling.py; faults and cancellations too); no KV
is left. Overlap "both" (draft-ahead for small batches, pipelined groups above): the same
invariants while its rounds change kind as the batch shrinks, and every round. Misses run
plain (ahead_miss "plain": a round not guessed is verified with no tree at once): the same
output, faults included, and no Draft waits before a Verify but the gateway's first (the
drafter tells the layers it reads); a newcomer's prompt is caught up beside its prefill."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from specsplit.errors import Code, ServiceError
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftProbs, DraftTree
from tests.eagle_random import save_random_eagle3
from tests.support import (
    BrokenDrafter,
    PassThroughVerifier,
    RestartingVerifier,
    TimedClients,
    cancel_half_mid_generation,
    check_no_leaks,
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    save_tiny_llama,
    target_only_ids,
)

MAX_NEW_TOKENS = 14
CHAIN = SpecParams(3, 1, 3)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ahead")
    target = save_tiny_llama(root / "target", seed=0)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    return {
        "target": target,
        "draft": save_tiny_llama(root / "draft", seed=1, num_layers=1),
        "head": save_random_eagle3(root / "head", config, seed=3, draft_vocab_size=200),
    }


def _requests(batch_size: int, seed: int, **kwargs: object) -> list[GenerationRequest]:
    return mixed_requests(batch_size, seed, MAX_NEW_TOKENS, **kwargs)


def _target_only(models, tokenizer, batch_size: int, seed: int) -> list[list[int]]:
    return target_only_ids(models["target"], tokenizer, _requests(batch_size, seed))


def _stack(
    models,
    tokenizer,
    drafter: str,
    spec: SpecParams = CHAIN,
    page_size: int = 16,
    overlap: str = "ahead",
    ahead_miss: str = "draft",
):
    """drafter: "self" (the target drafts for itself: every draft is right), "random" (a
    one-layer random draft model), "eagle3" (a random head) or "ngram". ahead_miss: the
    scheduler's (a round not guessed drafts first, or runs plain)."""
    kind = {"self": "model", "random": "model"}.get(drafter, drafter)
    draft_dir = {"random": models["draft"], "eagle3": models["head"]}.get(drafter)
    stack = make_stack(
        models["target"],
        kind,
        tokenizer,
        spec,
        draft_dir=draft_dir,
        page_size=page_size,
        overlap=overlap,
    )
    stack.scheduler.ahead_miss = ahead_miss
    return stack


@pytest.mark.parametrize(
    ("drafter", "spec", "batch_size", "page_size"),
    [
        ("self", CHAIN, 1, 16),
        ("self", SpecParams(4, 1, 4), 3, 1),
        ("random", CHAIN, 1, 1),
        ("random", SpecParams(2, 1, 2), 4, 16),
        ("random", SpecParams(3, 2, 6), 3, 16),  # trees: drafted each round, never ahead
        ("eagle3", CHAIN, 1, 16),
        ("eagle3", SpecParams(4, 1, 4), 3, 1),
        ("ngram", SpecParams(2, 1, 2), 2, 16),
    ],
)
def test_draft_ahead_equals_target_greedy(
    models, smollm2_tokenizer, drafter: str, spec: SpecParams, batch_size: int, page_size: int
) -> None:
    expected = _target_only(models, smollm2_tokenizer, batch_size, seed=batch_size)
    stack = _stack(models, smollm2_tokenizer, drafter, spec, page_size)
    counted = {o: _ahead_rounds(o) for o in ("hit", "miss")}
    out = generate_all(stack, _requests(batch_size, seed=batch_size))
    assert [generated_ids(chunks) for chunks in out] == expected
    check_no_leaks(stack)
    scheduler = stack.scheduler
    if drafter == "self":  # every draft right, bonus = the draft's top-1: every round hits
        assert scheduler.num_ahead_hits >= scheduler.num_ahead_misses
        assert scheduler.num_ahead_hits > 0
    if spec.topk > 1 or drafter == "ngram":  # nothing to draft ahead for
        assert scheduler.num_ahead_hits == scheduler.num_ahead_misses == 0
    assert _ahead_rounds("hit") - counted["hit"] == scheduler.num_ahead_hits  # the metric
    assert _ahead_rounds("miss") - counted["miss"] == scheduler.num_ahead_misses


def _ahead_rounds(outcome: str) -> float:
    value = REGISTRY.get_sample_value("specsplit_draft_ahead_total", {"outcome": outcome})
    return value or 0.0


def test_hit_rounds_send_their_only_draft_while_the_verify_runs(models, smollm2_tokenizer) -> None:
    stack = _stack(models, smollm2_tokenizer, "self")
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(1, seed=3))
    assert len(generated_ids(out[0])) == MAX_NEW_TOKENS
    ahead_calls = [i for i, inputs in enumerate(timed.draft_inputs) if inputs[0].ahead_guesses]
    plain_calls = len(timed.draft_inputs) - len(ahead_calls)
    assert plain_calls == 1 + stack.scheduler.num_ahead_misses  # the first round, and misses
    assert stack.scheduler.num_ahead_hits >= 2
    overlapping = [
        any(v0 < timed.drafts[i][0] < v1 for v0, v1 in timed.verifies) for i in ahead_calls
    ]
    assert all(overlapping)


class _FailingAhead:
    """The real drafter, but every draft-ahead call (the first `times` of them) fails with
    `code` (normal Drafts work)."""

    def __init__(self, inner, code: Code, times: int | None = None) -> None:
        self.inner, self.code, self.times = inner, code, times
        self.failed = 0

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        if any(item.ahead_guesses for item in inputs) and self.failed != self.times:
            self.failed += 1
            raise ServiceError(self.code, "draft-ahead failed")
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.INVALID_ARGUMENT])
def test_failed_draft_ahead_decodes_the_same_tokens(models, smollm2_tokenizer, code: Code) -> None:
    expected = _target_only(models, smollm2_tokenizer, 3, seed=7)
    stack = _stack(models, smollm2_tokenizer, "random")
    failing = _FailingAhead(stack.scheduler.drafter, code)
    stack.scheduler.drafter = failing
    out = generate_all(stack, _requests(3, seed=7))
    assert [generated_ids(c) for c in out] == expected
    assert failing.failed > 0
    check_no_leaks(stack)


def test_draft_ahead_with_the_drafter_down_decodes_the_same_tokens(
    models, smollm2_tokenizer
) -> None:
    expected = _target_only(models, smollm2_tokenizer, 2, seed=4)
    stack = _stack(models, smollm2_tokenizer, "random")
    stack.scheduler.drafter = BrokenDrafter(ServiceError(Code.UNAVAILABLE, "drafter down"))
    out = stack.generate_all(_requests(2, seed=4))
    assert [generated_ids(c) for c in out] == expected
    check_no_leaks(stack)


@pytest.mark.parametrize("fail_at", [2, 4])
def test_draft_ahead_survives_a_verifier_restart(models, smollm2_tokenizer, fail_at: int) -> None:
    expected = _target_only(models, smollm2_tokenizer, 2, seed=6)
    stack = _stack(models, smollm2_tokenizer, "self")
    restarting = RestartingVerifier.installed(stack, fail_at)
    out = generate_all(stack, _requests(2, seed=6))
    assert [generated_ids(c) for c in out] == expected
    assert restarting.calls > fail_at
    check_no_leaks(stack)


@pytest.mark.parametrize("fault", ["draft-ahead fails", "verifier restarts", "cancelled"])
def test_sampled_draft_ahead_survives_faults(models, smollm2_tokenizer, fault: str) -> None:
    """Sampled chains drafting ahead (the target drafting for itself: rounds hit) through
    refused draft-ahead calls (the sequences start over on the drafter), a verifier restart or
    cancelled streams: every stream that is not cancelled gets all its tokens, rounds still take
    trees drafted ahead, and no KV is left on either service."""
    stack = _stack(models, smollm2_tokenizer, "self", ahead_miss="plain")
    requests = _requests(3, seed=8, sampling=SamplingParams(temperature=0.3, seed=2))
    if fault == "cancelled":
        cancel_half_mid_generation(stack, requests)
    else:
        if fault == "draft-ahead fails":
            failing = _FailingAhead(stack.scheduler.drafter, Code.INVALID_ARGUMENT, times=2)
            stack.scheduler.drafter = failing
            out = generate_all(stack, requests)
            assert failing.failed > 0
        else:
            restarting = RestartingVerifier.installed(stack, 3)
            out = generate_all(stack, requests)
            assert restarting.calls > 3
        assert all(len(generated_ids(c)) == MAX_NEW_TOKENS for c in out)
    assert stack.scheduler.num_ahead_hits > 0
    check_no_leaks(stack)


def test_draft_ahead_leaves_no_kv_when_streams_are_cancelled(models, smollm2_tokenizer) -> None:
    stack = _stack(models, smollm2_tokenizer, "random")
    cancel_half_mid_generation(stack, _requests(4, seed=5))
    check_no_leaks(stack)


@pytest.mark.parametrize("ahead_miss", ["draft", "plain"])
def test_sampled_chains_draft_ahead_and_hit(models, smollm2_tokenizer, ahead_miss: str) -> None:
    """A sampled chain drafts ahead as a greedy one does: its draft-ahead calls carry its
    sampling, rounds take the trees drafted ahead (with their draft distributions), and a
    seeded request streams the same tokens run after run (its drafter draws once a call).
    With verify ahead on, no hint goes out for it (the verifier runs greedy rounds ahead
    only)."""
    sampling = SamplingParams(temperature=0.3, seed=11)
    outs = []
    for _ in range(2):
        stack = _stack(models, smollm2_tokenizer, "self", ahead_miss=ahead_miss)
        stack.scheduler.verify_ahead = True
        hints = [_hints(outcome) for outcome in ("sent", "late", "off")]
        timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, 0.0)
        stack.scheduler.drafter = timed.drafter_client()
        stack.scheduler.verifier = timed.verifier_client()
        outs.append(
            [generated_ids(c) for c in generate_all(stack, _requests(2, 8, sampling=sampling))]
        )
        assert stack.scheduler.num_ahead_hits > 0
        ahead = [item for inputs in timed.draft_inputs for item in inputs if item.ahead_guesses]
        assert ahead and all(item.sampling == sampling for item in ahead)
        trees = [item.tree for inputs in timed.verify_inputs for item in inputs if item.tree]
        assert trees and all(tree.draft_probs is not None for tree in trees)
        assert [_hints(outcome) for outcome in ("sent", "late", "off")] == hints
        check_no_leaks(stack)
    assert outs[0] == outs[1] and all(len(out) == MAX_NEW_TOKENS for out in outs[0])


def test_a_tree_fitted_to_a_smaller_shape_keeps_a_tree() -> None:
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 2, 1])  # depths 1 1 2 3 2
    assert tree.fitted(3, 5) is tree
    cut = tree.fitted(2, 3)
    assert cut.tokens == [10, 11, 12] and cut.parents == [-1, -1, 0]
    chain = DraftTree([1, 2, 3], [-1, 0, 1]).fitted(1, 1)
    assert chain.tokens == [1] and chain.parents == [-1]
    assert DraftTree([1, 2], [-1, 0]).fitted(0, 0).tokens == []
    wide = DraftTree([1, 2, 3], [-1, -1, 1])  # depths 1 1 2: no node deeper than its count
    assert wide.fitted(3, 3) is wide and wide.fitted(2, 3) is wide
    assert wide.fitted(1, 3).tokens == [1, 2]


def test_a_sampled_chain_fitted_keeps_its_nodes_rows_and_none_for_no_nodes() -> None:
    """A sampled chain drafted ahead, cut to the next round's shape, keeps its kept nodes' draft
    distributions; cut to no node it is a plain round's empty tree, with no distributions (an
    empty [0, k] support would be a tree with draft probabilities and no nodes)."""
    probs = DraftProbs.of(torch.softmax(torch.randn(3, 9), dim=-1))
    chain = DraftTree([1, 2, 3], [-1, 0, 1], probs)
    cut = chain.fitted(2, 2)
    assert cut.tokens == [1, 2] and cut.draft_probs is not None
    torch.testing.assert_close(cut.draft_probs.dense(), probs.dense()[:2])
    empty = chain.fitted(0, 0)
    assert empty.tokens == [] and empty.draft_probs is None


@pytest.mark.parametrize("guesses", [-1, 17])
def test_guesses_past_the_drafters_limit_are_refused(smollm2_tokenizer, guesses: int) -> None:
    with pytest.raises(ValueError, match="ahead_guesses"):
        Scheduler(None, None, smollm2_tokenizer, (), CHAIN, overlap="ahead", ahead_guesses=guesses)  # type: ignore[arg-type]


class _FlippingMode(PassThroughVerifier):
    """Before each Verify, flips overlap "both" between draft-ahead and groups for the next
    round (ahead_max_batch 0 or 64): every round changes kind."""

    def __init__(self, inner, scheduler: Scheduler) -> None:
        super().__init__(inner)
        self.scheduler = scheduler

    async def verify(self, inputs):
        self.scheduler.ahead_max_batch = 64 if self.scheduler.ahead_max_batch == 0 else 0
        return await self.inner.verify(inputs)


def _count_rounds(scheduler: Scheduler) -> dict[str, int]:
    """Counts the scheduler's rounds by kind (wrapping its step methods)."""
    counts = {"ahead": 0, "groups": 0}
    for kind in counts:
        step = getattr(scheduler, f"step_{kind}")

        async def counted(batch, *args, step=step, kind=kind, **kwargs):
            counts[kind] += 1
            await step(batch, *args, **kwargs)

        setattr(scheduler, f"step_{kind}", counted)
    return counts


@pytest.mark.parametrize(
    ("drafter", "page_size"), [("self", 16), ("random", 1), ("eagle3", 16), ("ngram", 16)]
)
def test_both_switching_every_round_equals_target_greedy(
    models, smollm2_tokenizer, drafter: str, page_size: int
) -> None:
    expected = _target_only(models, smollm2_tokenizer, 3, seed=9)
    stack = _stack(models, smollm2_tokenizer, drafter, page_size=page_size, overlap="both")
    scheduler = stack.scheduler
    scheduler.verifier = _FlippingMode(scheduler.verifier, scheduler)
    rounds = _count_rounds(scheduler)
    out = generate_all(stack, _requests(3, seed=9))
    assert [generated_ids(c) for c in out] == expected
    check_no_leaks(stack)
    assert rounds["ahead"] >= 2 and rounds["groups"] >= 2
    if drafter == "self":  # the trees drafted ahead serve the groups rounds after them too
        assert scheduler.num_ahead_hits >= rounds["ahead"] - 1


def test_both_drafts_ahead_once_the_batch_is_small(models, smollm2_tokenizer) -> None:
    """Four requests of different lengths, ahead_max_batch 2: groups while three or four run,
    draft-ahead for the last two."""
    requests = [
        dataclasses.replace(r, max_new_tokens=n)
        for r, n in zip(_requests(4, seed=10), (6, 10, 16, 22), strict=True)
    ]
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    stack = _stack(models, smollm2_tokenizer, "self", overlap="both")
    scheduler = stack.scheduler
    scheduler.ahead_max_batch = 2
    rounds = _count_rounds(scheduler)
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == expected
    check_no_leaks(stack)
    assert rounds["groups"] >= 2 and rounds["ahead"] >= 2
    assert scheduler.num_ahead_hits > 0


def test_both_survives_faults_and_cancellations(models, smollm2_tokenizer) -> None:
    expected = _target_only(models, smollm2_tokenizer, 3, seed=12)
    stack = _stack(models, smollm2_tokenizer, "self", overlap="both")
    stack.scheduler.ahead_max_batch = 2
    RestartingVerifier.installed(stack, 3)
    out = generate_all(stack, _requests(3, seed=12))
    assert [generated_ids(c) for c in out] == expected
    check_no_leaks(stack)
    stack = _stack(models, smollm2_tokenizer, "random", overlap="both")
    stack.scheduler.drafter = _FailingAhead(stack.scheduler.drafter, Code.UNAVAILABLE)
    out = generate_all(stack, _requests(3, seed=12))
    assert [generated_ids(c) for c in out] == expected
    check_no_leaks(stack)
    stack = _stack(models, smollm2_tokenizer, "random", overlap="both")
    stack.scheduler.ahead_max_batch = 2
    cancel_half_mid_generation(stack, _requests(5, seed=13))
    check_no_leaks(stack)


def test_a_negative_ahead_max_batch_is_refused(smollm2_tokenizer) -> None:
    with pytest.raises(ValueError, match="ahead_max_batch"):
        Scheduler(None, None, smollm2_tokenizer, (), CHAIN, overlap="both", ahead_max_batch=-1)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1])
def test_a_batch_of_no_sequences_is_refused(smollm2_tokenizer, size: int) -> None:
    """It would never admit a request (the command line refuses it too)."""
    with pytest.raises(ValueError, match="max_batch_size"):
        Scheduler(None, None, smollm2_tokenizer, (), CHAIN, max_batch_size=size)  # type: ignore[arg-type]


def test_an_unknown_ahead_miss_is_refused(smollm2_tokenizer) -> None:
    with pytest.raises(ValueError, match="ahead_miss"):
        Scheduler(None, None, smollm2_tokenizer, (), CHAIN, overlap="ahead", ahead_miss="skip")  # type: ignore[arg-type]


# -- misses run plain (ahead_miss "plain"): a sequence whose outcome was not guessed is verified
# with no tree at once while the drafter drafts ahead from that step's likely outcomes; no Draft
# waits before a Verify but the gateway's first, before the drafter has told its layers.


@pytest.mark.parametrize(
    ("drafter", "spec", "batch_size", "page_size"),
    [
        ("self", CHAIN, 1, 16),
        ("self", SpecParams(4, 1, 4), 3, 1),
        ("random", CHAIN, 2, 1),
        ("random", SpecParams(3, 2, 6), 3, 16),  # trees: drafted each round, never ahead
        ("eagle3", CHAIN, 1, 16),
        ("eagle3", SpecParams(2, 1, 2), 3, 1),
    ],
)
def test_draft_ahead_with_plain_misses_equals_target_greedy(
    models, smollm2_tokenizer, drafter: str, spec: SpecParams, batch_size: int, page_size: int
) -> None:
    expected = _target_only(models, smollm2_tokenizer, batch_size, seed=batch_size)
    stack = _stack(models, smollm2_tokenizer, drafter, spec, page_size, ahead_miss="plain")
    out = generate_all(stack, _requests(batch_size, batch_size))  # checks that no KV is left
    assert [generated_ids(chunks) for chunks in out] == expected
    scheduler = stack.scheduler
    if drafter == "self":  # every draft right: after the first round every round hits
        assert scheduler.num_ahead_misses <= batch_size
        assert scheduler.num_ahead_hits > scheduler.num_ahead_misses
        assert all(c[-1].stats.num_accepted_drafts > 0 for c in out)  # type: ignore[union-attr]
    if spec.topk > 1:
        assert scheduler.num_ahead_hits == scheduler.num_ahead_misses == 0


def test_plain_misses_leave_no_draft_waiting_before_a_verify(models, smollm2_tokenizer) -> None:
    """Every drafter call but the first round's Draft (the drafter learns the sequences) starts
    while a Verify is in flight: misses run plain instead of sending a Draft first, and the
    last round (no drafts: one token left) skips the drafter."""
    stack = _stack(models, smollm2_tokenizer, "random", ahead_miss="plain")
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, verify_delay=0.02)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(2, seed=5))
    assert all(len(generated_ids(c)) == MAX_NEW_TOKENS for c in out)
    assert stack.scheduler.num_ahead_misses > 0  # a random draft model: misses ran plain
    assert len(timed.drafts) > 2 and timed.overlapping_drafts() == len(timed.drafts) - 1


def test_a_newcomer_after_the_drafters_first_answer_waits_for_no_draft(
    models, smollm2_tokenizer
) -> None:
    """Once the drafter has told the layers it reads (none: a draft model), a newcomer's
    first round is its prefill with no tree, and the draft-ahead call beside it catches its
    prompt up: no drafter call starts outside a Verify, and the next rounds take the trees
    drafted ahead (a draft that is always right: they hit)."""
    stack = _stack(models, smollm2_tokenizer, "self", ahead_miss="plain")
    generate_all(stack, _requests(1, seed=4))  # the drafter answers once
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, verify_delay=0.02)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    hits = stack.scheduler.num_ahead_hits
    requests = _requests(3, seed=9)
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == target_only_ids(
        models["target"], smollm2_tokenizer, _requests(3, seed=9)
    )
    first = timed.verify_inputs[0]
    assert all(item.begin and not item.tree for item in first)  # prefills, no trees
    assert timed.overlapping_drafts() == len(timed.drafts) > 0
    assert all(item.ahead_guesses for inputs in timed.draft_inputs for item in inputs)
    assert stack.scheduler.num_ahead_hits - hits >= 3


@pytest.mark.parametrize("spec", [CHAIN, SpecParams(2, 2, 4)], ids=["chain", "tree"])
def test_a_sampled_newcomer_is_caught_up_beside_its_prefill(
    models, smollm2_tokenizer, spec: SpecParams
) -> None:
    """Once the drafter has told its layers a sampled newcomer is not drafted first: its
    prefill goes with no tree while the drafter call beside the Verify takes its prompt and,
    a chain's, drafts ahead for the prefill's outcomes (a tree's, which never drafts ahead:
    no drafts); its later rounds are drafted. Seeded, it streams the same tokens run after
    run; the greedy ones beside it are the target's."""

    def run() -> tuple[list[list[int]], TimedClients]:
        stack = _stack(models, smollm2_tokenizer, "random", ahead_miss="plain")
        generate_all(stack, _requests(1, seed=4))  # the drafter answers once
        timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, 0.02)
        stack.scheduler.drafter = timed.drafter_client()
        stack.scheduler.verifier = timed.verifier_client()
        requests = _requests(3, seed=12)
        requests[1].sampling = SamplingParams(temperature=0.8, seed=5)
        requests[1].spec = spec
        return [generated_ids(c) for c in generate_all(stack, requests)], timed

    out, timed = run()
    greedy = target_only_ids(models["target"], smollm2_tokenizer, _requests(3, seed=12))
    assert out[0] == greedy[0] and out[2] == greedy[2]
    assert run()[0][1] == out[1]  # seeded: the same draws
    k, prefill = next(
        (k, item)
        for k, inputs in enumerate(timed.verify_inputs)
        for item in inputs
        if not item.sampling.greedy
    )
    sampled_id = prefill.seq_id
    assert prefill.begin and not prefill.tree
    first = [
        (i, item)
        for i, inputs in enumerate(timed.draft_inputs)
        for item in inputs
        if item.seq_id == sampled_id
    ]
    i, item = first[0]
    if spec.topk == 1:  # drafts ahead for the prefill's likely bonus tokens
        assert item.begin and item.spec == spec and item.ahead_guesses and not item.verifying
    else:
        assert item.begin and item.spec == SpecParams() and not item.ahead_guesses
    v0, v1 = timed.verifies[k]
    assert v0 < timed.drafts[i][0] < v1  # beside the prefill's Verify
    assert any(item.spec.num_steps > 0 for _, item in first[1:])  # then drafted


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.INVALID_ARGUMENT])
def test_a_newcomer_whose_draft_ahead_fails_decodes_the_same_tokens(
    models, smollm2_tokenizer, code: Code
) -> None:
    """After the drafter's first answer a newcomer reaches it only through draft-ahead calls
    beside its Verifies: when every one of them fails (down, or refused), its rounds run
    plain and its output is the target's; no KV is left on either service."""
    stack = _stack(models, smollm2_tokenizer, "self", ahead_miss="plain")
    generate_all(stack, _requests(1, seed=4))  # the drafter answers once
    failing = _FailingAhead(stack.scheduler.drafter, code)
    stack.scheduler.drafter = failing
    out = generate_all(stack, _requests(3, seed=11))  # checks that no KV is left
    assert [generated_ids(c) for c in out] == target_only_ids(
        models["target"], smollm2_tokenizer, _requests(3, seed=11)
    )
    assert failing.failed > 0


@pytest.mark.parametrize("overlap", ["serial", "ahead", "groups"])
def test_an_eagle_newcomer_sends_no_draft_before_its_features(
    models, smollm2_tokenizer, overlap: str
) -> None:
    """An EAGLE head drafts nothing before the prefill brings the target's features: once it
    has told its layers, a newcomer's first round asks it nothing (no Draft on the round's
    path), every drafter call carries feature rows, and the output is the target's."""
    stack = _stack(models, smollm2_tokenizer, "eagle3", overlap=overlap, ahead_miss="plain")
    generate_all(stack, _requests(1, seed=4))  # the drafter answers once: its layers
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(3, seed=10))
    assert [generated_ids(c) for c in out] == target_only_ids(
        models["target"], smollm2_tokenizer, _requests(3, seed=10)
    )
    assert timed.draft_inputs  # it drafted once the features came
    for inputs in timed.draft_inputs:
        for item in inputs:
            rows = item.target_hidden_states
            assert rows is not None and rows.shape[0] > 0, item.seq_id


def test_sampled_requests_beside_plain_misses(models, smollm2_tokenizer) -> None:
    """A sampled request drafts ahead beside greedy ones, all running plain on a miss; each
    stream is the target's greedy output or seeded alike across runs."""
    requests = _requests(3, seed=7)
    requests[1].sampling = SamplingParams(temperature=0.8, seed=11)
    greedy = target_only_ids(models["target"], smollm2_tokenizer, requests)
    outs = [
        [
            generated_ids(c)
            for c in generate_all(
                _stack(models, smollm2_tokenizer, "random", ahead_miss="plain"), reqs
            )
        ]
        for reqs in (requests, _requests(3, seed=7))
    ]
    assert outs[0][0] == greedy[0] and outs[0][2] == greedy[2]
    sampled_again = _requests(3, seed=7)
    sampled_again[1].sampling = SamplingParams(temperature=0.8, seed=11)
    again = generate_all(
        _stack(models, smollm2_tokenizer, "random", ahead_miss="plain"), sampled_again
    )
    assert generated_ids(again[1]) == outs[0][1]  # seeded: the same draws


def test_plain_misses_survive_a_verifier_restart(models, smollm2_tokenizer) -> None:
    expected = _target_only(models, smollm2_tokenizer, 3, seed=6)
    stack = _stack(models, smollm2_tokenizer, "self", ahead_miss="plain")
    restarting = RestartingVerifier.installed(stack, 4)
    out = generate_all(stack, _requests(3, 6))
    assert [generated_ids(c) for c in out] == expected
    assert restarting.calls > 4


def test_plain_misses_with_the_drafter_down_decode_the_same_tokens(
    models, smollm2_tokenizer
) -> None:
    expected = _target_only(models, smollm2_tokenizer, 3, seed=8)
    stack = _stack(models, smollm2_tokenizer, "random", ahead_miss="plain")
    stack.scheduler.drafter = BrokenDrafter(ServiceError(Code.UNAVAILABLE, "drafter down"))
    out = generate_all(stack, _requests(3, 8))
    assert [generated_ids(c) for c in out] == expected


@pytest.mark.parametrize(("guesses", "at_root"), [(2, 2 * (CHAIN.num_steps + 1)), (6, 16)])
def test_a_plain_round_guesses_as_many_trees_as_a_chain_round(
    models, smollm2_tokenizer, guesses: int, at_root: int
) -> None:
    """After a plain round (an empty tree: one accept length) the drafter is asked for (chain
    length + 1) x ahead_guesses bonus tokens at the root, at most its limit of 16; after a
    chain round, ahead_guesses per accept length."""
    stack = _stack(models, smollm2_tokenizer, "random", ahead_miss="plain")
    stack.scheduler.ahead_guesses = guesses
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, verify_delay=0.0)
    stack.scheduler.drafter = timed.drafter_client()
    generate_all(stack, _requests(2, seed=9))
    asked = {
        (len(item.verifying), item.ahead_guesses)
        for call in timed.draft_inputs
        for item in call
        if item.ahead_guesses
    }
    assert (0, at_root) in asked
    assert {g for nodes, g in asked if nodes} == {guesses}


class _HintFirst(PassThroughVerifier):
    """Holds each Verify until the draft-ahead of its round is answered and its hint sent (in
    process a tiny model verifies before its drafter drafts ahead, so the hint would come too
    late), as on two GPUs where the draft is the shorter."""

    def __init__(self, inner, drafter) -> None:
        super().__init__(inner)
        self.drafter = drafter
        self.ahead: asyncio.Future | None = None

    async def verify(self, inputs):
        for _ in range(3):  # the round's draft-ahead starts
            await asyncio.sleep(0)
        if self.ahead is not None:
            await asyncio.shield(self.ahead)
            for _ in range(3):  # and its hint goes out
                await asyncio.sleep(0)
        return await self.inner.verify(inputs)

    def wrap_drafter(self):
        verifier, inner = self, self.drafter

        class Drafter:
            async def draft(self, inputs):
                if not any(item.ahead_guesses for item in inputs):
                    return await inner.draft(inputs)
                verifier.ahead = asyncio.ensure_future(inner.draft(inputs))
                try:
                    return await asyncio.shield(verifier.ahead)
                finally:
                    verifier.ahead = None

            async def release(self, seq_ids):
                await inner.release(seq_ids)

            async def truncate(self, items):
                return await inner.truncate(items)

        return Drafter()


@pytest.mark.parametrize(
    ("drafter", "ahead_miss", "batch_size", "page_size"),
    [
        ("self", "plain", 1, 16),
        ("self", "draft", 3, 1),
        ("random", "plain", 2, 16),
        ("eagle3", "plain", 3, 1),
        ("eagle3", "draft", 1, 16),
    ],
)
def test_rounds_run_ahead_on_hints_equal_target_greedy(
    models, smollm2_tokenizer, drafter: str, ahead_miss: str, batch_size: int, page_size: int
) -> None:
    """verify_ahead (the default): the trees drafted ahead reach the verifier while it
    verifies, and it launches the next rounds on them; the tokens are the target's, no KV is
    left, and with the target drafting for itself the rounds run ahead are taken."""
    expected = _target_only(models, smollm2_tokenizer, batch_size, seed=batch_size)
    stack = _stack(models, smollm2_tokenizer, drafter, CHAIN, page_size, ahead_miss=ahead_miss)
    scheduler = stack.scheduler
    assert scheduler.verify_ahead
    scheduler.verifier = hint_first = _HintFirst(scheduler.verifier, scheduler.drafter)
    scheduler.drafter = hint_first.wrap_drafter()
    sent = _hints("sent")
    out = generate_all(stack, _requests(batch_size, batch_size))
    assert [generated_ids(chunks) for chunks in out] == expected
    check_no_leaks(stack)
    assert _hints("sent") > sent  # counted (specsplit_hints_total)
    engine = stack.verifier
    if drafter == "self" or ahead_miss == "plain":  # a guessed outcome, or a miss run plain
        assert engine.num_next_used + engine.num_next_dropped > 0  # ran ahead on the hints
    if drafter == "self":  # every outcome guessed: the rounds run ahead are the next rounds
        assert engine.num_next_used > engine.num_next_dropped


def _hints(outcome: str) -> float:
    return REGISTRY.get_sample_value("specsplit_hints_total", {"outcome": outcome}) or 0.0


class _VerifyFirst(PassThroughVerifier):
    """Answers each Verify before the drafter answers its round's draft-ahead."""

    def __init__(self, inner, drafter) -> None:
        super().__init__(inner)
        self.drafter = drafter
        self.answered = asyncio.Event()

    async def verify(self, inputs):
        self.answered.clear()
        try:
            return await self.inner.verify(inputs)
        finally:
            self.answered.set()

    async def hold(self) -> None:
        """What a draft-ahead's answer waits for: its round's Verify answered."""
        await self.answered.wait()

    def wrap_drafter(self):
        verifier, inner = self, self.drafter

        class Drafter:
            async def draft(self, inputs):
                outputs = await inner.draft(inputs)
                if any(item.ahead_guesses for item in inputs):
                    await verifier.hold()
                return outputs

            async def release(self, seq_ids):
                await inner.release(seq_ids)

        return Drafter()


def test_a_hint_is_not_sent_once_its_verify_has_answered(models, smollm2_tokenizer) -> None:
    """A draft-ahead answered after its round's Verify: its hint would come after the round, so
    none goes out, each counted 'late' (specsplit_hints_total), and nothing runs ahead."""
    stack = _stack(models, smollm2_tokenizer, "self", CHAIN, 16, ahead_miss="plain")
    scheduler = stack.scheduler
    scheduler.verifier = verify_first = _VerifyFirst(scheduler.verifier, scheduler.drafter)
    scheduler.drafter = verify_first.wrap_drafter()
    sent, late = _hints("sent"), _hints("late")
    generate_all(stack, _requests(1, 1))
    check_no_leaks(stack)
    assert _hints("late") > late and _hints("sent") == sent
    assert stack.verifier.num_next_used == stack.verifier.num_next_dropped == 0


class _CommitsWatched(_VerifyFirst):
    """_VerifyFirst whose draft-ahead answers only once the scheduler has committed the round
    its Verify answered and streamed every token committed (or after a second without): for
    each draft-ahead, whether it had."""

    def __init__(self, inner, drafter, scheduler: Scheduler) -> None:
        super().__init__(inner, drafter)
        self.scheduler = scheduler
        self.answered_len: dict[str, int] = {}  # each sequence's kv_committed_len, as answered
        self.streamed_at_start = _streamed_tokens()
        self.committed_first: list[bool] = []

    async def verify(self, inputs):
        outputs = await super().verify(inputs)
        self.answered_len.update((out.seq_id, out.kv_committed_len) for out in outputs)
        return outputs

    def _committed_and_streamed(self) -> bool:
        (seq,) = self.scheduler.running
        committed = seq.verifier_kv_committed_len == self.answered_len[seq.seq_id]
        streamed = _streamed_tokens() - self.streamed_at_start == seq.num_generated_tokens
        return committed and streamed

    async def hold(self) -> None:
        await super().hold()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                while not self._committed_and_streamed():
                    await asyncio.sleep(0)
        self.committed_first.append(self._committed_and_streamed())


def _streamed_tokens() -> float:
    return REGISTRY.get_sample_value("specsplit_generated_tokens_total") or 0.0


def test_a_verify_answered_first_is_committed_and_streamed_while_the_drafter_drafts(
    models, smollm2_tokenizer
) -> None:
    """A round's Verify that answers before its draft-ahead: the round is committed and its
    tokens stream at once, before the drafter answers (off the next round's path, which waits
    only for the trees); the trees drafted ahead still serve the next round (the target
    drafting for itself: every outcome guessed), and the tokens are the target's."""
    expected = _target_only(models, smollm2_tokenizer, 1, seed=2)
    stack = _stack(models, smollm2_tokenizer, "self", CHAIN, 16, ahead_miss="plain")
    scheduler = stack.scheduler
    scheduler.verifier = watched = _CommitsWatched(scheduler.verifier, scheduler.drafter, scheduler)
    scheduler.drafter = watched.wrap_drafter()
    out = generate_all(stack, _requests(1, seed=2))
    assert [generated_ids(chunks) for chunks in out] == expected
    assert len(watched.committed_first) >= 2 and all(watched.committed_first)
    assert scheduler.num_ahead_hits >= len(watched.committed_first) - 1
    assert scheduler.num_ahead_misses == 0


class _Recording(PassThroughVerifier):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.rounds: list[list] = []

    async def verify(self, inputs):
        self.rounds.append([(len(i.tree), i.decode_steps, i.begin) for i in inputs])
        return await self.inner.verify(inputs)


def test_plain_misses_decode_one_step_where_plain_rounds_take_several(
    models, smollm2_tokenizer
) -> None:
    """With several decode steps a plain round (a GPU's default), a miss run plain still
    decodes one: its outcome is the bonus token the drafter guessed from, so the next round can
    be a hit (several steps would commit more than any guess). The tokens are the target's."""
    expected = _target_only(models, smollm2_tokenizer, 2, seed=5)
    stack = _stack(models, smollm2_tokenizer, "random", ahead_miss="plain")
    scheduler = stack.scheduler
    scheduler.decode_steps = 4
    scheduler.verifier = recording = _Recording(scheduler.verifier)
    out = generate_all(stack, _requests(2, seed=5))
    assert [generated_ids(chunks) for chunks in out] == expected
    assert scheduler.num_ahead_misses > 0  # a random draft model: misses ran plain
    plain = [steps for r in recording.rounds for n, steps, begin in r if not n and not begin]
    assert plain and all(steps == 1 for steps in plain)


class _HintsSeen(_HintFirst):
    """_HintFirst that keeps each Verify's tree size by (sequence, base) and every hint."""

    def __init__(self, inner, drafter) -> None:
        super().__init__(inner, drafter)
        self.tree_sizes: dict[tuple[str, int], int] = {}
        self.prompt_lens: dict[str, int] = {}
        self.hints: list = []

    async def verify(self, inputs):
        for item in inputs:
            if item.begin:
                self.prompt_lens[item.seq_id] = len(item.pending_tokens)
            base = item.kv_committed_len + len(item.pending_tokens)
            self.tree_sizes[(item.seq_id, base)] = len(item.tree)
        return await super().verify(inputs)

    async def hint(self, hints):
        self.hints += hints
        await self.inner.hint(hints)


def test_a_hint_runs_misses_plain_only_where_a_next_round_is_left(
    models, smollm2_tokenizer
) -> None:
    """A miss commits up to the tree being verified and a bonus token: a hint says misses run
    plain only where max_new_tokens leaves a round after that many (near the end it does not,
    and the verifier would run a round for nothing). The target drafting for itself: every
    chain is accepted whole, so a round near the end verifies a chain capped to what is
    left, shorter than the trees drafted for the outcomes before it."""
    stack = _stack(models, smollm2_tokenizer, "self", ahead_miss="plain")
    scheduler = stack.scheduler
    scheduler.verifier = seen = _HintsSeen(scheduler.verifier, scheduler.drafter)
    scheduler.drafter = seen.wrap_drafter()
    generate_all(stack, _requests(2, seed=5))
    lefts = []
    for hint in seen.hints:
        left = MAX_NEW_TOKENS - (hint.base - seen.prompt_lens[hint.seq_id])
        if left == MAX_NEW_TOKENS:  # the prefill's round: its misses are drafted first
            continue
        room = seen.tree_sizes[(hint.seq_id, hint.base)] + 1
        assert hint.plain == (left > room), (hint, left, room)
        lefts.append(left)
    assert min(lefts) <= 2  # hints came near the end too
