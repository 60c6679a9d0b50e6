"""A round's target features on their way to the drafter: the verifier's rows of the accepted
paths (`take_rows`), the gateway's rows from where the drafter's features end (one chunk as a
view, several joined), and `HostRows.join`, which puts the drafter's per-sequence host rows on
the device in one copy (tests/gpu/test_host_rows_gpu.py runs it on a GPU, through its pinned
buffer)."""

from __future__ import annotations

import pytest
import torch

from gateway.request import GenerationRequest
from gateway.sequence import Sequence
from specsplit.messages import SpecParams
from specsplit.model.batch import HostRows, take_rows


def parts(dtype: torch.dtype, sizes: tuple[int, ...], width: int = 24) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(sizes))
    return [torch.randn(n, width, generator=gen).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_rows_join_is_the_rows_in_order(dtype: torch.dtype) -> None:
    rows = parts(dtype, (2, 1, 4))
    joined = HostRows().join(rows, torch.device("cpu"))
    assert joined.dtype == dtype
    assert torch.equal(joined, torch.cat(rows))


def _sequence_with_chunks(sizes: list[int], width: int = 6) -> Sequence:
    request = GenerationRequest(list(range(100, 110)), max_new_tokens=8)
    seq = Sequence("s", request, SpecParams(3, 1, 3), stop_checker=None)  # type: ignore[arg-type]
    seq.hidden_state_layers = (1, 2, 3)
    start = 0
    for n in sizes:  # chunk k: rows for tokens [start, start + n), each row filled with its token
        seq.hidden_states.append(torch.arange(start, start + n)[:, None].repeat(1, width).float())
        start += n
    seq.verifier_kv_committed_len = start
    return seq


@pytest.mark.parametrize(
    ("sizes", "start"), [([7], 4), ([5, 2], 5), ([5, 2], 6), ([5, 2], 3), ([4, 2, 1], 1)]
)
def test_gateway_sends_the_rows_from_the_drafters_start(sizes: list[int], start: int) -> None:
    seq = _sequence_with_chunks(sizes)
    rows = seq._hidden_rows_from(start)
    assert rows is not None
    assert rows[:, 0].tolist() == list(range(start, sum(sizes)))


def test_gateway_rows_within_the_last_chunk_are_a_view_of_it() -> None:
    seq = _sequence_with_chunks([5, 3])
    rows = seq._hidden_rows_from(6)
    assert rows is not None and rows.data_ptr() == seq.hidden_states[-1][1:].data_ptr()


def test_gateway_counts_its_feature_rows_through_appends_truncations_and_new_lists() -> None:
    """num_feature_rows counts only the chunks appended since it last counted (a round's commit
    reads it: summing the whole history each round grew with the sequence's length)."""
    seq = _sequence_with_chunks([4, 2])
    assert seq.num_feature_rows == 6
    seq.hidden_states.append(torch.zeros(3, 6))  # a round's chunk
    assert seq.num_feature_rows == 9
    seq.keep_verifier_kv(5)  # truncated: a new, shorter list
    assert seq.num_feature_rows == 5
    seq.hidden_states.append(torch.zeros(2, 6))
    assert seq.num_feature_rows == 7
    seq.forget_verifier()
    assert seq.num_feature_rows == 0
    seq.hidden_states = [torch.zeros(1, 6)]  # a session's turn takes another list
    assert seq.num_feature_rows == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64])
def test_take_rows_is_index_select(dtype: torch.dtype) -> None:
    host = (100 * torch.randn(9, 5, generator=torch.Generator().manual_seed(3))).to(dtype)
    rows = [0, 4, 4, 8, 2]
    picked = take_rows(host, rows)
    assert picked.dtype == dtype
    assert torch.equal(picked, host.index_select(0, torch.tensor(rows)))
    assert torch.equal(take_rows(host[:, 1:], rows), host[:, 1:][rows])  # strided rows too
