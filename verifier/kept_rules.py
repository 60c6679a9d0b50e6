"""Each sequence's logit rules kept on the verifier between rounds (`VerifierSeq.rules`): a
round's commit leaves its rules through the tokens it appended (`keep_rules`, `LogitRules.after`),
and the next round whose rules read that same context takes the kept ones (`take_kept_rules`),
whose checks are done and whose arrays are made. The gateway sends the whole context on a
sequence's first round with rules (and after a re-prefill), then only says the verifier keeps it
(`LogitRules.kept`, the output's length: SequenceRules.kept on the wire; FAILED_PRECONDITION
where the verifier has no such context, and the gateway sends it); the verifier reads and
checks a context once, not every round (~0.1 ms a sequence with a 512-token prompt and a few
hundred distinct output tokens, bench/RESULTS.md). The kept rules are taken only where they are
equal to the context sent, or the same length of output where only that is sent."""

from __future__ import annotations

from specsplit.errors import Code, ServiceError
from specsplit.messages import VerifyInput
from verifier.rounds import VerifierSeq
from verifier.rule_rows import drop_slot


def take_kept_rules(inputs: list[VerifyInput], seqs: dict[str, VerifierSeq]) -> None:
    """Each input (not a first round) whose rules read its sequence's kept context, or say
    they do (`LogitRules.kept`: the wire then carries no context), takes the kept rules (with
    its own guide masks, checked each round). FAILED_PRECONDITION where rules say so and the
    verifier keeps no such context (nothing of the round has happened): the gateway then sends
    the round again with every sequence's context."""
    for item in inputs:
        rules = item.rules
        if rules is None:
            continue
        seq = None if item.begin else seqs.get(item.seq_id)
        kept = None if seq is None else seq.rules
        if rules.kept >= 0:
            if kept is None or kept.total != rules.kept:
                held = "none" if kept is None else f"an output of {kept.total}"
                raise ServiceError(
                    Code.FAILED_PRECONDITION,
                    f"sequence {item.seq_id!r}: its logit rules' context of an output of "
                    f"{rules.kept} tokens is not kept here ({held}): send it",
                )
            item.rules = kept.with_allowed(rules.allowed)
        elif kept is not None and kept is not rules and kept.same_context(rules):
            item.rules = kept.with_allowed(rules.allowed)


def keep_rules(item: VerifyInput, seq: VerifierSeq, appended: list[int]) -> None:
    """After `item`'s round committed `appended` (its accepted drafts and bonus token) to
    `seq`: the rules of its next round (none without penalties that change something; a
    guide's masks are the gateway's to send)."""
    rules = item.rules  # (none for a guide alone, whose context nothing reads)
    kept = None
    if rules is not None and rules.penalties.active:
        kept = rules.with_allowed(None).after(appended)
        # (min_tokens reached and nothing else: no rules, as the gateway sends then)
        kept = kept if kept.penalties.active else None
    seq.rules = kept
    # its rows on the device follow (the next bending counts `appended` in), or are given back
    slot = seq.rule_slot
    if slot is not None and (kept is None or rules is None or not slot.keep(rules, appended, kept)):
        drop_slot(seq)
