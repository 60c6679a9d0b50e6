"""Draft supports held ragged (each row at its own width, as the wire carries them) act as
their padded form: split, joined, cut and written out alike, and a round's rows cross the
gateway without ever being padded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit import convert
from specsplit.messages import DraftOutput, VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftProbs, DraftTree

VOCAB = 50


def _padded(widths: list[int], k: int = 8) -> DraftProbs:
    """Rows holding their kept tokens first, 0 past each row's width."""
    gen = torch.Generator().manual_seed(len(widths))
    probs = torch.zeros(len(widths), k)
    tokens = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in widths])
    for row, width in enumerate(widths):
        probs[row, :width] = torch.rand(width, generator=gen) + 0.1
    return DraftProbs(tokens, probs / probs.sum(dim=1, keepdim=True).clamp(min=1e-9), VOCAB)


def test_ragged_rows_split_join_and_cut_as_their_padded_ones() -> None:
    padded = _padded([2, 5, 1, 8, 3, 0])
    ragged = padded.as_ragged()
    assert not ragged.padded and len(ragged) == 6 and ragged.width == 8
    assert list(ragged.flat().widths) == [2, 5, 1, 8, 3, 0]
    torch.testing.assert_close(ragged.dense(), padded.dense())
    counts = [2, 0, 3, 1]
    parts = ragged.split(counts)
    assert not any(part.padded for part in parts) and [len(p) for p in parts] == counts
    for got, want in zip(parts, padded.split(counts), strict=True):
        torch.testing.assert_close(got.dense(), want.dense())
    joined = DraftProbs.cat(ragged.split(counts))
    assert not joined.padded
    torch.testing.assert_close(joined.dense(), padded.dense())
    for keep in (slice(1, 4), slice(0, 0), slice(3, None), [0, 3, 5]):
        torch.testing.assert_close(ragged.rows(keep).dense(), padded.rows(keep).dense())
    never_cut = _padded([2, 5, 1, 8, 3, 0]).rows(slice(2, 5))
    mixed = DraftProbs.cat([parts[0], never_cut])  # padded to the widest
    assert mixed.padded and mixed.probs.shape == (5, 8)
    torch.testing.assert_close(mixed.dense(), padded.rows([0, 1, 2, 3, 4]).dense())


def test_rows_written_out_ragged_match_their_padded_form() -> None:
    """`fill` writes each row into its first columns and leaves the rest of the zeros."""
    padded = _padded([3, 1, 6])
    want_t, want_p = np.zeros((3, 10)), np.zeros((3, 10))
    got_t, got_p = np.zeros((3, 10)), np.zeros((3, 10))
    padded.fill(want_t, want_p)
    padded.as_ragged().fill(got_t, got_p)
    kept = want_p != 0
    assert np.array_equal(kept, got_p != 0) and np.array_equal(want_t[kept], got_t[kept])
    np.testing.assert_allclose(got_p, want_p)


@pytest.mark.filterwarnings("error")  # e.g. torch over the message's read-only bytes
def test_a_gateway_passes_a_rounds_draft_rows_on_without_padding_them() -> None:
    """The drafter's answer read, its trees sent on in a Verify and read by the verifier: the
    rows are never padded on the way (nor copied out of the messages' bytes, read-only), and
    arrive with the distributions the drafter drew."""
    sampled = SamplingParams(temperature=0.7, seed=1)
    trees = [
        DraftTree([1, 2, 3], [-1, 0, 1], _padded(w).as_ragged()) for w in ([2, 5, 1], [4, 4, 8])
    ]
    answer = convert.draft_response_to_proto(
        [DraftOutput(f"s{i}", tree, 3, ()) for i, tree in enumerate(trees)], draft_ns=1
    )
    read = convert.draft_response_from_proto(answer)
    got = [item.tree.draft_probs for item in read]
    assert all(probs is not None and not probs.padded for probs in got)
    request = convert.verify_request_to_proto(
        [VerifyInput(item.seq_id, False, 3, [2], item.tree, sampled) for item in read]
    )
    assert all(probs is not None and not probs.padded for probs in got)
    verified = convert.verify_request_from_proto(request)
    for item, tree in zip(verified, trees, strict=True):
        assert item.tree.draft_probs is not None and tree.draft_probs is not None
        torch.testing.assert_close(item.tree.draft_probs.dense(), tree.draft_probs.dense())
