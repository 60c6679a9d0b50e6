"""A round's long runs of pending tokens led in ahead of it (a prompt longer than the largest
prefill graph, a resumed sequence's tokens since its features): on a GPU a run that no captured
graph holds took the whole round off the graphs, onto the host-bound eager forward (SmolLM2:
~20-40 ms a step whatever its tokens, against ~0.5 ms a replay). Here its first tokens run
before the round in chunks of the largest captured q (a few sequences at once, each chunk a
prefill graph's replay, the last one maybe short), their K/V committed as they go (pending
tokens are the sequence's own, never rejected), so that the round itself brings at most one
chunk of them. Chunks draw nothing: the round's acceptance, sampling and bonus token are the
same. The hidden-state rows of a sequence that asks for them come back before its round's rows
(`VerifyOutput.hidden_states`: every pending token's, then the accepted path's). Whether it
pays is weighed as graph parts are (`CudaGraphRunner.parts_pay`)."""

from __future__ import annotations

import dataclasses

from specsplit.messages import NO_LOGPROBS, VerifyInput

# the smallest chunk a lead-in takes: the prefill graphs' (verifier/warmup.py
# PREFILL_QUERY_LENS); below it the largest captured q is a verify round's (17), and its chunks
# would be many
MIN_LEAD_Q = 32


def lead_len(item: VerifyInput, q: int) -> int:
    """How many of `item`'s pending tokens lead in (chunks of `q`, the last one maybe short):
    enough that the round brings at most `q` new tokens (pending and tree), never its last
    pending token (the root, whose logits the round reads); 0 where it fits or cannot, or where
    the round reads every pending token's logits (prompt_logprobs)."""
    p, n = len(item.pending_tokens), len(item.tree)
    if p + n <= q or item.prompt_logprobs != NO_LOGPROBS:  # (those read every pending row)
        return 0
    m = min(-(-(p + n - q) // q) * q, p - 1)
    return m if p + n - m <= q else 0


def round_news(items: list[VerifyInput], leads: list[int]) -> list[int]:
    """Each item's new tokens in its round (pending and tree) past the `leads` led in."""
    return [len(i.pending_tokens) + len(i.tree) - m for i, m in zip(items, leads, strict=True)]


def lead_waves(leads: list[int], q: int, most: int) -> list[list[int]]:
    """The forwards that lead in `leads` (positions of the items with a lead), chunk by chunk:
    each forward one chunk of at most `most` sequences (a prefill graph's largest bucket)."""
    waves = []
    for start in range(0, max(leads, default=0), q):
        wave = [i for i, m in enumerate(leads) if m > start]
        waves += [wave[k : k + most] for k in range(0, len(wave), most)]
    return waves


def led_in(item: VerifyInput, m: int) -> VerifyInput:
    """`item` once its first `m` pending tokens are committed: the round that follows them."""
    if m == 0:
        return item
    return dataclasses.replace(
        item,
        begin=False,
        kv_committed_len=item.kv_committed_len + m,
        pending_tokens=item.pending_tokens[m:],
    )
