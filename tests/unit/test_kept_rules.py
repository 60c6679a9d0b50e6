"""Logit rules kept on the verifier between rounds (verifier/kept_rules.py): a round's commit
keeps its sequence's next rules; the next round whose rules read that same context takes them
(checked once, their arrays made once) and commits exactly the target's greedy tokens under the
rules; a round whose context differs is bent and checked by what it sent; a guide's masks come
with each round and are checked each time; the kept rules go with the sequence."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specsplit.convert import verify_request_from_proto, verify_request_to_proto
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import (
    MAX_APPENDED,
    Allowed,
    LogitRules,
    Penalties,
    bend_row,
    distinct,
    mask_words,
    round_rules,
    start_context,
)
from specsplit.messages import VerifyInput
from specsplit.tree import DraftTree
from tests.rules_reference import rules_for
from tests.support import TINY_VOCAB
from tests.unit.test_verify_logprobs import (  # noqa: F401  (fixtures)
    PROMPT,
    _engine,
    device,
    reference,
    target_dir,
)
from tests.unit.test_verify_rules import NUM_TOKENS, STRONG, _rules, truth  # noqa: F401


def test_rounds_take_the_rules_their_commit_kept(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
    truth: list[int],  # noqa: F811
) -> None:
    """Each round's rules (new objects, as the wire makes them) read the context the round
    before kept: the round takes the kept rules, and commits the target's greedy tokens under
    the rules (trees of right tokens and a wrong one)."""
    engine = _engine(target_dir, device)
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []))
    got = [engine.verify([first])[0].bonus_token]
    while len(got) < NUM_TOKENS:
        kept, sent = engine.seqs["s"].rules, _rules(STRONG, got)
        assert kept is not None and kept == sent and kept is not sent
        assert kept.checked_for == TINY_VOCAB  # (no checks again)
        k = len(got)
        tree = DraftTree([truth[k], truth[k + 1], (truth[k + 2] + 1) % TINY_VOCAB], [-1, 0, 1])
        item = VerifyInput("s", False, len(PROMPT) + k - 1, got[-1:], tree, rules=sent)
        got += engine.verify([item])[0].new_tokens
        assert item.rules is kept
    assert got[:NUM_TOKENS] == truth[:NUM_TOKENS]
    engine.release(["s"])
    assert "s" not in engine.seqs and engine.num_pages_used == 0


def test_a_round_whose_context_differs_is_bent_by_what_it_sent(
    target_dir: Path,  # noqa: F811
    reference: LlamaForCausalLM,  # noqa: F811
    device: str,  # noqa: F811
) -> None:
    """Rules whose output is not the one the verifier kept (the kept rules' greedy token twice
    more) are the round's, checked as sent: the bonus token is the greedy one under them, not
    under the kept; malformed ones are refused though the sequence has rules kept."""
    engine = _engine(target_dir, device)
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []))
    got = [engine.verify([first])[0].bonus_token]
    kept = engine.seqs["s"].rules
    assert kept is not None
    bad = LogitRules(STRONG, kept.output, (0,) * len(kept.counts), kept.prompt)
    item = VerifyInput("s", False, len(PROMPT), got, DraftTree(), rules=bad)
    with pytest.raises(ServiceError) as err:
        engine.verify([item])
    assert err.value.code == Code.INVALID_ARGUMENT
    with torch.no_grad():
        row = reference(torch.tensor([PROMPT + got])).logits[0, -1].float()
    top = int(bend_row(row, kept, []).argmax())  # the greedy token under the kept rules
    other = _rules(STRONG, [*got, top, top])  # (an output that penalises it)
    assert other is not None and not other.same_context(kept)
    item = VerifyInput("s", False, len(PROMPT), got, DraftTree(), rules=other)
    bonus = engine.verify([item])[0].bonus_token
    assert item.rules is other
    assert bonus == int(bend_row(row, other, []).argmax()) != top
    engine.release(["s"])


def test_context_is_checked_once_and_a_guides_masks_every_round() -> None:
    """`validate` checks a context once for a vocabulary (`after` and `with_allowed` carry that
    on; `with_allowed` the arrays too, `after` none: the verifier keeps the counts on the device
    and makes arrays only to fill them again); a guide's masks are checked each round, a kept
    context's too."""
    rules = _rules(STRONG, [4, 9, 9])
    assert rules is not None and rules.checked_for is None
    rules.validate(TINY_VOCAB, 1)
    assert rules.checked_for == TINY_VOCAB
    after = rules.after([5])
    assert after.checked_for == TINY_VOCAB and "arrays" not in after.__dict__
    with pytest.raises(ValueError, match="logit_bias"):
        after.validate(8, 1)  # (another vocabulary: checked again)
    nothing = Allowed(bytes(4 * mask_words(TINY_VOCAB)), (0,))  # a mask allowing no token
    after.arrays  # noqa: B018  (made, as where the verifier fills a sequence's rows)
    guided = after.with_allowed(nothing)
    assert guided.checked_for == TINY_VOCAB and guided.arrays is after.arrays
    assert guided.same_context(after) and guided != after
    with pytest.raises(ValueError, match="allowed_words"):
        guided.validate(TINY_VOCAB, 1)
    assert not after.same_context(replace(after, penalties=Penalties(presence=1.0)))


