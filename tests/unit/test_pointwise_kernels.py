"""The pointwise Triton kernels (specsplit/kernels/pointwise.py) equal their plain-torch
references under the Triton interpreter on the CPU (float32, and float16: the interpreter
rounds bfloat16 differently from a GPU, so bfloat16 is checked in tests/gpu): RMSNorm of rows
and of a q / k norm's heads (a view of qkv), the residual add before it, SiLU-and-mul at widths
past one program's block, an EAGLE-3 layer's input with strided and int32 token ids; a row's
result is the same bits whatever else is in the batch; the wrappers refuse what they cannot
run."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.pointwise import (
    SILU_BLOCK,
    add_rms_norm,
    add_rms_norm_reference,
    norm_embed_and_cat,
    norm_embed_and_cat_reference,
    rms_norm,
    rms_norm_reference,
    silu_and_mul,
    silu_and_mul_reference,
)

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py

EPS = 1e-6
# float16: a sum of squares in another order, or SiLU as x / (1 + exp(-x)), may round one ulp
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
DTYPES = list(TOLERANCE)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def norm_weight(hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return (1 + 0.1 * randn(hidden, seed=seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_rms_norm_is_its_reference(dtype: torch.dtype, rows: int, hidden: int) -> None:
    x, weight = randn(rows, hidden, dtype=dtype), norm_weight(hidden, dtype)
    got = rms_norm(x, weight, EPS)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm_reference(x, weight, EPS), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_q_norm_of_heads_in_a_qkv_view(dtype: torch.dtype) -> None:
    """Qwen3's q / k norms: RMSNorm over head_dim of [T, heads, head_dim] views of the fused
    qkv rows (rows strided by the whole qkv width)."""
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    weight = norm_weight(head_dim, dtype)
    for part in (q, k):
        got = rms_norm(part, weight, EPS)
        assert got.shape == part.shape and got.is_contiguous()
        torch.testing.assert_close(got, rms_norm_reference(part, weight, EPS), **TOLERANCE[dtype])


def test_rms_norm_promotes_like_torch() -> None:
    """A float32 weight on float16 rows gives float32, as `weight * x` does in torch."""
    x, weight = randn(4, 96, dtype=torch.float16), norm_weight(96, torch.float32)
    got = rms_norm(x, weight, EPS)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_reference(x, weight, EPS), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9])
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype: torch.dtype, rows: int) -> None:
    hidden = 192
    x, residual = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype, seed=2)
    weight = norm_weight(hidden, dtype)
    summed, normed = add_rms_norm(x, residual, weight, EPS)
    want_summed, want_normed = add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(summed, want_summed)  # one rounded add: the same bits
    torch.testing.assert_close(normed, want_normed, **TOLERANCE[dtype])


def test_add_rms_norm_reads_strided_rows() -> None:
    """Rows that are views into wider rows (a row stride past the width) are read in place."""
    wide, residual = randn(6, 300), randn(6, 128, seed=3)
    x, weight = wide[:, 40:168], norm_weight(128, torch.float32)
    summed, normed = add_rms_norm(x, residual, weight, EPS)
    want_summed, want_normed = add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1500, 2 * SILU_BLOCK + 3])
def test_silu_and_mul_is_its_reference(dtype: torch.dtype, inter: int) -> None:
    """Widths within one program's block and past it (several programs a row, the last one
    partly masked)."""
    gate_up = randn(3, 2 * inter, dtype=dtype)
    got = silu_and_mul(gate_up)
    assert got.shape == (3, inter) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul_reference(gate_up), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids", ["contiguous", "strided", "int32"])
def test_norm_embed_and_cat_is_its_reference(dtype: torch.dtype, ids: str) -> None:
    """The embedding gather, both norms and the concatenation; token ids may be a column of the
    chains verified (a strided view) or int32."""
    rows, hidden, vocab = 7, 96, 300
    features, embed = randn(rows, hidden, dtype=dtype), randn(vocab, hidden, dtype=dtype, seed=4)
    w_embed, w_features = norm_weight(hidden, dtype, seed=5), norm_weight(hidden, dtype, seed=6)
    table = torch.randint(0, vocab, (rows, 3), generator=torch.Generator().manual_seed(7))
    token_ids = {
        "contiguous": table[:, 1].contiguous(),
        "strided": table[:, 1],
        "int32": table[:, 1].to(torch.int32),
    }[ids]
    cat, normed = norm_embed_and_cat(features, token_ids, embed, w_embed, w_features, EPS)
    want_cat, want_normed = norm_embed_and_cat_reference(
        features, token_ids, embed, w_embed, w_features, EPS
    )
    assert cat.shape == (rows, 2 * hidden) and normed.shape == (rows, hidden)
    torch.testing.assert_close(cat, want_cat, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, want_normed, **TOLERANCE[dtype])


def test_norm_embed_and_cat_reads_no_row_past_the_vocabulary() -> None:
    """A token id outside the embedding (a graph's padding, a fault) gives a zero row on the
    embedding's side, not a read out of bounds; the features' side is unchanged."""
    features, embed = randn(3, 64), randn(10, 64, seed=1)
    weight = norm_weight(64, torch.float32)
    ids = torch.tensor([2, 10, -1])
    cat, normed = norm_embed_and_cat(features, ids, embed, weight, weight, EPS)
    assert torch.equal(cat[1:, :64], torch.zeros(2, 64))
    want_cat, _ = norm_embed_and_cat_reference(
        features, torch.tensor([2, 0, 0]), embed, weight, weight, EPS
    )
    torch.testing.assert_close(cat[0], want_cat[0])
    torch.testing.assert_close(cat[:, 64:], normed)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    """Each kernel's row alone and among 40 others: the same bits (one program a row, one
    reduction order), so a verify's rows equal the decode steps' of the same tokens."""
    hidden, inter = 96, 200
    x, residual = randn(40, hidden), randn(40, hidden, seed=1)
    weight, gate_up = norm_weight(hidden, torch.float32), randn(40, 2 * inter, seed=2)
    embed, ids = randn(50, hidden, seed=3), torch.arange(40) % 50
    batched = [
        rms_norm(x, weight, EPS),
        *add_rms_norm(x, residual, weight, EPS),
        silu_and_mul(gate_up),
        *norm_embed_and_cat(x, ids, embed, weight, weight, EPS),
    ]
    for row in (0, 17, 39):
        one = slice(row, row + 1)
        alone = [
            rms_norm(x[one], weight, EPS),
            *add_rms_norm(x[one], residual[one], weight, EPS),
            silu_and_mul(gate_up[one]),
            *norm_embed_and_cat(x[one], ids[one], embed, weight, weight, EPS),
        ]
        for got, want in zip(alone, batched, strict=True):
            assert torch.equal(got[0], want[row])


def test_no_rows_launch_nothing() -> None:
    weight = norm_weight(64, torch.float32)
    assert rms_norm(torch.empty(0, 64), weight, EPS).shape == (0, 64)
    summed, normed = add_rms_norm(torch.empty(0, 64), torch.empty(0, 64), weight, EPS)
    assert summed.shape == normed.shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    cat, normed = norm_embed_and_cat(
        torch.empty(0, 64), torch.empty(0, dtype=torch.int64), randn(5, 64), weight, weight, EPS
    )
    assert cat.shape == (0, 128) and normed.shape == (0, 64)


@pytest.mark.parametrize(
    "case",
    [
        "rms-norm-last-dim-strided",
        "rms-norm-weight-width",
        "rms-norm-integer-rows",
        "rms-norm-4d",
        "add-shapes",
        "silu-odd-width",
        "embed-dtype",
        "embed-width",
        "embed-float-ids",
    ],
)
def test_wrappers_refuse_what_they_cannot_run(case: str) -> None:
    x, weight = randn(4, 64), norm_weight(64, torch.float32)
    ids = torch.tensor([0, 1, 2, 3])
    calls = {
        "rms-norm-last-dim-strided": lambda: rms_norm(randn(64, 4).t(), weight, EPS),
        "rms-norm-weight-width": lambda: rms_norm(x, norm_weight(32, torch.float32), EPS),
        "rms-norm-integer-rows": lambda: rms_norm(x.long(), weight, EPS),
        "rms-norm-4d": lambda: rms_norm(randn(2, 2, 2, 64), weight, EPS),
        "add-shapes": lambda: add_rms_norm(x, randn(3, 64), weight, EPS),
        "silu-odd-width": lambda: silu_and_mul(randn(4, 65)),
        "embed-dtype": lambda: norm_embed_and_cat(x, ids, x.half(), weight, weight, EPS),
        "embed-width": lambda: norm_embed_and_cat(x, ids, randn(9, 32), weight, weight, EPS),
        "embed-float-ids": lambda: norm_embed_and_cat(x, ids.float(), x, weight, weight, EPS),
    }
    with pytest.raises(ValueError):
        calls[case]()
