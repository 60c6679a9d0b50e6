"""Pipelined groups (overlap "groups", DESIGN.md §3): while one group is verified, the drafter
drafts the other. The output is the target's own greedy output in every case, faults included,
the draft of one group runs while the other's verify is in flight, and no KV is left."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.request import GenerationRequest
from gateway.sequence import Sequence
from inprocess.clients import LocalVerifierClient
from inprocess.stack import LocalStack
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams
from tests.support import (
    BrokenDrafter,
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


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("groups")
    return {
        "target": save_tiny_llama(root / "target", seed=0),
        "draft": save_tiny_llama(root / "draft", seed=1, num_layers=1),
    }


def _requests(batch_size: int, seed: int, **kwargs: object) -> list[GenerationRequest]:
    return mixed_requests(batch_size, seed, MAX_NEW_TOKENS, **kwargs)


def _target_only(models, tokenizer, batch_size: int, seed: int) -> list[list[int]]:
    return target_only_ids(models["target"], tokenizer, _requests(batch_size, seed))


@pytest.mark.parametrize(
    ("drafter", "spec", "batch_size", "page_size"),
    [
        ("self", SpecParams(3, 1, 3), 1, 16),
        ("self", SpecParams(3, 1, 3), 4, 16),
        ("self", SpecParams(3, 2, 6), 5, 1),
        ("random", SpecParams(4, 1, 4), 6, 1),
        ("random", SpecParams(3, 4, 10), 3, 16),
        ("ngram", SpecParams(2, 1, 2), 7, 16),
        ("ngram", SpecParams(3, 2, 6), 4, 1),
    ],
)
@pytest.mark.parametrize("early", [False, True], ids=["", "early"])
def test_pipelined_groups_equal_target_greedy(
    models,
    smollm2_tokenizer,
    drafter: str,
    spec: SpecParams,
    batch_size: int,
    page_size: int,
    early: bool,
) -> None:
    """Early: the other group's Verify sent while one is in flight, to a pipelined verifier."""
    expected = _target_only(models, smollm2_tokenizer, batch_size, seed=batch_size)
    stack = make_stack(
        models["target"],
        "ngram" if drafter == "ngram" else "model",
        smollm2_tokenizer,
        spec,
        draft_dir=models["draft"] if drafter == "random" else None,
        page_size=page_size,
        overlap="groups",
        early_verify=early,
    )
    if early:
        _pipelined_verifier(stack)
    out = generate_all(stack, _requests(batch_size, seed=batch_size))
    assert [generated_ids(chunks) for chunks in out] == expected
    for chunks in out:
        assert chunks[-1].stats is not None
        assert chunks[-1].stats.num_accepted_tokens == MAX_NEW_TOKENS
    if drafter == "self" and spec.topk == 1:  # drafts always right: they were used
        assert all(c[-1].stats.num_accepted_drafts > 0 for c in out)  # type: ignore[union-attr]


@pytest.mark.parametrize("overlap", ["serial", "groups", "groups-early"])
def test_groups_draft_and_send_while_the_other_group_is_verified(
    models, smollm2_tokenizer, overlap: str
) -> None:
    stack = _stack(models, smollm2_tokenizer, overlap)
    # early: a Verify long against a draft even on a loaded CI core (with 10 ms, one group's
    # draft could outlast the other's Verify there, so that few Verifies went out early)
    delay = 0.1 if overlap == "groups-early" else 0.01
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, verify_delay=delay)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(4, seed=3))
    assert all(len(generated_ids(c)) == MAX_NEW_TOKENS for c in out)
    if overlap == "serial":
        assert timed.overlapping_drafts() == timed.early_verifies() == 0
    elif overlap == "groups":
        assert timed.overlapping_drafts() >= len(timed.drafts) // 2
        assert timed.early_verifies() == 0
    else:
        # the other group's Verify goes out as soon as its trees are drafted, before this
        # group's Verify is answered: the verifier can run the two back to back (so a group's
        # draft may start after the other's early Verify has already been answered)
        assert timed.overlapping_drafts() > 0
        assert timed.early_verifies() >= len(timed.verifies) // 3


def _seq(seq_id: str) -> Sequence:
    request = GenerationRequest([5, 6, 7], max_new_tokens=4)
    return Sequence(seq_id, request, SpecParams(3, 1, 3), stop_checker=None)  # type: ignore[arg-type]


