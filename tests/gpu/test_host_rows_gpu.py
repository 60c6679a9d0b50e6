"""`HostRows.join` on a GPU: rows gathered in a reused pinned buffer and copied in one go give
torch.cat's rows, also when the next join reuses (or outgrows) the buffer before the first
result is read."""

from __future__ import annotations

import pytest
import torch

from specsplit.model.batch import HostRows
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
