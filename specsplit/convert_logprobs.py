"""A Verify round's log-probabilities on the wire (VerifyRequest.logprobs, VerifyResponse's
logprob columns; specsplit/convert.py calls these): columns left empty when no sequence asks."""

from __future__ import annotations

from typing import Any

from specsplit.errors import invalid
from specsplit.messages import NO_LOGPROBS, TokenLogprobs, VerifyInput, VerifyOutput
from specsplit.wire_columns import column_of, split_flat


def fill_asks(msg: Any, inputs: list[VerifyInput]) -> None:
    """VerifyRequest.logprobs, where any sequence asks."""
    if any(item.logprobs != NO_LOGPROBS for item in inputs):
        msg.logprobs.extend([item.logprobs for item in inputs])


def read_asks(msg: Any, inputs: list[VerifyInput]) -> None:
    """Each input's logprobs from VerifyRequest.logprobs (range checks are the verifier's)."""
    asks = column_of(msg.logprobs, len(inputs), "logprobs", default=NO_LOGPROBS)
    for item, asked in zip(inputs, asks, strict=True):
        item.logprobs = asked


def fill_logprobs(msg: Any, outputs: list[VerifyOutput]) -> None:
    """VerifyResponse's logprob columns, where any sequence has log-probabilities."""
    if all(out.logprobs is None for out in outputs):
        return
    for out in outputs:
        lp = out.logprobs
        if lp is None:
            msg.num_logprobs.append(-1)
            msg.num_top_logprobs.append(0)
            continue
        assert len(lp) == len(out.new_tokens), (out.seq_id, len(lp), len(out.new_tokens))
        width = len(lp.top_ids[0]) if lp.top_ids else 0
        msg.num_logprobs.append(len(lp))
        msg.num_top_logprobs.append(width)
        msg.token_logprobs.extend(lp.logprobs)
        for ids, values in zip(lp.top_ids, lp.top_logprobs, strict=True):
            msg.top_logprob_ids.extend(ids)
            msg.top_logprobs.extend(values)


def read_logprobs(msg: Any, outputs: list[VerifyOutput]) -> None:
    """Each output's log-probabilities from VerifyResponse's logprob columns (none: empty)."""
    n = len(outputs)
    counts = column_of(msg.num_logprobs, n, "num_logprobs", default=-1)
    widths = column_of(msg.num_top_logprobs, n, "num_top_logprobs", default=0)
    if any(w < 0 for w in widths):
        raise invalid("num_top_logprobs: a sequence's count is negative")
    asked = [max(c, 0) for c in counts]
    chosen = split_flat(msg.token_logprobs, asked, "token_logprobs", "num_logprobs")
    tops = [c * w for c, w in zip(asked, widths, strict=True)]
    top_ids = split_flat(msg.top_logprob_ids, tops, "top_logprob_ids", "num_top_logprobs")
    top_values = split_flat(msg.top_logprobs, tops, "top_logprobs", "num_top_logprobs")
    for out, count, width, values, ids, tops_of in zip(
        outputs, counts, widths, chosen, top_ids, top_values, strict=True
    ):
        if count < 0:
            continue
        if count != len(out.new_tokens):
            raise invalid(f"num_logprobs = {count} for {len(out.new_tokens)} new tokens")
        out.logprobs = TokenLogprobs(
            list(values),
            [ids[i * width : (i + 1) * width] for i in range(count)],
            [tops_of[i * width : (i + 1) * width] for i in range(count)],
        )
