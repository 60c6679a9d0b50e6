"""The small-linear Triton kernels equal their plain-torch references (float32, under the Triton
interpreter on the CPU): RMSNorm + projection, projection + residual add, RMSNorm + gate/up
projection + SiLU-and-mul, at 1 to 16 rows (the broadcast path and the tensor-core path; up to
32 on either path with its bench switch), with and without bias, N not a multiple of the
tile, row-strided inputs; a tiny model's steps through
`forward_small` equal `forward`'s; when the model takes that path; and the wrappers refuse what
they cannot run."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedConfig, Qwen3Config

from specsplit.kernels import small_linear_tiles
from specsplit.kernels.small_linear import (
    RopeStore,
    linear_residual,
    linear_residual_reference,
    norm_linear,
    norm_linear_reference,
    norm_linear_rope_store,
    norm_linear_rope_store_reference,
    norm_linear_silu_mul,
    norm_linear_silu_mul_reference,
)
from specsplit.kernels.small_linear_tiles import BROADCAST_ROWS, MAX_ROWS
from specsplit.kv_cache import KVCache
from specsplit.model import llama
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.config import ModelConfig
from specsplit.model.llama import DecoderLayer, LlamaModel, make_kv_cache, state_dict_from_hf
from specsplit.model.rope import rope_cos_sin, rope_inv_freq
from tests.forward_steps import TINY_LLAMA, causal_step, make_batch, new_seqs, tree_step

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py

EPS = 1e-5
TINY_EPS = 1e-12  # 16 + TINY_EPS == 16 in float32
ATOL = RTOL = 1e-5  # float32; only the GEMMs' summation order differs


@dataclass
class Case:
    x: torch.Tensor  # [M, K]
    norm_weight: torch.Tensor  # [K]
    weight: torch.Tensor  # [N, K]; [2 * N, K] for silu-and-mul
    bias: torch.Tensor | None  # [N] / [2 * N]
    residual: torch.Tensor  # [M, N]


def make_case(
    num_rows: int, k: int, n: int, bias: bool, gate_up: bool = False, seed: int = 0
) -> Case:
    """O(1) inputs and outputs: unit-variance x, 1/sqrt(K) weights, norm weights near 1."""
    gen = torch.Generator().manual_seed(seed)
    n_weight = 2 * n if gate_up else n
    return Case(
        x=torch.randn(num_rows, k, generator=gen),
        norm_weight=1 + 0.2 * torch.randn(k, generator=gen),
        weight=torch.randn(n_weight, k, generator=gen) / k**0.5,
        bias=0.5 * torch.randn(n_weight, generator=gen) if bias else None,
        residual=torch.randn(num_rows, n, generator=gen),
    )


def run_norm_linear(case: Case, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    return fn(case.x, case.norm_weight, EPS, case.weight, case.bias)


def run_linear_residual(case: Case, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    return fn(case.x, case.weight, case.bias, case.residual)


# op -> (kernel, reference, runner, whether the weight holds gate and up rows)
OPS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Any, bool]] = {
    "norm_linear": (norm_linear, norm_linear_reference, run_norm_linear, False),
    "linear_residual": (linear_residual, linear_residual_reference, run_linear_residual, False),
    "norm_linear_silu_mul": (
        norm_linear_silu_mul,
        norm_linear_silu_mul_reference,
        run_norm_linear,
        True,
    ),
}
# name -> (rows, K, N, bias): 1-4 rows take the broadcast path, 5-16 the tensor-core one; the
# interpreter's tiles are 8 (broadcast) / 16 (tensor cores) columns by 32 of K
SHAPES = {
    "decode_one_row": (1, 64, 48, False),
    "one_row_bias_n_not_a_tile_multiple": (1, 80, 100, True),
    "three_rows_padded_to_four": (3, 96, 160, True),
    "eight_rows_tensor_cores": (8, 64, 48, True),
    "nine_rows_verify_k_not_a_tile_multiple": (9, 80, 100, False),
    "sixteen_rows_full_block": (16, 96, 160, True),
}


def assert_matches_reference(op: str, case: Case) -> torch.Tensor:
    kernel, reference, run, _ = OPS[op]
    got = run(case, kernel)
    want = run(case, reference)
    assert got.shape == want.shape and got.is_contiguous() and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    return got


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", list(OPS))
def test_kernel_matches_reference(op: str, shape: str) -> None:
    num_rows, k, n, bias = SHAPES[shape]
    assert_matches_reference(op, make_case(num_rows, k, n, bias, gate_up=OPS[op][3]))


@pytest.mark.parametrize("num_rows", [3, 16])
@pytest.mark.parametrize("op", list(OPS))
def test_row_strided_inputs(op: str, num_rows: int) -> None:
    """x and the residual as column slices of wider rows (their row stride is not K / N)."""
    case = make_case(num_rows, 64, 48, True, gate_up=OPS[op][3], seed=1)
    wide_x = torch.randn(num_rows, 80)
    wide_x[:, 8:72] = case.x
    wide_res = torch.randn(num_rows, 60)
    wide_res[:, 4:52] = case.residual
    strided = replace(case, x=wide_x[:, 8:72], residual=wide_res[:, 4:52])
    assert strided.x.stride(0) == 80 and strided.residual.stride(0) == 60
    torch.testing.assert_close(
        assert_matches_reference(op, strided), OPS[op][2](case, OPS[op][1]), atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("num_rows", [2, 12])
def test_norm_of_a_constant_row_is_the_norm_weight(num_rows: int) -> None:
    """An exact value: a row of 4s has RMS 4 (eps rounds away against 16), so RMSNorm(x) is the
    norm weight and the projection is norm_weight @ weight.T, in small integers: exact."""
    k, n = 40, 24
    x = torch.full((num_rows, k), 4.0)
    norm_weight = torch.arange(k, dtype=torch.float32) % 5 - 2  # -2..2
    weight = (torch.arange(n * k, dtype=torch.float32).view(n, k) % 7) - 3  # -3..3
    bias = torch.arange(n, dtype=torch.float32)
    got = norm_linear(x, norm_weight, TINY_EPS, weight, bias)
    assert torch.equal(got, (weight @ norm_weight + bias).expand(num_rows, n))


def test_silu_mul_pairs_each_gate_column_with_its_up_column() -> None:
    """Exact values: gate column j reads weight row j, up column j row N + j. With x = 4s (RMS
    4) and norm weight 1, gate_j = g_j and up_j = u_j, so out_j = silu(g_j) * u_j."""
    k, n = 16, 20
    gate = torch.arange(n, dtype=torch.float32) - 10  # silu of -10..9
    up = torch.arange(n, dtype=torch.float32) + 1
    weight = torch.cat([gate[:, None], up[:, None]]).expand(2 * n, k) / k  # rows of g/k, u/k
    x = torch.full((1, k), 4.0)
    got = norm_linear_silu_mul(x, torch.ones(k), TINY_EPS, weight.contiguous())
    torch.testing.assert_close(got[0], torch.nn.functional.silu(gate) * up, atol=0, rtol=1e-6)


def rope_case(num_rows: int, bias: bool, seed: int = 0) -> tuple[Case, RopeStore]:
    """A qkv projection of 3 q heads and 2 KV heads of 16 (GQA), its cos / sin at positions
    3.., and a cache of 40 slots; the rows' slots scattered over it."""
    num_heads, num_kv_heads, head_dim = 3, 2, 16
    case = make_case(num_rows, 48, (num_heads + 2 * num_kv_heads) * head_dim, bias, seed=seed)
    inv_freq = rope_inv_freq(head_dim, 10000.0, None)
    cos, sin = rope_cos_sin(torch.arange(3, 3 + num_rows), inv_freq, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, 40, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(40, generator=gen)[:num_rows]
    return case, RopeStore(cos, sin, cache[0], cache[1], slots, num_heads)


@pytest.mark.parametrize(
    ("num_rows", "bias"), [(1, False), (3, True), (4, False), (6, True), (16, False)]
)
def test_qkv_rope_store_matches_reference(num_rows: int, bias: bool) -> None:
    """norm_linear_rope_store: q rotated (returned), k rotated and v as projected in the cache
    at the rows' slots, every other slot untouched; 1-4 rows broadcast, 6 and 16 tensor cores."""
    case, rope = rope_case(num_rows, bias)
    want_rope = rope._replace(k_cache=rope.k_cache.clone(), v_cache=rope.v_cache.clone())
    got = norm_linear_rope_store(case.x, case.norm_weight, EPS, case.weight, case.bias, rope)
    want = norm_linear_rope_store_reference(
        case.x, case.norm_weight, EPS, case.weight, case.bias, want_rope
    )
    assert got.shape == want.shape == (num_rows, 3 * 16) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(rope.k_cache, want_rope.k_cache, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(rope.v_cache, want_rope.v_cache, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_rows", [8, 9, 16, 17, 32])
@pytest.mark.parametrize("op", [*OPS, "norm_linear_rope_store"])
def test_the_broadcast_path_above_four_rows_matches_reference(
    op: str, num_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS=32 (a bench's switch): 8 to 32 rows on the
    broadcast path (BLOCK_M 8 / 16 / 32, no tensor cores) give the reference's results too."""
    monkeypatch.setattr(small_linear_tiles, "BROADCAST_ROWS", 32)
    assert not small_linear_tiles.tiles_for(num_rows, 100, 80, itemsize=4, interpret=True).use_dot
    assert_op_matches_reference(op, num_rows)


@pytest.mark.parametrize("num_rows", [17, 24, 32])
@pytest.mark.parametrize("op", [*OPS, "norm_linear_rope_store"])
def test_the_tensor_core_path_at_17_to_32_rows_matches_reference(
    op: str, num_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$SPECSPLIT_SMALL_LINEAR_DOT_ROWS=32 (a bench's switch): 17 to 32 rows as one 32-row block
    on tensor cores give the reference's results too."""
    monkeypatch.setattr(small_linear_tiles, "BROADCAST_ROWS", 4)
    monkeypatch.setattr(small_linear_tiles, "DOT_ROWS", 32)
    tiles = small_linear_tiles.tiles_for(num_rows, 100, 80, itemsize=4, interpret=True)
    assert tiles.use_dot and tiles.block_m == 32
    assert_op_matches_reference(op, num_rows)


def assert_op_matches_reference(op: str, num_rows: int) -> None:
    """`op` (OPS', or the qkv projection with RoPE + K/V store) at `num_rows` rows, N = 100 not
    a multiple of the tile, against its reference (the cache rows too)."""
    if op == "norm_linear_rope_store":
        case, rope = rope_case(num_rows, bias=True)
        want_rope = rope._replace(k_cache=rope.k_cache.clone(), v_cache=rope.v_cache.clone())
        got = norm_linear_rope_store(case.x, case.norm_weight, EPS, case.weight, case.bias, rope)
        want = norm_linear_rope_store_reference(
            case.x, case.norm_weight, EPS, case.weight, case.bias, want_rope
        )
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(rope.k_cache, want_rope.k_cache, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(rope.v_cache, want_rope.v_cache, atol=ATOL, rtol=RTOL)
        return
    assert_matches_reference(op, make_case(num_rows, 80, 100, True, gate_up=OPS[op][3]))


@pytest.mark.parametrize(
    ("value", "lines"),
    [(None, None), ("", None), ("8", 8), ("1", 1), ("3", None), ("0", None), ("x", None)],
)
def test_the_prefetch_lines_switch(
    value: str | None, lines: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$SPECSPLIT_SMALL_LINEAR_PREFETCH_LINES: unset or empty, whole rows (None); a power of
    two, that cap; anything else stops the process."""
    if value is None:
        monkeypatch.delenv("SPECSPLIT_SMALL_LINEAR_PREFETCH_LINES", raising=False)
    else:
        monkeypatch.setenv("SPECSPLIT_SMALL_LINEAR_PREFETCH_LINES", value)
    if lines is None and value not in (None, ""):
        with pytest.raises(SystemExit, match="PREFETCH_LINES"):
            small_linear_tiles._prefetch_max_lines()
        return
    assert small_linear_tiles._prefetch_max_lines() == lines


@pytest.mark.parametrize(
    ("value", "tiles"),
    [(None, None), ("32,64,8,3", (32, 64, 8, 3)), ("16,256,2,1", (16, 256, 2, 1)),
     ("12,64,4,2", None), ("16,64", None), ("16,512,4,2", None), ("a,b,c,d", None),
     ("16,64,3,2", None), ("16,64,4,0", None), ("16,64,4,9", None)],
)  # fmt: skip
def test_the_dot_tiles_switch(
    value: str | None, tiles: tuple[int, ...] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset: the built-in tiles; BLOCK_N,BLOCK_K,WARPS,STAGES as asked, which the tensor-core
    launches on a GPU then take; anything malformed stops the process."""
    if value is None:
        monkeypatch.delenv("SPECSPLIT_SMALL_LINEAR_DOT_TILES", raising=False)
        assert small_linear_tiles._dot_tiles() is None
        return
    monkeypatch.setenv("SPECSPLIT_SMALL_LINEAR_DOT_TILES", value)
    if tiles is None:
        with pytest.raises(SystemExit, match="DOT_TILES"):
            small_linear_tiles._dot_tiles()
        return
    assert small_linear_tiles._dot_tiles() == tiles
    monkeypatch.setattr(small_linear_tiles, "DOT_TILES", tiles)
    got = small_linear_tiles.tiles_for(9, 960, 576, itemsize=2, interpret=False)
    assert got == small_linear_tiles.Tiles(16, tiles[0], tiles[1], True, tiles[2], tiles[3])


@pytest.mark.parametrize(
    ("switch", "value", "rows"),
    [
        # broadcast: default 4; a power of two up to 32 (BLOCK_M is one)
        *[("BROADCAST_ROWS", v, r) for v, r in
          [(None, 4), ("8", 8), ("32", 32), ("3", None), ("64", None)]],
        # tensor cores: default 16; 32 allowed (one 32-row block)
        *[("DOT_ROWS", v, r) for v, r in [(None, 16), ("32", 32), ("8", None), ("64", None)]],
    ],
)  # fmt: skip
def test_the_rows_switches(
    switch: str, value: str | None, rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$SPECSPLIT_SMALL_LINEAR_<switch>: its default unset, the values it allows as asked,
    anything else stops the process."""
    read = {
        "BROADCAST_ROWS": small_linear_tiles._broadcast_rows,
        "DOT_ROWS": small_linear_tiles._dot_rows,
    }
    name = f"SPECSPLIT_SMALL_LINEAR_{switch}"
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    if rows is None:
        with pytest.raises(SystemExit, match=switch):
            read[switch]()
    else:
        assert read[switch]() == rows


def test_rows_past_both_paths_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows than the tensor-core path's block and the broadcast path's limit: refused (not
    computed on one row block), whatever MAX_ROWS said at import."""
    monkeypatch.setattr(small_linear_tiles, "BROADCAST_ROWS", 4)
    monkeypatch.setattr(small_linear_tiles, "MAX_ROWS", 32)
    case = make_case(small_linear_tiles.DOT_ROWS + 1, 64, 48, False)
    with pytest.raises(ValueError, match="at most 16"):
        run_linear_residual(case, linear_residual)


def test_qkv_rope_store_refuses_a_mismatched_cache() -> None:
    case, rope = rope_case(2, False)
    with pytest.raises(ValueError, match="rows: q, k, v"):  # 3 + 2 x 2 heads, not 4 + 2 x 2
        norm_linear_rope_store(
            case.x, case.norm_weight, EPS, case.weight, None, rope._replace(num_heads=4)
        )
    with pytest.raises(ValueError, match="x's dtype"):
        bf16 = rope._replace(k_cache=rope.k_cache.bfloat16(), v_cache=rope.v_cache.bfloat16())
        norm_linear_rope_store(case.x, case.norm_weight, EPS, case.weight, None, bf16)


def test_no_rows_launch_nothing() -> None:
    case = make_case(0, 64, 48, True)
    assert norm_linear(case.x, case.norm_weight, EPS, case.weight, case.bias).shape == (0, 48)


# --- the model: forward_small against forward ---------------------------------------------

_COMMON = {**TINY_LLAMA, "num_hidden_layers": 2}  # hidden 64, 4 heads, vocab 96
ARCHS: dict[str, PreTrainedConfig] = {
    "llama_gqa_all_biases": LlamaConfig(
        **_COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True
    ),
    "qwen3_qk_norm": Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=16),
}


def tiny_model(hf_config: PreTrainedConfig) -> LlamaModel:
    """Our model with O(1) random weights (norms near 1, biases 0.5, matrices 1/sqrt(fan_in))."""
    config = ModelConfig.from_hf(hf_config)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, t in state_dict_from_hf(config, hf.state_dict(), torch.float32, "cpu").items():
        noise = torch.randn(t.shape, generator=gen)
        if name.endswith("norm.weight"):
            state[name] = 1 + 0.2 * noise
        elif name.endswith("bias") or name == "embed_tokens.weight":
            state[name] = noise * (0.5 if name.endswith("bias") else 1.0)
        else:
            state[name] = noise / t.shape[-1] ** 0.5
    return LlamaModel.from_state_dict(config, state, "cpu")


def run_both(
    model: LlamaModel, batch: ForwardBatch, kv: KVCache, monkeypatch: pytest.MonkeyPatch
) -> tuple[ForwardOutput, ForwardOutput, torch.Tensor, torch.Tensor]:
    """(forward's output, forward_small's output, the cache after each), from the same cache."""
    aux_layers = (0, 1, 2)  # both layers' outputs and the last hidden state
    before = kv.data.clone()
    want = model(batch, kv, aux_layers=aux_layers)
    want_kv = kv.data.clone()
    kv.data.copy_(before)
    layers_run: list[int] = []
    fused_qkv: list[int] = []
    forward_small = DecoderLayer.forward_small

    def spy(layer: DecoderLayer, *args: Any) -> torch.Tensor:
        layers_run.append(layer.layer_index)
        return forward_small(layer, *args)

    def qkv_spy(*args: Any) -> torch.Tensor:
        fused_qkv.append(args[0].shape[0])
        return norm_linear_rope_store(*args)

    with monkeypatch.context() as patch:  # the small path on the CPU, under the interpreter
        patch.setattr(
            LlamaModel,
            "uses_small_linear",
            lambda self, n, device: n <= small_linear_tiles.MAX_ROWS,
        )
        patch.setattr(DecoderLayer, "forward_small", spy)
        patch.setattr(llama, "norm_linear_rope_store", qkv_spy)
        got = model(batch, kv, aux_layers=aux_layers)
    assert layers_run == [0, 1], layers_run
    # the qkv projection takes RoPE and the K/V store, unless q/k norms come between (Qwen3)
    assert len(fused_qkv) == (0 if model.config.qk_norm else 2), fused_qkv
    return want, got, want_kv, kv.data.clone()


def prefilled(arch: str, seed: int) -> tuple[LlamaModel, KVCache, list[Any], torch.Generator]:
    """A tiny model with two sequences prefilled (forward, 13 and 22 tokens), room for 40 each;
    the generator that drew their prompts, for the next steps' tokens."""
    model = tiny_model(ARCHS[arch])
    kv = make_kv_cache(model.config, num_pages=24, page_size=4, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (13, 22)]
    seqs = new_seqs(kv, [40, 40], random.Random(seed))
    model(make_batch([causal_step(s, p) for s, p in zip(seqs, prompts, strict=True)]), kv)
    for seq, prompt in zip(seqs, prompts, strict=True):
        seq.kv_committed_len = len(prompt)
    return model, kv, seqs, gen


def assert_small_path_alike(
    model: LlamaModel, step: list[Any], kv: KVCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    want, got, want_kv, got_kv = run_both(model, make_batch(step), kv, monkeypatch)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got.hidden_states, want.hidden_states, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_kv, want_kv, atol=ATOL, rtol=RTOL)


@pytest.mark.raw_kv
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_small_path_steps_equal_the_layer_path(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences prefilled (forward), then a decode step (2 rows), a verify step of chains
    (10 rows) and a tree step (9 rows): logits, aux hidden states and the written K/V alike."""
    model, kv, seqs, gen = prefilled(arch, 1)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, 96, (n,), generator=gen).tolist()

    steps = [
        [causal_step(s, tokens(1)) for s in seqs],  # decode
        [causal_step(s, tokens(5)) for s in seqs],  # verify 1 + 4
        [tree_step(seqs[0], 7, tokens(5), [-1, -1, 0, 1, 3]), causal_step(seqs[1], tokens(3))],
    ]
    for step in steps:
        assert_small_path_alike(model, step, kv, monkeypatch)


@pytest.mark.raw_kv
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("path", ["broadcast", "tensor cores"])
def test_a_32_row_step_through_the_small_path_equals_the_layer_path(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify step of two sequences x 16 tokens (32 rows, as a decode step at batch 32 has)
    through the small path, every projection on the broadcast path
    ($SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS=32) or as one 32-row block on tensor cores
    ($SPECSPLIT_SMALL_LINEAR_DOT_ROWS=32): logits, aux hidden states and the written K/V as
    the layer path's."""
    if path == "broadcast":
        monkeypatch.setattr(small_linear_tiles, "BROADCAST_ROWS", 32)
    else:
        monkeypatch.setattr(small_linear_tiles, "DOT_ROWS", 32)
    monkeypatch.setattr(small_linear_tiles, "MAX_ROWS", 32)
    model, kv, seqs, gen = prefilled("llama_gqa_all_biases", 2)
    step = [causal_step(s, torch.randint(0, 96, (16,), generator=gen).tolist()) for s in seqs]
    assert_small_path_alike(model, step, kv, monkeypatch)


def test_which_steps_take_the_small_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, at most 16 tokens by default (4 on the broadcast path, 5-16 on tensor cores),
    small layer weights, not turned off; never on the CPU. (The models stay on the meta device:
    only their shapes are read.)"""
    assert llama.SMALL_LINEAR_ROWS == MAX_ROWS == 16  # the default (the env is unset)
    assert BROADCAST_ROWS == 4
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    small = LlamaModel(ModelConfig.from_hf(ARCHS["llama_gqa_all_biases"]), "cpu")
    monkeypatch.setattr(llama, "SMALL_LINEAR", True)  # triton is there
    assert small.uses_small_linear(1, cuda) and small.uses_small_linear(4, cuda)
    assert small.uses_small_linear(5, cuda) and small.uses_small_linear(MAX_ROWS, cuda)
    assert not small.uses_small_linear(MAX_ROWS + 1, cuda)
    assert not small.uses_small_linear(1, cpu)
    assert not small.uses_small_linear(0, cuda)
    # 1B-class layers: gate_up is 2 x 8192 x 2048 weights, 134 MB in float32
    big = LlamaModel(
        ModelConfig.from_hf(
            LlamaConfig(**{**_COMMON, "hidden_size": 2048, "intermediate_size": 8192})
        ),
        "cpu",
    )
    assert big.max_layer_weight_numel * 4 > llama.SMALL_LINEAR_MAX_WEIGHT_BYTES
    assert not big.uses_small_linear(1, cuda)
    monkeypatch.setattr(llama, "SMALL_LINEAR", False)  # SPECSPLIT_SMALL_LINEAR=0
    assert not small.uses_small_linear(1, cuda)


# --- the wrappers refuse ------------------------------------------------------------------


def _strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]


BAD_INPUTS: dict[str, tuple[str, Callable[[Case], Case], str]] = {
    "more rows than 16": (
        "norm_linear",
        lambda c: replace(c, x=torch.randn(MAX_ROWS + 1, 64)),
        "at most 16",
    ),
    "x's K differs from the weight's": (
        "linear_residual",
        lambda c: replace(c, x=c.x[:, :32]),
        r"\[M, K\] and \[N, K\]",
    ),
    "x 3-D": ("norm_linear", lambda c: replace(c, x=c.x[None]), r"\[M, K\]"),
    "weight in float64": (
        "norm_linear",
        lambda c: replace(c, weight=c.weight.double()),
        "float16/bfloat16/float32",
    ),
    "x in int32": (
        "linear_residual",
        lambda c: replace(c, x=c.x.int(), weight=c.weight.int(), residual=c.residual.int()),
        "float16/bfloat16/float32",
    ),
    "weight transposed view": (
        "norm_linear",
        lambda c: replace(c, weight=c.weight.t().contiguous().t()),
        "contiguous",
    ),
    "x last dim strided": (
        "linear_residual",
        lambda c: replace(c, x=_strided_last_dim(c.x)),
        "contiguous",
    ),
    "bias of the wrong length": ("norm_linear", lambda c: replace(c, bias=c.bias[:-1]), "bias"),
    "norm weight of the wrong length": (
        "norm_linear",
        lambda c: replace(c, norm_weight=c.norm_weight[:-1]),
        "norm_weight",
    ),
    "residual with fewer rows": (
        "linear_residual",
        lambda c: replace(c, residual=c.residual[:-1]),
        "residual",
    ),
    "residual last dim strided": (
        "linear_residual",
        lambda c: replace(c, residual=_strided_last_dim(c.residual)),
        "residual's last dim",
    ),
    "gate_up with an odd row count": (
        "norm_linear_silu_mul",
        lambda c: replace(c, weight=c.weight[:-1], bias=None),
        "N even",
    ),
    "bias on another device": (
        "norm_linear",
        lambda c: replace(c, bias=c.bias.to("meta")),
        "one device",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_wrapper_rejects_bad_inputs(name: str) -> None:
    op, mutate, match = BAD_INPUTS[name]
    kernel, _, run, gate_up = OPS[op]
    case = mutate(make_case(4, 64, 48, True, gate_up=gate_up))
    with pytest.raises(ValueError, match=match):
        run(case, kernel)


def test_wrapper_rejects_cpu_tensors_without_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = make_case(1, 64, 48, False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        run_linear_residual(case, linear_residual)


def test_interpreter_tiles_cross_the_test_shapes() -> None:
    """The shapes above cross tile edges: N and K span several tiles, some partial."""
    for num_rows, k, n, _ in SHAPES.values():
        tiles = small_linear_tiles.tiles_for(num_rows, n, k, itemsize=4, interpret=True)
        assert tiles.use_dot == (num_rows > 4) and tiles.block_m >= num_rows
        assert n > tiles.block_n and k > tiles.block_k