def test_the_gateways_rules_carried_through_commits_are_rules_for_the_whole_output() -> None:
    """`round_rules` on a context carried by `after` through each commit is `rules_for` on the
    whole output (the gateway's rules before: the output counted and sorted each round), with
    penalties or none, min_tokens reached or not, a guide's masks or none (a guide alone, or
    penalties that change nothing now, send no context)."""
    rng = random.Random(9)
    masks = Allowed(bytes([255]) * 4 * mask_words(TINY_VOCAB), (0,))
    kinds = [
        None,
        STRONG,
        Penalties(repetition=1.3),
        Penalties(min_tokens=4, stop_ids=(2,)),
        replace(STRONG, min_tokens=5, stop_ids=(1, 3)),
    ]
    for penalties in kinds:
        for allowed in (None, masks):
            prompt = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 12))]
            context, output = start_context(penalties, prompt), []
            for _ in range(8):
                counted = Counter(output if penalties is not None else ())  # (as it counted)
                want = rules_for(penalties, distinct(prompt), counted, allowed)
                if want is not None and not want.penalties.active:  # (no context read)
                    want = LogitRules(Penalties(), allowed=allowed)
                assert round_rules(context, allowed) == want
                kept = [rng.randrange(40) for _ in range(rng.randint(1, 3))]
                output += kept
                context = None if context is None else context.after(kept)


def test_rounds_that_say_their_context_is_kept_take_it(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
    truth: list[int],  # noqa: F811
) -> None:
    """After the first round the rules only say the context is kept (the output's length, no
    context on the wire): the rounds take the kept rules and commit the target's greedy tokens
    under them. A length the verifier does not keep, or a first round that says so, is
    FAILED_PRECONDITION (the gateway then sends the context), and changes nothing."""
    engine = _engine(target_dir, device)
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []))
    got = [engine.verify([first])[0].bonus_token]
    while len(got) < NUM_TOKENS:
        k = len(got)
        context = _rules(STRONG, got)
        assert context is not None
        tree = DraftTree([truth[k], truth[k + 1], (truth[k + 2] + 1) % TINY_VOCAB], [-1, 0, 1])
        item = VerifyInput(
            "s", False, len(PROMPT) + k - 1, got[-1:], tree, rules=context.kept_context()
        )
        msg = verify_request_to_proto([item])
        entry = msg.rules[0]
        assert entry.kept and entry.output_len == k
        assert not (entry.output_tokens or entry.prompt_tokens or entry.bias_tokens)
        (sent,) = verify_request_from_proto(msg)
        assert sent.rules == LogitRules(Penalties(), kept=k)
        got += engine.verify([sent])[0].new_tokens
        assert sent.rules == context  # (the kept context the round took)
    assert got[:NUM_TOKENS] == truth[:NUM_TOKENS]
    committed = len(PROMPT) + len(got) - 1
    wrong = [
        VerifyInput("s", False, committed, got[-1:], DraftTree(), rules=_said(len(got) + 1)),
        VerifyInput("t", True, 0, PROMPT, DraftTree(), rules=_said(0)),
    ]
    for item in wrong:
        with pytest.raises(ServiceError) as err:
            engine.verify([item])
        assert err.value.code == Code.FAILED_PRECONDITION and "not kept" in err.value.message
    assert "t" not in engine.seqs and engine.seqs["s"].kv.kv_committed_len == committed
    engine.release(["s"])
    assert engine.num_pages_used == 0


