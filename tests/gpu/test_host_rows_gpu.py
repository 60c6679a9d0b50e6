"""`HostRows.join` on a GPU: rows gathered in a reused pinned buffer and copied in one go give
torch.cat's rows, also when the next join reuses (or outgrows) the buffer before the first
result is read."""

from __future__ import annotations

import pytest
import torch

from specsplit.model.transfer import HostRows, pinned_bytes
from tests.unit.test_host_rows import parts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_rows_join_on_the_gpu_equals_cat(dtype: torch.dtype) -> None:
    host_rows = HostRows()
    rounds = [parts(dtype, sizes, width=12288) for sizes in ((2, 3), (1,), (40, 30, 2), (2, 2))]
    joined = [host_rows.join(rows, CUDA) for rows in rounds]  # none read before the last join
    for rows, out in zip(rounds, joined, strict=True):
        assert out.device.type == "cuda" and out.dtype == dtype
        assert torch.equal(out.cpu(), torch.cat(rows))
    assert host_rows.buffer is not None and host_rows.buffer.is_pinned()


def test_host_rows_join_of_one_pinned_buffers_rows_copies_from_it() -> None:
    """A verify round's rows, split per sequence and sent on in order (in process): one copy
    straight from their pinned buffer, none through HostRows' own."""
    pinned = torch.randn(9, 12288).to(torch.bfloat16).pin_memory()
    host_rows = HostRows()
    out = host_rows.join([pinned[0:2], pinned[2:2], pinned[2:7]], CUDA)
    assert torch.equal(out.cpu(), pinned[:7])
    assert host_rows.buffer is None
    shuffled = host_rows.join([pinned[2:7], pinned[0:2]], CUDA)  # not in order: through it
    assert torch.equal(shuffled.cpu(), torch.cat([pinned[2:7], pinned[0:2]]))
    assert host_rows.buffer is not None


def test_rows_read_into_pinned_bytes_cross_from_there_and_stay_held_until_copied() -> None:
    """A Draft's rows as the drafter's round lane reads them (`pinned_bytes`, taken by
    torch.frombuffer, split per sequence): page-locked, so they cross in one copy straight
    from where they landed, and HostRows holds them until that copy is done (the next join)."""
    rows = torch.randn(9, 12288).to(torch.bfloat16)
    buffer = pinned_bytes(rows.numel() * rows.element_size(), CUDA)
    landed = torch.frombuffer(buffer, dtype=torch.bfloat16).reshape(rows.shape)
    landed.copy_(rows)
    assert landed.is_pinned()
    parts = list(landed.split([2, 0, 7]))
    host_rows = HostRows()
    out = host_rows.join(parts, CUDA)
    assert host_rows.buffer is None and host_rows.sources == parts
    assert torch.equal(out.cpu(), rows)
    host_rows.join([torch.randn(3, 8)], CUDA)  # pageable: through its own buffer
    assert host_rows.sources == [] and host_rows.buffer is not None
