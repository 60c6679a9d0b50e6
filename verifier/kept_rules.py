"""Each sequence's logit rules kept on the verifier between rounds (`VerifierSeq.rules`): a
round's commit leaves its rules through the tokens it appended (`keep_rules`, `LogitRules.after`),
and the next round whose rules read that same context takes the kept ones (`take_kept_rules`),
whose checks are done and whose arrays are made: the gateway still sends the whole context each
round, but the verifier reads and checks it once, not every round (~0.1 ms a sequence with a
512-token prompt and a few hundred distinct output tokens, bench/RESULTS.md). The kept rules are
taken only where they are equal, so they change no output."""

from __future__ import annotations

from specsplit.messages import VerifyInput
from verifier.rounds import VerifierSeq


def take_kept_rules(inputs: list[VerifyInput], seqs: dict[str, VerifierSeq]) -> None:
    """Each input (not a first round) whose rules read its sequence's kept context takes the
    kept rules (with its own guide masks, checked each round)."""
    for item in inputs:
        rules = item.rules
        if rules is None or item.begin:
            continue
        seq = seqs.get(item.seq_id)
        kept = None if seq is None else seq.rules
        if kept is not None and kept is not rules and kept.same_context(rules):
            item.rules = kept.with_allowed(rules.allowed)


def keep_rules(item: VerifyInput, seq: VerifierSeq, appended: list[int]) -> None:
    """After `item`'s round committed `appended` (its accepted drafts and bonus token) to
    `seq`: the rules of its next round (none without rules; a guide's masks are the
    gateway's to send)."""
    rules = item.rules
    seq.rules = None if rules is None else rules.with_allowed(None).after(appended)
