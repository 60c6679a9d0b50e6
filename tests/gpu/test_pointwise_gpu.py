"""On a CUDA device: the pointwise Triton kernels (specsplit/kernels/pointwise.py) against their
plain-torch references in bfloat16, float16 and float32; a row's bits whatever the batch;
replayed from a CUDA graph; and a speculative stack whose models run them in place of
torch.compile's kernels (`SPECSPLIT_TRITON_POINTWISE=1`) compiles nothing with torch.compile and
generates the target's greedy output. Skipped where there is no GPU (CI)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import drafter.eagle
import specsplit.model.llama
from gateway.request import GenerationRequest
from specsplit.kernels import pointwise
from specsplit.messages import SpecParams
from specsplit.model import fused
from tests.eagle_random import save_target_and_drafters
from tests.support import TINY_VOCAB, check_no_leaks, generated_ids, stack_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EPS = 1e-6
# bfloat16: a sum of squares in another order may round a normed value one ulp (2^-8) apart
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DTYPES = list(TOLERANCE)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


def calls(rows: int, dtype: torch.dtype, hidden: int = 4096, inter: int = 14336) -> list[Any]:
    """(kernel, reference, args) of each kernel at an 8B's widths."""
    x, residual = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype, seed=1)
    weight = (1 + 0.1 * randn(hidden, seed=2)).to(dtype)
    embed, ids = randn(1000, hidden, dtype=dtype, seed=3), torch.arange(rows, device="cuda") * 7
    gate_up = randn(rows, 2 * inter, dtype=dtype, seed=4)
    return [
        (pointwise.rms_norm, pointwise.rms_norm_reference, (x, weight, EPS)),
        (pointwise.add_rms_norm, pointwise.add_rms_norm_reference, (x, residual, weight, EPS)),
        (pointwise.silu_and_mul, pointwise.silu_and_mul_reference, (gate_up,)),
        (
            pointwise.norm_embed_and_cat,
            pointwise.norm_embed_and_cat_reference,
            (x, ids, embed, weight, weight, EPS),
        ),
    ]


def outputs(result: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_kernels_are_their_references(dtype: torch.dtype, rows: int) -> None:
    with torch.inference_mode():
        for kernel, reference, args in calls(rows, dtype):
            for got, want in zip(outputs(kernel(*args)), outputs(reference(*args)), strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape
                torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_q_norm_of_a_qkv_view() -> None:
    tokens, heads, kv_heads, head_dim = 9, 32, 8, 128
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = (1 + 0.1 * randn(head_dim, seed=1)).bfloat16()
    got, want = pointwise.rms_norm(q, weight, EPS), pointwise.rms_norm_reference(q, weight, EPS)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


def test_a_rows_bits_do_not_depend_on_the_batch() -> None:
    """bfloat16 at an 8B's widths: each kernel's rows alone and within 64 rows, bit for bit."""
    with torch.inference_mode():
        for kernel, _, args in calls(64, torch.bfloat16):
            batched = outputs(kernel(*args))
            for row in (0, 31, 63):
                alone = outputs(kernel(*(a[row : row + 1] if _rows(a) else a for a in args)))
                for got, want in zip(alone, batched, strict=True):
                    assert torch.equal(got[0], want[row])


def _rows(arg: object) -> bool:
    """An argument with a row a token (not a weight, an embedding or eps)."""
    return isinstance(arg, torch.Tensor) and arg.dim() >= 1 and arg.shape[0] == 64


def test_replayed_from_a_cuda_graph() -> None:
    """Captured with a matmul before them (their launches may start before it ends: programmatic
    dependent launch on Hopper), replayed on new inputs: as run eagerly."""
    hidden = 576
    x = randn(8, hidden, dtype=torch.bfloat16)
    w = randn(hidden, hidden, dtype=torch.bfloat16, seed=1) / 24
    weight = (1 + 0.1 * randn(hidden, seed=2)).bfloat16()

    def step(inp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = inp @ w
        summed, normed = pointwise.add_rms_norm(y, inp, weight, EPS)
        return summed, pointwise.rms_norm(normed, weight, EPS), pointwise.silu_and_mul(normed)

    with torch.inference_mode():
        step(x)  # built
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(x)
        x.copy_(randn(8, hidden, dtype=torch.bfloat16, seed=9))
        graph.replay()
        for got, want in zip(captured, step(x), strict=True):
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("pointwise_models"))


def test_a_stack_on_the_kernels_compiles_nothing_and_keeps_the_targets_output(
    models: dict[str, Path], smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's and the EAGLE-3 head's pointwise functions as the kernels (what
    SPECSPLIT_TRITON_POINTWISE=1 selects at import), torch.compile refused: speculative rounds
    from CUDA graphs give the target-only output of the same kernels."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.compile called with the pointwise kernels on")

    monkeypatch.setattr(torch, "compile", refuse)
    names = ["rms_norm", "add_rms_norm", "silu_and_mul", "norm_embed_and_cat"]
    for name in names:
        kernel: Callable[..., Any] = getattr(pointwise, name)
        dispatch = fused._on_gpu(getattr(pointwise, f"{name}_reference"), kernel)
        for module in (specsplit.model.llama, drafter.eagle):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, dispatch)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (9, 14, 5)]
    requests = [GenerationRequest(p + p[:3], 20, ignore_eos=True) for p in prompts]
    outs = []
    for drafter_kind, spec in (("ngram", SpecParams(0, 1, 0)), ("eagle3", SpecParams(2, 2, 4))):
        stack = stack_on("cuda", models, smollm2_tokenizer, drafter_kind, spec, graphs=True)
        outs.append([generated_ids(c) for c in stack.generate_all(requests)])
        check_no_leaks(stack)
    assert outs[1] == outs[0]
