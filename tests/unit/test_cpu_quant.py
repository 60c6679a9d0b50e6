"""specsplit/model/cpu_quant.py and cpu_gemm.c's quant_gemm: GGUF's Q4_0 / Q4_1 / Q8_0 blocks
packed dequantize to gguf's values; a product from packed weights is the same bits as the
fixed-order product of the dequantized float32 matrix, at any row count and in both variants
(16 lanes, 8); packed blocks are attached only where they are the weight's values and dropped
when the weight changes; a GGUF model loads with its projections and LM head packed (q / k rows
in the checkpoint's order) and its logits are the same bits with and without them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize

from drafter.eagle import load_eagle3
from specsplit.model import cpu_gemm, cpu_quant
from specsplit.model.cpu_gemm import fixed_linear
from specsplit.model.embedded import embedded_default_head_path, embedded_default_model_path
from specsplit.model.gguf_file import GGUFFile, GGUFStateDict
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model, model_matrices
from specsplit.step import build_forward_batch, causal_step
from tests.unit.test_gguf_file import _k_blocks, _write

Q = GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K]
K_TYPES = (Q.Q4_K, Q.Q6_K)  # gguf cannot quantize to them: random blocks


pytestmark = pytest.mark.usefixtures("cpu_kernel", "float32_products")


@pytest.fixture
def quant_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "1")
    cpu_quant.switch.cache_clear()
    yield
    cpu_quant.switch.cache_clear()


def _matrix(qtype: Q, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(gguf's blocks uint8 [rows, row bytes], their values float32 [rows, cols]) of a random
    matrix with a few rows' scales negative (K_TYPES: random blocks)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
    values[::3] -= 0.2  # Q4_1's minimum far from zero
    raw = _k_blocks(rng, rows, cols, qtype) if qtype in K_TYPES else quantize(values, qtype)
    dequantized = dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(raw), torch.from_numpy(dequantized)


def _values(runs: cpu_quant.Runs) -> torch.Tensor:
    """A packed matrix's values (its runs dequantized, stacked)."""
    return torch.cat([cpu_quant.dequantize(run) for run in runs])


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_packed_blocks_dequantize_to_ggufs_values(qtype: Q) -> None:
    raw, values = _matrix(qtype, 37, 512)
    packed = cpu_quant.pack(qtype, raw)
    assert packed.rows == 37 and packed.cols == 512
    assert packed.data.shape[1] == 16 * cpu_quant.BLOCK_BYTES[packed.kind]
    assert torch.equal(cpu_quant.dequantize(packed), values)  # (Q4_0's zeros may be -0 there)
    assert torch.equal(cpu_quant.dequantize(packed, 5), values[:5])


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize(("n_len", "k_len"), [(1, 32), (13, 64), (70, 576), (9, 1536), (5, 256)])
def test_a_packed_product_is_the_float32_products_bits(
    lanes: int, qtype: Q, n_len: int, k_len: int, quant_on: None, cpu_kernel: cpu_gemm.Library
) -> None:
    """quant_gemm against fixed_gemm on the dequantized matrix, for every row count the tiling
    treats apart (1-4 rows a block; past 4 the weights formed once a pass; a partial block, a
    second pass over 256 rows), called directly and through fixed_linear."""
    if k_len % GGML_QUANT_SIZES[qtype][0]:
        pytest.skip(f"{qtype.name} blocks are wider than {k_len}")
    raw, values = _matrix(qtype, n_len, k_len, seed=n_len)
    weight = values.clone()
    assert cpu_quant.attach(weight, cpu_quant.pack(qtype, raw))
    x = torch.randn(300, k_len, generator=torch.Generator().manual_seed(1))
    runs = cpu_quant.packed(weight)
    assert runs is not None
    for num_rows in (1, 2, 3, 4, 5, 9, 47, 48, 257, 300):
        want = fixed_linear(x[:num_rows], values, lanes)
        got = fixed_linear(x[:num_rows], weight, lanes)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), num_rows
        direct = torch.empty_like(want)  # the packed kernel at every row count
        row = 0
        for run in runs:
            cpu_kernel.quant(x[:num_rows], run, direct[:, row : row + run.rows], lanes)
            row += run.rows
        assert torch.equal(direct.view(torch.int32), want.view(torch.int32)), num_rows


def test_attach_refuses_blocks_that_are_not_the_weights_values(quant_on: None) -> None:
    raw, values = _matrix(Q.Q4_1, 8, 64)
    packed = cpu_quant.pack(Q.Q4_1, raw)
    other = values.clone()
    other[3, 17] += 1e-3
    assert not cpu_quant.attach(other, packed)
    assert cpu_quant.packed(other) is None
    assert not cpu_quant.attach(values[:, :32].contiguous(), packed)  # another shape
    assert not cpu_quant.attach(values.double(), packed)