def test_a_newcomer_joins_the_smaller_group_and_on_a_tie_the_one_drafted_this_round(
    models, smollm2_tokenizer
) -> None:
    """Drafted while the other group's Verify runs, not before it (the Verify would wait)."""
    scheduler = _stack(models, smollm2_tokenizer, "groups").scheduler
    a, b, d = _seq("a"), _seq("b"), _seq("d")
    for verified in (0, 1):
        scheduler._init_groups()
        scheduler._group.update(a=0, b=1)
        scheduler._assign_groups([a, b, _seq("new")], verified)
        assert scheduler._group["new"] == 1 - verified
    scheduler._init_groups()
    scheduler._group.update(a=0, b=1, d=0, gone=1)  # "gone" left: group 1 holds b alone
    scheduler._assign_groups([a, b, d, _seq("new")], verified=1)
    assert scheduler._group["new"] == 1 and "gone" not in scheduler._group  # the smaller one
    scheduler._init_groups()
    scheduler._assign_groups([_seq(f"n{i}") for i in range(3)], verified=0)  # all new
    assert scheduler._group == {"n0": 1, "n1": 0, "n2": 1}


def test_a_verify_leaves_its_surplus_to_the_other_group(models, smollm2_tokenizer) -> None:
    """Requests left group 1 (six against two): group 0's next Verify carries four, the two
    past an even split move to group 1 (they go out with its Verify); groups one apart stay."""
    scheduler = _stack(models, smollm2_tokenizer, "groups").scheduler
    seqs = [_seq(f"s{i}") for i in range(8)]
    scheduler._group.update({f"s{i}": 0 for i in range(6)} | {"s6": 1, "s7": 1})
    assert [s.seq_id for s in scheduler._rebalance(seqs, 0)] == ["s0", "s1", "s2", "s3"]
    assert scheduler._group["s4"] == scheduler._group["s5"] == 1
    assert [s.seq_id for s in scheduler._rebalance(seqs, 1)] == ["s4", "s5", "s6", "s7"]
    seqs[0].finished = True  # groups of 3 and 4: none moves
    assert len(scheduler._rebalance(seqs, 1)) == 4 and len(scheduler._rebalance(seqs, 0)) == 3


@pytest.mark.parametrize("overlap", ["groups", "groups-early"])
def test_groups_rebalance_when_one_groups_requests_end_first(
    models, smollm2_tokenizer, overlap: str
) -> None:
    """Six streams in two groups; the three of one group end after 4 tokens, the others run to
    24. The three left split 2 / 1 (not 3 / 0: one Verify a round, nothing to overlap), every
    stream is the target's own and no KV is left."""
    requests = mixed_requests(6, seed=12, max_new_tokens=24)
    for request in requests[0::2]:  # every other newcomer joins the same group
        request.max_new_tokens = 4
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    stack = _stack(models, smollm2_tokenizer, overlap)
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier, verify_delay=0.01)
    stack.scheduler.drafter = timed.drafter_client()
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, requests)
    assert [generated_ids(c) for c in out] == expected
    check_no_leaks(stack)
    long_ids = {item.seq_id for inputs in timed.verify_inputs[-4:] for item in inputs}
    assert len(long_ids) == 3  # the last rounds: the three long streams only
    late = [len(inputs) for inputs in timed.verify_inputs[-6:]]
    assert max(late) <= 2 and 1 in late, late  # split 2 / 1


