"""On a CUDA device the log-probability kernels (`specsplit.kernels.logprobs`) equal their
references on SmolLM2's and an 8B's vocabularies (float32 logits as the graphs keep them, and
bf16), for tokens at rows, bonus tokens read from the acceptance's results, and each row's top
20. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.logprobs import (
    token_logprobs,
    token_logprobs_reference,
    top_logprobs,
    top_logprobs_reference,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 128256])
def test_kernels_equal_the_references_at_real_vocabularies(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(vocab)
    logits = (torch.randn(40, vocab, device=CUDA, generator=gen) * 4).to(dtype)
    packed = torch.tensor([[0, 7, -1, -1], [2, 3, 0, 2], [1, 9, 2, -1]], device=CUDA)
    queries = torch.tensor(
        [[0, 0, -1], [39, vocab - 1, -1], [8, vocab // 2, -1], [0, 0, 0], [1, 0, 1], [30, 0, 2]],
        device=CUDA,
    )
    got = token_logprobs(logits, queries, packed)
    torch.testing.assert_close(
        got, token_logprobs_reference(logits, queries, packed), atol=1e-4, rtol=0
    )
    rows = torch.tensor([[r, 0, 0] for r in range(0, 40, 3)], device=CUDA)
    top = top_logprobs(logits, rows, 20)
    want = top_logprobs_reference(logits, rows, 20)
    torch.testing.assert_close(top[:, :20], want[:, :20], atol=1e-4, rtol=0)
    if dtype == torch.float32:  # (bf16's many ties: torch.topk orders them its own way)
        assert torch.equal(top[:, 20:], want[:, 20:])
