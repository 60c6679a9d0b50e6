"""A Verify round's log-probabilities on the wire (VerifyRequest.logprobs, VerifyResponse's
logprob columns; specsplit/convert.py calls these): columns left empty when no sequence asks."""

from __future__ import annotations

from typing import Any

from specsplit.errors import invalid
from specsplit.messages import NO_LOGPROBS, TokenLogprobs, VerifyInput, VerifyOutput
from specsplit.wire_columns import column_of, split_flat

_ASKS = ("logprobs", "prompt_logprobs")  # VerifyRequest's columns and VerifyInput's fields


def fill_asks(msg: Any, inputs: list[VerifyInput]) -> None:
    """VerifyRequest.logprobs and .prompt_logprobs, each where any sequence asks."""
    for name in _ASKS:
        asks = [getattr(item, name) for item in inputs]
        if any(asked != NO_LOGPROBS for asked in asks):
            getattr(msg, name).extend(asks)


def read_asks(msg: Any, inputs: list[VerifyInput]) -> None:
    """Each input's logprobs and prompt_logprobs from VerifyRequest's (range checks are the
    verifier's)."""
    for name in _ASKS:
        asks = column_of(getattr(msg, name), len(inputs), name, default=NO_LOGPROBS)
        for item, asked in zip(inputs, asks, strict=True):
            setattr(item, name, asked)


def fill_logprobs(msg: Any, outputs: list[VerifyOutput]) -> None:
    """VerifyResponse's logprob columns (the new tokens'), and its prompt_logprobs columns,
    each where any sequence has them."""
    _fill(msg, [out.logprobs for out in outputs], [len(out.new_tokens) for out in outputs])
    prompt = [out.prompt_logprobs for out in outputs]
    if any(lp is not None for lp in prompt):
        _fill(msg.prompt_logprobs, prompt, None)


def _fill(msg: Any, asked: list[TokenLogprobs | None], counts: list[int] | None) -> None:
    """Log-probability columns (VerifyResponse's, or a LogprobColumns) of each sequence's
    TokenLogprobs (None: it did not ask); `counts`: each one's tokens, checked."""
    if all(lp is None for lp in asked):
        return
    for i, lp in enumerate(asked):
        if lp is None:
            msg.num_logprobs.append(-1)
            msg.num_top_logprobs.append(0)
            continue
        assert counts is None or len(lp) == counts[i], (i, len(lp), counts[i])
        width = len(lp.top_ids[0]) if lp.top_ids else 0
        msg.num_logprobs.append(len(lp))
        msg.num_top_logprobs.append(width)
        msg.token_logprobs.extend(lp.logprobs)
        for ids, values in zip(lp.top_ids, lp.top_logprobs, strict=True):
            msg.top_logprob_ids.extend(ids)
            msg.top_logprobs.extend(values)


def read_logprobs(msg: Any, outputs: list[VerifyOutput]) -> None:
    """Each output's log-probabilities from VerifyResponse's logprob columns (none: empty), and
    its prompt's from its prompt_logprobs columns."""
    counts = [len(out.new_tokens) for out in outputs]
    for out, lp in zip(outputs, _read(msg, len(outputs), counts), strict=True):
        out.logprobs = lp
    if msg.HasField("prompt_logprobs"):
        for out, lp in zip(outputs, _read(msg.prompt_logprobs, len(outputs), None), strict=True):
            out.prompt_logprobs = lp


def _read(msg: Any, n: int, expected: list[int] | None) -> list[TokenLogprobs | None]:
    """Each of n sequences' TokenLogprobs from log-probability columns (None: it did not ask);
    `expected`: each one's tokens, checked."""
    counts = column_of(msg.num_logprobs, n, "num_logprobs", default=-1)
    widths = column_of(msg.num_top_logprobs, n, "num_top_logprobs", default=0)
    if any(w < 0 for w in widths):
        raise invalid("num_top_logprobs: a sequence's count is negative")
    asked = [max(c, 0) for c in counts]
    chosen = split_flat(msg.token_logprobs, asked, "token_logprobs", "num_logprobs")
    tops = [c * w for c, w in zip(asked, widths, strict=True)]
    top_ids = split_flat(msg.top_logprob_ids, tops, "top_logprob_ids", "num_top_logprobs")
    top_values = split_flat(msg.top_logprobs, tops, "top_logprobs", "num_top_logprobs")
    read: list[TokenLogprobs | None] = []
    for k, (count, width, values, ids, tops_of) in enumerate(
        zip(counts, widths, chosen, top_ids, top_values, strict=True)
    ):
        if count < 0:
            read.append(None)
            continue
        if expected is not None and count != expected[k]:
            raise invalid(f"num_logprobs = {count} for {expected[k]} new tokens")
        read.append(
            TokenLogprobs(
                list(values),
                [ids[i * width : (i + 1) * width] for i in range(count)],
                [tops_of[i * width : (i + 1) * width] for i in range(count)],
            )
        )
    return read
