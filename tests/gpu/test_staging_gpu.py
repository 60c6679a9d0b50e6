"""`to_device`'s staging buffers (specsplit/model/transfer.py) on a CUDA device: small host tensors
of any dtype and layout reach the device with their values while the device is busy with work
queued before them, through the pinned buffers reused once their copies ran; with every buffer's
copy still queued, a copy goes through `pin_memory` instead, with the same values. Skipped
without a GPU."""

from __future__ import annotations

import pytest
import torch

from specsplit.model import transfer
from specsplit.model.transfer import STAGE_BYTES, STAGE_SLOTS, to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ints = torch.randint(-1000, 1000, (6, 5), generator=generator)
    return [
        ints,
        ints.T,  # not contiguous
        ints[0, 0],  # 0-dim
        torch.empty(0, dtype=torch.int64),
        torch.rand(7, generator=generator, dtype=torch.float32).to(torch.bfloat16),
        ints > 0,
        torch.arange(STAGE_BYTES // 8, dtype=torch.int64),  # a whole buffer
    ]


def test_staged_copies_keep_their_values_behind_the_devices_work_and_past_the_buffers() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    to_device(torch.zeros(1), device)  # the staging exists
    stage = transfer._STAGES[device]
    staged = stage.num_staged
    # ~1 s of queued work: every copy below waits behind it (the loop's pin_memory copies of
    # whole buffers took past 0.1 s with four test processes on the GPU)
    torch.cuda._sleep(2_000_000_000)
    hosts, moved = [], []
    for seed in range(3 * STAGE_SLOTS // len(_tensors(0)) + 2):  # more copies than buffers
        for host in _tensors(seed):
            hosts.append(host)
            moved.append(to_device(host, device))
    # the buffers' copies were all queued behind the sleep: the rest went through pin_memory
    assert stage.num_staged - staged == STAGE_SLOTS
    torch.cuda.synchronize()
    for host, on_device in zip(hosts, moved, strict=True):
        assert on_device.device == device and on_device.shape == host.shape
        assert torch.equal(on_device.cpu(), host)
    # once the device ran them, the buffers serve again (their contents rewritten)
    again = [to_device(host, device) for host in _tensors(99)]
    assert stage.num_staged - staged == STAGE_SLOTS + len(again)
    assert all(torch.equal(a.cpu(), h) for a, h in zip(again, _tensors(99), strict=True))


def test_a_tensor_larger_than_a_buffer_goes_through_pin_memory() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.arange(STAGE_BYTES // 8 + 1, dtype=torch.int64)
    to_device(torch.zeros(1), device)
    stage = transfer._STAGES[device]
    staged = stage.num_staged
    assert torch.equal(to_device(host, device).cpu(), host)
    assert stage.num_staged == staged