@pytest.mark.parametrize("chunks_before", [1, 2, 3])
def test_a_newcomer_is_first_drafted_while_a_verify_is_in_flight(
    models, smollm2_tokenizer, chunks_before: int
) -> None:
    """Two streams run as two groups; a third arrives after the first stream's first
    `chunks_before` chunks (so at either group's turn). Its first Draft goes out while the other
    group's Verify runs, and every stream is the target's own."""
    requests = mixed_requests(3, seed=11, max_new_tokens=12)
    for request in requests[:2]:  # still running when the newcomer comes
        request.max_new_tokens = 32
    expected = target_only_ids(models["target"], smollm2_tokenizer, requests)
    stack = _stack(models, smollm2_tokenizer, "groups")
    scheduler = stack.scheduler
    timed = TimedClients(scheduler.drafter, scheduler.verifier, verify_delay=0.1)
    scheduler.drafter = timed.drafter_client()
    scheduler.verifier = timed.verifier_client()

    async def read(request: GenerationRequest, chunks: list[list[int]]) -> list[int]:
        async for chunk in scheduler.generate(request):
            chunks.append(chunk.token_ids)
        return [token for tokens in chunks for token in tokens]

    async def run() -> list[list[int]]:
        await scheduler.start()
        try:
            seen: list[list[list[int]]] = [[], [], []]
            both = [asyncio.ensure_future(read(requests[i], seen[i])) for i in (0, 1)]
            while len(seen[0]) < chunks_before:
                await asyncio.sleep(0.001)
            late = asyncio.ensure_future(read(requests[2], seen[2]))
            return [*await asyncio.gather(*both), await late]
        finally:
            await scheduler.stop()

    assert asyncio.run(run()) == expected
    check_no_leaks(stack)
    begun = [i for i, inputs in enumerate(timed.draft_inputs) if any(x.begin for x in inputs)]
    assert len(begun) >= 2  # the first two streams' first Draft, then the newcomer's
    start, _ = timed.drafts[begun[-1]]
    assert any(s < start < e for s, e in timed.verifies), (start, timed.verifies)


def test_groups_with_the_drafter_down_decode_the_same_tokens(models, smollm2_tokenizer) -> None:
    expected = _target_only(models, smollm2_tokenizer, 4, seed=4)
    stack = make_stack(
        models["target"], "model", smollm2_tokenizer, SpecParams(3, 1, 3), overlap="groups"
    )
    stack.scheduler.drafter = BrokenDrafter(ServiceError(Code.UNAVAILABLE, "drafter down"))
    out = stack.generate_all(_requests(4, seed=4))
    assert [generated_ids(c) for c in out] == expected
    check_no_leaks(stack)


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-call", "pipelined"])
def test_groups_leave_no_kv_when_streams_are_cancelled(
    models, smollm2_tokenizer, pipelined: bool
) -> None:
    stack = _stack(models, smollm2_tokenizer, "groups-early" if pipelined else "groups")
    if pipelined:
        _pipelined_verifier(stack)
    cancel_half_mid_generation(stack, _requests(6, seed=5))
    check_no_leaks(stack)


def _stack(models: dict[str, Path], tokenizer: object, overlap: str) -> LocalStack:
    """A chain-3 stack; overlap "groups-early": groups with the early Verify."""
    return make_stack(
        models["target"],
        "model",
        tokenizer,
        SpecParams(3, 1, 3),
        overlap=overlap.removesuffix("-early"),
        early_verify=overlap.endswith("-early"),
    )


def _pipelined_verifier(stack: LocalStack) -> None:
    """The in-process verifier client as on a GPU: rounds launched and finished apart, the
    other group's launched while one is in flight (verifier/pipelined.py)."""
    stack.scheduler.verifier = LocalVerifierClient(
        stack.verifier, check_integrity=True, pipelined=True
    )


def test_groups_on_pipelined_verify_rounds_equal_target_greedy(models, smollm2_tokenizer) -> None:
    expected = _target_only(models, smollm2_tokenizer, 5, seed=8)
    stack = _stack(models, smollm2_tokenizer, "groups-early")
    _pipelined_verifier(stack)
    timed = TimedClients(stack.scheduler.drafter, stack.scheduler.verifier)
    stack.scheduler.verifier = timed.verifier_client()
    out = generate_all(stack, _requests(5, seed=8))
    assert [generated_ids(c) for c in out] == expected
    assert timed.early_verifies() > 0
    check_no_leaks(stack)


@pytest.mark.parametrize("overlap", ["serial", "groups", "groups-early"])
@pytest.mark.parametrize("fail_at", [2, 3])
def test_groups_survive_a_verifier_restart_with_the_same_tokens(
    models, smollm2_tokenizer, fail_at: int, overlap: str
) -> None:
    """A restart while one group's outputs wait to be committed and the other's trees wait to
    be verified (or sent early): everything re-prefills from the gateway's tokens, nothing is
    lost or repeated."""
    expected = _target_only(models, smollm2_tokenizer, 5, seed=6)
    stack = _stack(models, smollm2_tokenizer, overlap)
    restarting = RestartingVerifier.installed(stack, fail_at)
    out = generate_all(stack, _requests(5, seed=6))
    assert [generated_ids(c) for c in out] == expected
    assert restarting.calls > fail_at
