"""An EAGLE drafter's per-sequence target features grow by amortised appends (not a copy of the
whole history every round) and truncate by length, holding exactly the rows appended."""

from __future__ import annotations

import torch

from drafter.eagle_proposer import EagleSeqState
from specsplit.kv_cache import SeqKV


def test_features_append_truncate_and_regrow_hold_the_rows_appended() -> None:
    state = EagleSeqState(SeqKV(page_size=16), feature_buffer=torch.zeros(0, 3))
    gen = torch.Generator().manual_seed(0)
    expected = torch.zeros(0, 3)
    buffers = set()
    for round_index in range(200):
        rows = torch.randn(1 + round_index % 3, 3, generator=gen)
        state.append_features(rows)
        expected = torch.cat([expected, rows])
        buffers.add(state.feature_buffer.data_ptr())
        if round_index % 50 == 49:  # the gateway's tokens were cut back (a stop point, a fault)
            keep = expected.shape[0] - 5
            state.num_features = min(state.num_features, keep)
            expected = expected[:keep]
        assert torch.equal(state.features, expected)
    assert len(buffers) <= 6  # 64, 128, 256, 512 rows: a handful of reallocations for ~400 rows
