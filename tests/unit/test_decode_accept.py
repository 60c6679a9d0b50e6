"""A greedy round without trees skips the acceptance's host array and graph
(`verifier.round_accept.decode_accept`): each sequence's bonus token is its row's argmax, as the
full path gives, ties to the first; anything else takes the full path."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from specsplit.kv_cache import KVCache
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from verifier.round_accept import queue_accept, queue_full_accept
from verifier.rounds import VerifierSeq, decode_step

VOCAB = 50


Round = tuple[KVCache, list[VerifierSeq], list[VerifyInput]]


@pytest.fixture
def make_round() -> Iterator[Callable[..., Round]]:
    """Rounds of one-token steps at length 5 (tree: each sequence's instead), their pages
    given back after the test."""
    made: list[Round] = []

    def make(num_seqs: int, sampling: SamplingParams, tree: DraftTree | None = None) -> Round:
        kv = KVCache(2, 1, 4, 64, 4, torch.float32, "cpu")
        seqs, inputs = [], []
        for b in range(num_seqs):
            seq = VerifierSeq(f"s{b}", kv.new_seq())
            kv.add_pages(seq.kv, kv.num_new_pages(seq.kv, 8))
            seq.kv.kv_committed_len = 5
            item = decode_step(seq.seq_id, 5, 3, sampling)
            if tree is not None:
                item.tree = tree
            seqs.append(seq)
            inputs.append(item)
        made.append((kv, seqs, inputs))
        return kv, seqs, inputs

    yield make
    for kv, seqs, _ in made:
        for seq in seqs:
            kv.release(seq.kv)


def _table(seqs: list[VerifierSeq]) -> torch.Tensor:
    table = torch.zeros((len(seqs), 4), dtype=torch.int32)
    for b, seq in enumerate(seqs):
        table[b, : len(seq.kv.page_table)] = torch.tensor(seq.kv.page_table)
    return table


def _queue(kv, seqs, inputs, logits, rows, full=False):
    """The round's acceptance as the engine queues it (full: the way any round takes, given
    a greedy round's argmax as queue_accept gives it)."""
    if full:
        argmax = logits.argmax(dim=-1) if all(i.sampling.greedy for i in inputs) else None
        args = (inputs, seqs, logits, rows, _table(seqs), kv, VOCAB, None, None, argmax)
        return queue_full_accept(*args)
    return queue_accept(inputs, seqs, logits, rows, _table(seqs), kv, VOCAB, None)


def _refuse(*_: object) -> torch.Tensor:
    raise AssertionError("decode_accept called")


@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_decode_steps_bonus_is_each_rows_argmax_as_the_full_path(
    make_round: Callable[..., Round], num_seqs: int
) -> None:
    torch.manual_seed(num_seqs)
    kv, seqs, inputs = make_round(num_seqs, SamplingParams())
    logits = torch.randn(num_seqs + 2, VOCAB)  # (a graph's padded rows past the batch)
    logits[0, 7] = logits[0, 11] = logits[0].max() + 1  # a tie: the first wins
    rows = [range(b, b + 1) for b in range(num_seqs)]
    fast = _queue(kv, seqs, inputs, logits, rows)
    assert fast.tolist() == [[0, int(logits[b].argmax())] for b in range(num_seqs)]
    assert fast[0, 1] == 7
    assert torch.equal(fast, _queue(kv, seqs, inputs, logits, rows, full=True))


def test_a_round_with_a_tree_or_sampling_or_other_rows_takes_the_full_path(
    monkeypatch: pytest.MonkeyPatch, make_round: Callable[..., Round]
) -> None:
    monkeypatch.setitem(queue_accept.__globals__, "decode_accept", _refuse)
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    kv, seqs, inputs = make_round(2, SamplingParams(), DraftTree([4], [-1]))
    _queue(kv, seqs, inputs, logits, [range(0, 2), range(2, 4)])
    kv, seqs, inputs = make_round(1, SamplingParams(temperature=1.0, seed=3))
    _queue(kv, seqs, inputs, logits, [range(0, 1)])
    kv, seqs, inputs = make_round(2, SamplingParams())
    out = _queue(kv, seqs, inputs, logits, [range(1, 2), range(3, 4)])
    assert out[:, 1].tolist() == [int(logits[1].argmax()), int(logits[3].argmax())]