def test_a_weight_changed_in_place_drops_its_packed_blocks(quant_on: None) -> None:
    """After an in-place change the product is the new weight's, from its float32 values."""
    raw, values = _matrix(Q.Q8_0, 16, 64)
    weight = values.clone()
    packed = cpu_quant.pack(Q.Q8_0, raw)
    assert cpu_quant.attach(weight, packed) and cpu_quant.packed(weight) == (packed,)
    weight.mul_(2.0)
    assert cpu_quant.packed(weight) is None
    x = torch.randn(3, 64)
    assert torch.equal(fixed_linear(x, weight), fixed_linear(x, values * 2.0))


def test_a_bfloat16_valued_matrix_is_read_as_bfloat16(lanes: int, quant_on: None) -> None:
    """attach_bfloat16 packs a float32 matrix of bfloat16 values (kind 3; its product the same
    bits) and nothing else: a value off bfloat16's grid, a width not a multiple of 32."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 1152, generator=gen).bfloat16().float()
    values = weight.clone()
    assert cpu_quant.attach_bfloat16(weight)
    runs = cpu_quant.packed(weight)
    assert runs is not None and [run.kind for run in runs] == [cpu_quant.KIND_BF16]
    assert torch.equal(_values(runs), values)
    x = torch.randn(9, 1152, generator=gen)
    for num_rows in (1, 4, 9):
        want, got = (
            fixed_linear(x[:num_rows], values, lanes),
            fixed_linear(x[:num_rows], weight, lanes),
        )
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), num_rows
    off_grid = values.clone()
    off_grid[5, 5] += 1e-6
    assert not cpu_quant.attach_bfloat16(off_grid)
    assert not cpu_quant.attach_bfloat16(torch.randn(4, 40).bfloat16().float())


def test_the_shipped_eagle_heads_matrices_are_read_as_bfloat16(quant_on: None) -> None:
    path = embedded_default_model_path()
    head = load_eagle3(embedded_default_head_path(), path, torch.float32, "cpu")
    kinds = [[run.kind for run in cpu_quant.packed(w) or ()] for w in head.matrices()]
    assert kinds == [[cpu_quant.KIND_BF16]] * 6


def test_the_switch_turns_packed_weights_off(monkeypatch: pytest.MonkeyPatch) -> None:
    raw, values = _matrix(Q.Q4_0, 4, 32)
    try:
        monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "1")
        cpu_quant.switch.cache_clear()
        assert cpu_quant.attach(values, cpu_quant.pack(Q.Q4_0, raw))
        assert cpu_quant.packed(values) is not None
        monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "0")
        cpu_quant.switch.cache_clear()
        assert cpu_quant.packed(values) is None
        monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "yes")
        cpu_quant.switch.cache_clear()
        with pytest.raises(SystemExit, match="SPECSPLIT_CPU_QUANT"):
            cpu_quant.switch()
    finally:
        cpu_quant.switch.cache_clear()


def _logits(model: LlamaModel, config: object, tokens: list[int]) -> torch.Tensor:
    """A prefill of `tokens[:-4]`, then a 4-token step: the logits of both."""
    kv = make_kv_cache(model.config, 16, 16, torch.float32, "cpu")
    seq = kv.new_seq()
    kv.reserve(seq, len(tokens))
    first = tokens[:-4]
    out = [
        model(build_forward_batch([causal_step(seq, first, list(range(len(first))))], 16)[0], kv)
    ]
    seq.kv_committed_len = len(first)
    out.append(model(build_forward_batch([causal_step(seq, tokens[-4:], [0, 1, 2, 3])], 16)[0], kv))
    kv.release(seq)
    return torch.cat([o.logits for o in out])


def _same_logits_packed_or_not(
    path: str, monkeypatch: pytest.MonkeyPatch, tokens: list[int], num_layers: int | None = None
) -> LlamaModel:
    model, config = load_model(path, torch.float32, "cpu", num_layers=num_layers)
    packed = _logits(model, config, tokens)
    monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "0")
    cpu_quant.switch.cache_clear()
    plain = _logits(model, config, tokens)
    assert torch.equal(packed.view(torch.int32), plain.view(torch.int32))
    monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "1")
    cpu_quant.switch.cache_clear()
    return model


@pytest.mark.parametrize("qtype", [*FORMATS, Q.BF16], ids=lambda q: q.name)
def test_a_gguf_model_loads_packed_with_the_same_logits(
    tmp_path: Path, qtype: Q, quant_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small llama file (q / k rows permuted by llama.cpp's converter, an untied LM head):
    every projection and the LM head packed (a BF16 file's as its bfloat16 values), each packed
    matrix dequantizing to the loaded weight in every row, and the same logits packed or not."""
    wide = {"head_dim": 64, "hidden": 256, "ffn": 512} if qtype in K_TYPES else {}
    path = _write(tmp_path / "tiny.gguf", "llama", qtype, tied=False, **wide)  # type: ignore[arg-type]
    model = _same_logits_packed_or_not(path, monkeypatch, list(range(3, 40)))
    for weight in model_matrices(model):
        runs = cpu_quant.packed(weight)
        assert runs is not None
        assert torch.equal(_values(runs), weight)


