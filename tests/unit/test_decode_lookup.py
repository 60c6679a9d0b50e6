"""Prompt lookup in a round's further decode steps (`VerifyInput.lookup`, the gateway's
--decode-lookup): the verifier drafts each step's chain from the sequence's own tokens (its
`TokenHistory`, kept at every commit and cut at truncations) and verifies it, so a step appends
its accepted drafts and a bonus token. Greedy output stays the target's, token for token, in
every overlap mode, page size and with the verifier's steps run ahead; sessions' turns, a full
KV pool's preemptions and EOS inside a round keep exactly the target's tokens; no KV is left."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from specsplit import convert
from specsplit.errors import ServiceError
from specsplit.lookup import LOOKUP_MIN_NGRAM, MAX_NGRAM, TokenHistory
from specsplit.messages import SpecParams, Truncation, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import (
    check_no_leaks,
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    save_tiny_llama,
    target_only_ids,
)
from tests.unit.test_decode_ahead import Driver, _engine, _release
from tests.unit.test_ngram_index import scan_continuations
from tests.unit.test_scheduler_preemption import _requests as _preemption_requests
from tests.unit.test_sessions import _run

PLAIN = SpecParams(0, 1, 0)


def _lookup_tokens(outcome: str) -> float:
    name = "specsplit_verifier_lookup_tokens_total"
    return REGISTRY.get_sample_value(name, {"outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("lookup") / "target", seed=29)


@pytest.mark.parametrize(
    ("page_size", "ahead", "overlap", "mixed", "steps"),
    [
        (16, False, "serial", False, 1),
        (16, False, "serial", False, 4),
        (1, False, "serial", False, 4),
        (16, True, "serial", False, 4),
        (16, False, "serial", True, 4),
        (1, True, "groups", True, 4),
        (16, False, "both", True, 4),
    ],
    ids=["one-step", "serial", "page-1", "decode-ahead", "mixed", "groups-page-1-ahead", "both"],
)
def test_rounds_with_lookup_give_the_target_tokens(
    target_dir: Path, smollm2_tokenizer: object, page_size: int, ahead: bool, overlap: str,
    mixed: bool, steps: int,
) -> None:  # fmt: skip
    """Requests of mixed lengths, max_new_tokens not a multiple of anything (the last round cut
    to what is allowed), some speculating by the n-gram drafter ("mixed": their rounds one
    step, the others' several; "one-step": rounds of one step, its chain the lookup's): the
    target's tokens, and the lookup's drafts were accepted."""
    requests = mixed_requests(5, seed=4, max_new_tokens=6)
    for i, request in enumerate(requests):
        request.max_new_tokens = 9 + 5 * i
        request.spec = SpecParams(2, 1, 2) if mixed and i % 2 else None  # (the default: PLAIN)
    expected = target_only_ids(target_dir, smollm2_tokenizer, requests)
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, PLAIN, page_size=page_size,
                       decode_ahead=ahead, decode_steps=steps, overlap=overlap,
                       decode_lookup=3)  # fmt: skip
    results = generate_all(stack, requests)
    assert [generated_ids(c) for c in results] == expected
    engine = stack.verifier
    assert 0 < engine.num_lookup_accepted <= engine.num_lookup_drafted
    check_no_leaks(stack)


def test_lookup_takes_fewer_rounds_than_plain_steps(
    target_dir: Path, smollm2_tokenizer: object
) -> None:
    """The same requests with plain steps and with lookup: the same tokens in fewer rounds (a
    tiny random model's greedy output repeats itself, which prompt lookup finds); with their
    own spec of no drafts, no lookup."""
    requests = mixed_requests(3, seed=9, max_new_tokens=40)
    rounds = []
    outputs = []
    for lookup in (0, 4):
        before = {outcome: _lookup_tokens(outcome) for outcome in ("drafted", "accepted")}
        stack = make_stack(target_dir, "ngram", smollm2_tokenizer, PLAIN, decode_steps=4,
                           decode_lookup=lookup)  # fmt: skip
        results = generate_all(stack, requests)
        outputs.append([generated_ids(c) for c in results])
        rounds.append(stack.scheduler.num_rounds)
        # the streams' stats count each step a round, lookup's accepted drafts as drafts
        stats = [chunks[-1].stats for chunks in results]
        assert all(s is not None for s in stats)
        drafts = sum(s.num_accepted_drafts for s in stats if s is not None)
        assert drafts == stack.verifier.num_lookup_accepted
        check_no_leaks(stack)
        # /metrics: specsplit_verifier_lookup_tokens_total{outcome}, as the engine counted
        engine = stack.verifier
        assert _lookup_tokens("drafted") - before["drafted"] == engine.num_lookup_drafted
        assert _lookup_tokens("accepted") - before["accepted"] == engine.num_lookup_accepted
    assert outputs[0] == outputs[1]
    assert rounds[1] < rounds[0], rounds
    # a request that asks for no drafts (its own spec of 0 steps) gets the target alone
    for request in requests:
        request.spec = PLAIN
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, PLAIN, decode_steps=4,
                       decode_lookup=4)  # fmt: skip
    assert [generated_ids(c) for c in generate_all(stack, requests)] == outputs[0]
    assert stack.scheduler.num_rounds == rounds[0] and stack.verifier.num_lookup_drafted == 0


def test_rounds_of_more_sequences_than_the_lookups_batch_limit_look_nothing_up(
    target_dir: Path, smollm2_tokenizer: object
) -> None:
    """--decode-lookup-max-batch 1: while three requests run, their rounds send no lookup; the
    long one, once alone, looks up; the tokens are the target's either way."""
    requests = mixed_requests(3, seed=9, max_new_tokens=6)
    requests[2].max_new_tokens = 40
    expected = target_only_ids(target_dir, smollm2_tokenizer, requests)
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, PLAIN, decode_steps=4,
                       decode_lookup=3, decode_lookup_max_batch=1)  # fmt: skip
    verify = stack.scheduler.verifier.verify
    asked: list[tuple[int, int]] = []  # (sequences, those asking for lookup) a round

    async def counted(inputs: list[VerifyInput]) -> list[VerifyOutput]:
        asked.append((len(inputs), sum(1 for item in inputs if item.lookup)))
        return await verify(inputs)

    stack.scheduler.verifier.verify = counted  # type: ignore[method-assign]
    assert [generated_ids(c) for c in generate_all(stack, requests)] == expected
    assert all(lookups == 0 for size, lookups in asked if size > 1)
    assert any(lookups == 1 for size, lookups in asked if size == 1)
    assert stack.verifier.num_lookup_drafted > 0
    check_no_leaks(stack)


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "seeded"])
def test_session_turns_with_lookup_equal_fresh_requests(
    target_dir: Path, smollm2_tokenizer: object, seed: int | None
) -> None:
    """Turns ending by length, by EOS and by a stop string inside a round: the verifier's
    history is cut with the KV at each turn's truncation, and each turn equals a fresh request
    (sampled: the same checks, seeded)."""
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, PLAIN, decode_steps=4,
                       decode_lookup=3)  # fmt: skip
    _run(stack, SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed))


