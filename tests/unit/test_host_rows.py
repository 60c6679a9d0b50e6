"""A round's target features on their way to the drafter: the verifier's rows of the accepted
paths (`take_rows`), the gateway's count of the rows it has had (tests/unit/test_gateway_features.py
has the rows it sends), and `HostRows.join`, which puts the drafter's per-sequence host rows on
the device in one copy (tests/gpu/test_host_rows_gpu.py runs it on a GPU, through its pinned
buffer)."""

from __future__ import annotations

import pytest
import torch

from gateway.features import FeatureRows
from gateway.request import GenerationRequest
from gateway.sequence import Sequence
from specsplit.messages import SpecParams
from specsplit.model.transfer import HostRows, join_rows, take_rows


def parts(dtype: torch.dtype, sizes: tuple[int, ...], width: int = 24) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(sizes))
    return [torch.randn(n, width, generator=gen).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_rows_join_is_the_rows_in_order(dtype: torch.dtype) -> None:
    rows = parts(dtype, (2, 1, 4))
    joined = HostRows().join(rows, torch.device("cpu"))
    assert joined.dtype == dtype
    assert torch.equal(joined, torch.cat(rows))


def test_gateway_counts_its_feature_rows_through_appends_truncations_and_new_holders() -> None:
    """num_feature_rows (read at every round's commit) follows appends, truncations, a lost
    verifier and a session's turn taking another holder, without summing the history."""
    request = GenerationRequest(list(range(100, 110)), max_new_tokens=8)
    seq = Sequence("s", request, SpecParams(3, 1, 3), stop_checker=None)  # type: ignore[arg-type]
    seq.hidden_state_layers = (1, 2, 3)
    for n in (4, 2):
        seq.features.append(torch.zeros(n, 6))
    seq.verifier_kv_committed_len = 6
    assert seq.num_feature_rows == 6
    seq.features.append(torch.zeros(3, 6))  # a round's chunk
    assert seq.num_feature_rows == 9
    seq.verifier_kv_committed_len = 9
    seq.keep_verifier_kv(5)  # truncated
    assert seq.num_feature_rows == 5
    seq.features.append(torch.zeros(2, 6))
    assert seq.num_feature_rows == 7
    seq.forget_verifier()
    assert seq.num_feature_rows == 0
    seq.features = FeatureRows()  # a session's turn takes another holder
    seq.features.append(torch.zeros(1, 6))
    assert seq.num_feature_rows == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64])
def test_take_rows_is_index_select(dtype: torch.dtype) -> None:
    host = (100 * torch.randn(9, 5, generator=torch.Generator().manual_seed(3))).to(dtype)
    rows = [0, 4, 4, 8, 2]
    picked = take_rows(host, rows)
    assert picked.dtype == dtype
    assert torch.equal(picked, host.index_select(0, torch.tensor(rows)))
    assert torch.equal(take_rows(host[:, 1:], rows), host[:, 1:][rows])  # strided rows too


def test_join_rows_of_one_answer_split_in_order_is_a_view_of_it() -> None:
    """One answer's rows, split per sequence and joined again in the same order (the gateway
    sending the verifier's rows on to the drafter), are the answer itself: no copy."""
    answer = torch.randn(9, 4).to(torch.bfloat16)
    joined = join_rows(list(answer.split([2, 0, 4, 3])))
    assert joined.data_ptr() == answer.data_ptr() and torch.equal(joined, answer)
    reordered = list(answer.split([2, 4, 3]))[::-1]
    copied = join_rows(reordered)
    assert copied.data_ptr() != answer.data_ptr()
    assert torch.equal(copied, torch.cat(reordered))
    skipping = [answer[:2], answer[3:5]]  # a row left out between them
    assert torch.equal(join_rows(skipping), torch.cat(skipping))
    raw = bytearray(torch.randn(16).numpy().tobytes())  # two storages, one after the other
    first = torch.frombuffer(raw, dtype=torch.float32, count=8).reshape(2, 4)
    second = torch.frombuffer(raw, dtype=torch.float32, count=8, offset=32).reshape(2, 4)
    assert second.data_ptr() == first.data_ptr() + 32
    apart = join_rows([first, second])  # not a view past the first one's storage
    assert apart.data_ptr() != first.data_ptr()
    assert torch.equal(apart, torch.cat([first, second]))


def test_join_rows_refuses_mixed_widths_and_dtypes() -> None:
    with pytest.raises(ValueError, match="one width and dtype"):
        join_rows([torch.zeros(2, 4), torch.zeros(1, 5)])
    with pytest.raises(ValueError, match="one width and dtype"):
        join_rows([torch.zeros(2, 4), torch.zeros(1, 4, dtype=torch.bfloat16)])