def test_stored_rows_are_in_the_checkpoints_order() -> None:
    """GGUFStateDict.stored: a permuted (query) and an unpermuted (value) projection's blocks
    dequantize to the tensors the state dict reads."""
    with GGUFFile(embedded_default_model_path()) as file:
        weights = GGUFStateDict(file, 9, 3)
        for name in (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ):
            packed = cpu_quant.pack(*weights.stored(name))
            assert torch.equal(cpu_quant.dequantize(packed), weights[name])


def test_the_embedded_default_loads_packed_with_the_same_logits(
    quant_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its Q4_1 projections and Q8_0 embedding (the tied LM head) packed, two layers loaded."""
    path = embedded_default_model_path()
    model = _same_logits_packed_or_not(path, monkeypatch, list(range(100, 130)), num_layers=2)
    assert all(cpu_quant.packed(weight) is not None for weight in model_matrices(model))
    embedding = cpu_quant.packed(model.embed_tokens.weight)
    assert embedding is not None and [run.kind for run in embedding] == [cpu_quant.KIND_8BIT]


def test_a_fused_matrix_of_two_formats_is_packed_in_runs(lanes: int, quant_on: None) -> None:
    """q and k in Q4_K beside v in Q6_K (a Q4_K_M file's qkv): two runs, one a kind, and the
    product the float32 one's bits at every row count."""
    shapes = [(Q.Q4_K, 64), (Q.Q4_K, 16), (Q.Q6_K, 16)]  # (format, rows) of q, k, v
    parts = [(qtype, *_matrix(qtype, rows, 256, seed=rows)) for qtype, rows in shapes]
    runs = cpu_quant.cat([cpu_quant.pack(qtype, raw) for qtype, raw, _ in parts])
    kinds = [(run.kind, run.rows) for run in runs]
    assert kinds == [(cpu_quant.KIND_4BIT, 80), (cpu_quant.KIND_8BIT_16, 16)]
    values = torch.cat([v for _, _, v in parts])
    weight = values.clone()
    assert cpu_quant.attach(weight, runs)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4))
    for num_rows in (1, 4, 9):
        want = fixed_linear(x[:num_rows], values, lanes)
        got = fixed_linear(x[:num_rows], weight, lanes)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), num_rows


def test_a_layer_reads_a_fused_matrix_of_two_formats(
    tmp_path: Path, quant_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small Q4_K model whose qkv's v rows are made Q6_K values (packed as a second run):
    cpu_layer.c's projection over both runs gives the float32 weights' logits."""
    path = _write(
        tmp_path / "k.gguf", "llama", Q.Q4_K, tied=False, head_dim=64, hidden=256, ffn=512
    )
    model, config = load_model(path, torch.float32, "cpu")
    kv_rows = config.num_kv_heads * config.head_dim
    for i, layer in enumerate(model.layers):
        weight: torch.Tensor = layer.qkv_proj.weight  # type: ignore[union-attr, assignment]
        (run,) = cpu_quant.packed(weight) or ()
        qk = weight.shape[0] - kv_rows
        raw, values = _matrix(Q.Q6_K, kv_rows, weight.shape[1], seed=10 + i)
        weight.data[qk:] = values
        head = cpu_quant.Packed(run.kind, run.data[:qk], run.cols)
        assert cpu_quant.attach(weight, cpu_quant.cat([head, cpu_quant.pack(Q.Q6_K, raw)]))
        assert len(cpu_quant.packed(weight) or ()) == 2
    packed = _logits(model, config, list(range(3, 40)))
    monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "0")
    cpu_quant.switch.cache_clear()
    plain = _logits(model, config, list(range(3, 40)))
    assert torch.equal(packed.view(torch.int32), plain.view(torch.int32))
