"""On a CUDA device: the greedy accept-walk kernel, compiled, equals its torch reference for
chains and trees of every padded width up to 64, batches up to 64 with padding sequences, page
sizes 1 and 16, and decode rounds; one build serves every tree width of a power-of-two block.
Skipped where there is no GPU (CI)."""

from __future__ import annotations

import random

import pytest
import torch

import specsplit.kernels.accept_walk as accept_walk_module
from tests.unit.test_accept_walk import assert_walk_matches, random_round

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
            assert_walk_matches({name: t.cuda() for name, t in round_.items()}, page_size)


def _builds() -> int:
    """The kernel's compiled variants on every device."""
    kernel = accept_walk_module._jitted_kernel(False)
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_one_build_serves_every_width_of_a_block() -> None:
    """An eager round's exact tree width (5, 6, 7: not padded as a graph's 8), its window and
    batch compile nothing past the build for BLOCK 8 (a compile in traffic stalls a round)."""
    rng = random.Random(11)

    def run(width: int, batch: int, page_size: int) -> None:
        sizes = [rng.randint(1, width) for _ in range(batch)]
        round_ = random_round(rng, sizes, width, page_size, topk=2)
        assert_walk_matches({name: t.cuda() for name, t in round_.items()}, page_size)

    run(8, 1, 16)
    built = _builds()
    for width, batch, page_size in ((5, 3, 16), (6, 7, 1), (7, 2, 16), (8, 33, 1)):
        run(width, batch, page_size)
    assert _builds() == built
