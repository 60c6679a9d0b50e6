"""Sessions (DESIGN.md §7): every turn equals a fresh request carrying the whole conversation
(greedy: token for token; seeded sampling: the same tokens), with the KV accounting checked at
every turn boundary in both services and nothing left after the session is closed.

A conversation here is four turns that end by length, by EOS, by a stop string and by length
again, so that each kind of ending is followed by a turn. With the target as its own drafter
every draft is accepted, so the EOS and the stop string fall inside a round's accepted tokens
(tokens past them are trimmed from both caches).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from drafter.model_proposer import ModelProposer
from inprocess.stack import LocalStack
from specsplit.guide.bad_words import BadWords
from specsplit.guide.tokens import FixedTokens
from specsplit.logit_rules import Penalties
from specsplit.messages import SpecParams, Truncated, Truncation
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from tests.eagle_random import save_random_eagle3
from tests.support import (
    TINY_VOCAB,
    Conversation,
    check_no_leaks,
    collect,
    generated_ids,
    make_stack,
    record_verifies,
    save_tiny_llama,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sessions")
    target = save_tiny_llama(root / "target", seed=0, num_layers=4)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    return {"target": target, "head": save_random_eagle3(root / "head", config, seed=3)}


def _prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()
    return ids + ids[:3]  # something for the n-gram proposer to find


async def _four_turns(conv: Conversation) -> None:
    """By length, by EOS, by a stop string, by length."""
    first = await conv.turn(_prompt(1, 6), 5)
    assert first[-1].finish_reason == "length"

    second = _prompt(2, 5)
    probe = generated_ids(await conv.fresh(second, 8))
    eos_at = _first_new(probe, [str(t) for t in probe])  # inside the first round, if accepted
    conv.scheduler.eos_token_ids = (probe[eos_at],)
    out = await conv.turn(second, 8)
    conv.scheduler.eos_token_ids = ()
    assert out[-1].finish_reason == "stop" and generated_ids(out) == probe[: eos_at + 1]

    third = _prompt(3, 4)
    probe = generated_ids(await conv.fresh(third, 8))
    # as the stream has it: a special token's text (<empty_output>) never reaches a stop string
    text = [conv.scheduler.tokenizer.decode([t], skip_special_tokens=True) for t in probe]
    stop_at = _first_new(probe, text)
    out = await conv.turn(third, 8, stop_strings=(text[stop_at],))
    ids = generated_ids(out)  # the stop string may complete a token later in context
    assert out[-1].finish_reason == "stop" and ids == probe[: len(ids)] and len(ids) < len(probe)

    last = await conv.turn(_prompt(4, 3), 4)
    assert last[-1].finish_reason == "length"


def _first_new(probe: list[int], text: list[str]) -> int:
    """The first generated token after the first whose text (non-empty) is not in what came
    before: an EOS or a stop string there ends the turn at that token."""
    for i in range(1, len(probe) - 1):
        if text[i].strip() and text[i] not in "".join(text[:i]):
            return i
    raise AssertionError(f"no usable stop point in {probe}")


GREEDY = SamplingParams()


def _run(
    stack: LocalStack,
    sampling: SamplingParams = GREEDY,
    turns: Callable[[Conversation], Awaitable[None]] = _four_turns,
) -> None:
    """`turns` on one session of `stack`, closed after; no KV left."""

    async def run() -> None:
        await stack.scheduler.start()
        try:
            conv = Conversation(stack, sampling)
            await turns(conv)
            await stack.scheduler.sessions.close(conv.session.session_id)
        finally:
            await stack.scheduler.stop()

    stack.scheduler.eos_token_ids = ()
    asyncio.run(run())
    check_no_leaks(stack)


CHAIN, TREE = SpecParams(3, 1, 3), SpecParams(3, 2, 5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["topk1", "topk2"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_turns_equal_fresh_requests(models, smollm2_tokenizer, drafter, spec, page_size):
    # "model" without a draft checkpoint drafts with the target itself: every draft accepted
    stack = make_stack(models["target"], drafter, smollm2_tokenizer, spec, page_size=page_size)
    cuts = _record_cuts(stack)
    _run(stack)
    if drafter == "model":  # the EOS and the stop string came inside a round's accepted drafts
        assert any(cut > 0 for cut in cuts), cuts


def _record_cuts(stack: LocalStack) -> list[int]:
    """How many tokens' KV each verifier Truncate cut (tokens past a stop point)."""
    cuts: list[int] = []
    truncate = stack.verifier.truncate

    def recording(items: list[Truncation]) -> list[Truncated]:
        before = [stack.verifier.seqs[t.seq_id].kv.kv_committed_len for t in items]
        out = truncate(items)
        cuts.extend(b - o.kv_committed_len for b, o in zip(before, out, strict=True))
        return out

    stack.verifier.truncate = recording  # type: ignore[method-assign]
    return cuts