def _said(output_len: int) -> LogitRules:
    return LogitRules(Penalties(), kept=output_len)


def test_rules_that_change_nothing_more_are_not_kept(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
) -> None:
    """min_tokens alone, once the output holds that many tokens, changes nothing: the verifier
    keeps no rules (the gateway sends none then, and a step run ahead is taken as a plain one)."""
    engine = _engine(target_dir, device)
    penalties = Penalties(min_tokens=2, stop_ids=(1,))
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(penalties, []))
    got = [engine.verify([first])[0].bonus_token]
    assert engine.seqs["s"].rules == _rules(penalties, got)  # (one token: still held)
    item = VerifyInput("s", False, len(PROMPT), got, DraftTree(), rules=_rules(penalties, got))
    engine.verify([item])
    assert engine.seqs["s"].rules is None
    engine.release(["s"])


def test_after_appends_without_copying_the_output_until_it_is_read() -> None:
    """`after` is O(tokens appended): rules carried through 100 commits (up to 9 tokens each,
    read now and then) hold the whole output's counts whenever read, equal rules made
    eagerly, and compare and go over the wire as those do; read or not, `total` and
    min_tokens' release follow each commit; unread, rules stand on at most MAX_APPENDED
    `after`s before their output is made (the rules below let go); `with_allowed` leaves it
    unmade; the verifier's checks stay with them."""
    rng = random.Random(4)
    penalties = replace(STRONG, min_tokens=30, stop_ids=(1,))
    rules = start_context(penalties, [5, 9, 9])
    assert rules is not None
    rules.validate(TINY_VOCAB, 1)
    output: list[int] = []
    depth, made = 0, 0  # (afters since rules whose output was made; made by standing on them)
    for step in range(100):
        added = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(0, 9))]
        rules, output = rules.after(added), output + added
        assert rules.total == len(output) and rules.checked_for == TINY_VOCAB
        assert rules.penalties.min_tokens == (30 if len(output) < 30 else 0)
        depth += 1
        held = "output" in vars(rules)
        assert held == (depth == MAX_APPENDED)
        if held:  # (made once it stood on MAX_APPENDED afters: nothing below is held)
            assert "_appended" not in vars(rules)
            depth, made = 0, made + 1
        if step % 40 in (0, 1, 39):  # (read now and then, unread for 37 afters between)
            depth = 0  # (read below)
            guided = rules.with_allowed(Allowed(bytes(4 * mask_words(TINY_VOCAB)), (0,)))
            assert ("output" in vars(guided)) == held and guided.total == rules.total
            want = rules_for(penalties, distinct([5, 9, 9]), Counter(output))
            assert want is not None and rules == want and rules.same_context(want)
            assert guided.output == want.output and guided.counts == want.counts
            item = VerifyInput("s", False, 10, [4], DraftTree(), rules=rules)
            sent = verify_request_from_proto(verify_request_to_proto([item]))[0].rules
            assert sent is not None and sent.same_context(want)
    assert made == 2