def test_a_full_kv_pool_preempts_rounds_with_lookup_with_the_same_tokens(
    target_dir: Path, smollm2_tokenizer: object
) -> None:
    """A step's chain needs room the pool may not have: the round ends early where it runs
    out, the gateway preempts, and a preempted sequence's history starts again with it."""
    requests = _preemption_requests(4, max_new_tokens=40)
    expected = target_only_ids(target_dir, smollm2_tokenizer, requests)
    tight = make_stack(target_dir, "ngram", smollm2_tokenizer, PLAIN, page_size=4, num_pages=30,
                       decode_steps=4, decode_lookup=4)  # fmt: skip
    out = generate_all(tight, requests)  # checks no KV is left in either service
    assert [generated_ids(c) for c in out] == expected


@pytest.fixture(scope="module")
def device() -> str:
    """The engines' device (tests/gpu/test_decode_lookup_gpu.py runs these tests on CUDA)."""
    return "cpu"


@pytest.mark.parametrize(
    ("steps", "ahead", "depth"),
    [(1, False, 1), (4, False, 1), (1, True, 1), (4, True, 1), (4, True, 2)],
    ids=["one-step", "steps", "one-step-ahead", "steps-ahead", "steps-ahead-depth-2"],
)
def test_lookup_rounds_give_the_tokens_and_kv_of_one_step_rounds(
    target_dir: Path, device: str, steps: int, ahead: bool, depth: int
) -> None:
    """Two sequences in rounds of `steps` steps, each step verifying a lookup chain of up to 3
    (the first step's too), against one-step rounds of the same engine kind: the same tokens,
    committed lengths and K/V (to float rounding: a token's K/V computed in a chain's verify),
    and the chains were accepted. With decode-ahead (`depth` steps after a round's last) a step
    that found no chain runs the next ahead, and both were used."""
    looked_up, single = (
        Driver(_engine(target_dir, ahead, device, depth=depth)),
        Driver(_engine(target_dir, False, device)),
    )
    for driver in (looked_up, single):
        driver.begin("a", "b")
    for _ in range(32 // steps):
        looked_up.round(dict.fromkeys("ab", DraftTree()), steps=dict.fromkeys("ab", steps),
                        lookup=dict.fromkeys("ab", 3))  # fmt: skip
    assert looked_up.engine.num_lookup_accepted > 0
    assert (looked_up.engine.num_ahead_used > 0) == ahead
    while len(single.tokens["a"]) < len(looked_up.tokens["a"]):
        single.decode("a", rounds=1)
    while len(single.tokens["b"]) < len(looked_up.tokens["b"]):
        single.decode("b", rounds=1)
    assert looked_up.tokens == single.tokens and looked_up.committed == single.committed
    for seq_id in "ab":
        atol = 1e-9 if device == "cpu" else 1e-4
        torch.testing.assert_close(
            looked_up.kv_rows(seq_id), single.kv_rows(seq_id), rtol=0, atol=atol
        )
    _release(looked_up, single)


def test_the_history_holds_the_committed_tokens(target_dir: Path, device: str) -> None:
    """After rounds of steps with lookup, the verifier's history of a sequence is its tokens
    but the pending bonus token; a truncation cuts it with the KV."""
    driver = Driver(_engine(target_dir, False, device))
    driver.begin("a")
    for _ in range(3):
        outputs = driver.round({"a": DraftTree()}, steps={"a": 4}, lookup={"a": 3})
        assert outputs[0].decoded_tokens
    seq = driver.engine.seqs["a"]
    assert seq.history.tokens == driver.tokens["a"][:-1]
    assert len(seq.history.tokens) == seq.kv.kv_committed_len
    driver.engine.truncate([Truncation("a", 10)])
    assert seq.history.tokens == driver.tokens["a"][:10]
    _release(driver)


def test_lookup_crosses_the_wire() -> None:
    item = VerifyInput("s", False, 9, [5], DraftTree(), decode_steps=4, lookup=3)
    plain = VerifyInput("t", False, 9, [5], DraftTree(), decode_steps=4)
    msg = convert.verify_request_to_proto([item, plain])
    assert list(msg.lookup) == [3, 0]
    assert convert.verify_request_from_proto(msg) == [item, plain]
    assert not convert.verify_request_to_proto([plain]).lookup  # all 0: left empty
    out = VerifyOutput("s", [], 7, 12, decoded_tokens=[5, 6, 8], num_lookup_accepted=2)
    msg = convert.verify_response_to_proto([out, VerifyOutput("t", [2], 3, 11)], verify_ns=1)
    assert list(msg.num_lookup_accepted) == [2, 0]
    assert convert.verify_response_from_proto(msg)[0] == out
    msg.num_lookup_accepted[0] = 4  # more than its decoded tokens
    with pytest.raises(ServiceError, match="num_lookup_accepted"):
        convert.verify_response_from_proto(msg)


def test_token_history_chains_as_a_scan_through_commits_and_cuts() -> None:
    """Commits at the committed length (pending tokens + accepted drafts), truncations, and a
    commit past the held tokens (unknown: no chains until the sequence starts again)."""
    rng = random.Random(5)
    history, tokens = TokenHistory(), []
    for _ in range(200):
        if tokens and rng.random() < 0.2:
            length = rng.randrange(len(tokens) + 1)
            history.cut(length)
            del tokens[length:]
        new = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
        at = rng.randrange(max(len(tokens) - 2, 0), len(tokens) + 1)  # rewrites a short tail
        history.put(at, new)
        tokens[at:] = new
        last, depth = rng.randrange(5), rng.randrange(1, 5)
        found = scan_continuations([*tokens, last], depth, 1, LOOKUP_MIN_NGRAM, MAX_NGRAM)
        assert history.chain(len(tokens), last, depth) == (found[0] if found else [])
        assert history.tokens == tokens
    history.put(len(tokens) + 2, [1, 2])  # a gap: what came between is unknown
    assert not history.known and history.chain(0, 1, 3) == []
    history.put(0, [1, 2, 1])  # the sequence starts again
    assert history.known and history.chain(3, 2, 3) == [1, 2]  # after (1, 2) at 0
    assert history.chain(5, 2, 3) == []  # past what it holds


def test_token_history_chains_only_after_suffixes_of_the_minimum_ngram() -> None:
    """A one-token match (LOOKUP_MIN_NGRAM 2) drafts nothing; two tokens do."""
    history = TokenHistory()
    history.put(0, [7, 1, 2, 3, 9])
    assert history.chain(5, 1, 3) == []  # ... 9, 1: only (1,) occurred before
    history.put(5, [1])
    assert history.chain(6, 2, 3) == [3, 9, 1]  # (1, 2) at 1
    single = TokenHistory(min_ngram=1)
    single.put(0, [7, 1, 2, 3, 9])
    assert single.chain(5, 1, 3) == [2, 3, 9]  # where one token may do