@pytest.mark.parametrize("spec", [SpecParams(2, 1, 2), SpecParams(2, 2, 4)], ids=["topk1", "topk2"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_turns_equal_fresh_requests_eagle3(models, smollm2_tokenizer, spec, page_size):
    stack = make_stack(
        models["target"],
        "eagle3",
        smollm2_tokenizer,
        spec,
        draft_dir=models["head"],
        page_size=page_size,
    )
    assert stack.scheduler.hidden_state_layers
    _run(stack)


def test_greedy_turns_equal_fresh_requests_in_pipelined_groups(models, smollm2_tokenizer):
    stack = make_stack(models["target"], "model", smollm2_tokenizer, CHAIN, overlap="groups")
    _run(stack)


@pytest.mark.parametrize(
    ("drafter", "sampling"),
    [("model", GREEDY), ("eagle3", GREEDY), ("ngram", SamplingParams(temperature=4.0, seed=77))],
)
def test_turns_in_chunks_equal_fresh_requests(models, smollm2_tokenizer, drafter, sampling):
    """--prefill-chunk 3 (Sequence.prefilling): a turn's pending tokens (the last bonus token
    and its new message, 4-10 of them) go three a round after the KV its session kept, as a
    fresh request's prompt does: no round brings more than three; the turns still equal fresh
    requests (a seeded sampler's too)."""
    head = models["head"] if drafter == "eagle3" else None
    stack = make_stack(models["target"], drafter, smollm2_tokenizer, CHAIN, draft_dir=head)
    stack.scheduler.prefill_chunk = 3
    rounds = record_verifies(stack.scheduler)
    _run(stack, sampling)
    items = [item for r in rounds for item in r]
    assert all(len(item.pending_tokens) <= 3 for item in items)
    assert any(not i.begin and len(i.pending_tokens) == 3 and not i.tree for i in items)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_seeded_sampling_turns_equal_fresh_requests(models, smollm2_tokenizer, drafter):
    """Each turn's generators start from its own seed, as a fresh request's do; "model"
    samples its chain (draft probabilities), n-gram proposes deterministically."""
    stack = make_stack(models["target"], drafter, smollm2_tokenizer, CHAIN)
    if drafter == "model":
        assert isinstance(stack.drafter.proposer, ModelProposer)
    _run(stack, SamplingParams(temperature=4.0, seed=1234))


def test_two_sessions_side_by_side_in_groups(models, smollm2_tokenizer):
    """Two conversations at once, turns interleaved in the pipelined groups."""
    stack = make_stack(models["target"], "ngram", smollm2_tokenizer, CHAIN, overlap="groups")

    async def run() -> None:
        await stack.scheduler.start()
        try:
            convs = [Conversation(stack, SamplingParams()) for _ in range(2)]
            for k in range(3):
                outs = await asyncio.gather(
                    *(c.fresh(_prompt(10 * i + k, 4), 6) for i, c in enumerate(convs))
                )
                turns = await asyncio.gather(
                    *(
                        collect(stack.scheduler, c.turn_request(_prompt(10 * i + k, 4), 6))
                        for i, c in enumerate(convs)
                    )
                )
                for c, i, expected, got in zip(convs, range(2), outs, turns, strict=True):
                    await c.session.ready.wait()
                    assert generated_ids(got) == generated_ids(expected)
                    c.tokens += _prompt(10 * i + k, 4) + generated_ids(got)
                    assert c.session.tokens == c.tokens
            for c in convs:
                await stack.scheduler.sessions.close(c.session.session_id)
        finally:
            await stack.scheduler.stop()

    asyncio.run(run())
    check_no_leaks(stack)


def test_seeded_sampling_turns_equal_fresh_requests_eagle3(models, smollm2_tokenizer):
    stack = make_stack(
        models["target"], "eagle3", smollm2_tokenizer, SpecParams(2, 1, 2), draft_dir=models["head"]
    )
    _run(stack, SamplingParams(temperature=4.0, seed=1234))


def test_guided_turns_equal_fresh_requests(models, smollm2_tokenizer) -> None:
    """Turns under a guide (allowed token ids; bad words, whose state reads the turn's own
    output from its start): each equals a fresh request of the whole conversation with it."""
    stack = make_stack(models["target"], "model", smollm2_tokenizer, CHAIN)
    fixed = FixedTokens(tuple(range(100, 160)), TINY_VOCAB)

    async def three_turns(conv: Conversation) -> None:
        first = await conv.fresh(_prompt(30, 5), 6)  # its tokens the bad words below
        words = [tuple(generated_ids(first)[:1]), tuple(generated_ids(first)[2:4])]
        await conv.turn(_prompt(30, 5), 6, guide=BadWords(words, TINY_VOCAB))
        await conv.turn(_prompt(31, 5), 6, guide=fixed)
        got = await conv.turn(_prompt(32, 5), 6, guide=BadWords(words, TINY_VOCAB))
        assert words[0][0] not in generated_ids(got)

    _run(stack, turns=three_turns)


def test_turns_under_logit_rules_equal_fresh_requests(models, smollm2_tokenizer) -> None:
    """A bias and the three penalties on every turn: each turn (its prompt the whole
    conversation, its output its own) equals a fresh request of the whole conversation with
    the same rules, token for token."""
    stack = make_stack(models["target"], "model", smollm2_tokenizer, CHAIN)
    rules = Penalties(bias=((7, 2.0),), presence=0.8, frequency=1.2, repetition=1.3)

    async def three_turns(conv: Conversation) -> None:
        for k in range(3):
            await conv.turn(_prompt(20 + k, 5), 6, penalties=rules)

    _run(stack, turns=three_turns)
