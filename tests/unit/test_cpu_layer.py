"""The CPU's decoder layer in one C call (specsplit/model/cpu_layer.c via cpu_layer.py): equal
to the torch layer it replaces within float32 rounding, every row's bits independent of the
rest of the step (other sequences, the step's row count, keys hidden from the row, the thread
count), and taken only where it applies. Against transformers' logits on every architecture:
tests/unit/test_model_vs_transformers.py (which runs this path by default)."""

from __future__ import annotations

import contextlib
import ctypes
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from specsplit.kv_cache import KVCache
from specsplit.model import cpu_gemm, cpu_layer
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from tests.forward_steps import TINY_LLAMA, VOCAB, causal_step, make_batch, new_seqs, tree_step

pytestmark = [
    pytest.mark.raw_kv,  # forward math on hand-built caches
    pytest.mark.skipif(cpu_gemm.library() is None, reason="cpu_gemm's library does not build"),
]

CONFIGS: dict[str, Any] = {
    "llama_biases_gqa": LlamaConfig(
        **TINY_LLAMA, num_key_value_heads=2, attention_bias=True, mlp_bias=True
    ),
    "qwen3_qk_norm": Qwen3Config(
        **TINY_LLAMA, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
    ),
    # the head widths whose attention sums stay in registers (cpu_layer.c's weigh16_4 / _8)
    "llama_head_dim_64": LlamaConfig(**TINY_LLAMA, num_key_value_heads=2, head_dim=64),
    "llama_head_dim_128": LlamaConfig(**TINY_LLAMA, num_key_value_heads=1, head_dim=128),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param], dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():  # O(1) activations, biases that matter
            scale = 0.5 if name.endswith("bias") else param.shape[-1] ** -0.5
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * (1.0 if "embed" in name else scale))
    path: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    loaded, _ = load_model(str(path), torch.float32, "cpu")
    return loaded


@pytest.fixture
def torch_layers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The torch layer (the path's reference) for this test's forwards."""
    monkeypatch.setattr(cpu_layer, "switch", lambda: False)
    yield


def _kv(
    model: LlamaModel, page_size: int = 4, heads_outer: bool = True,
    dtype: torch.dtype = torch.float32,
) -> KVCache:  # fmt: skip
    return make_kv_cache(model.config, 96, page_size, dtype, "cpu", heads_outer)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ragged_then_trees(
    model: LlamaModel, page_size: int, heads_outer: bool = True,
    kv_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:  # fmt: skip
    """Three sequences prefilled together, then a tree step each: every forward's logits."""
    kv = _kv(model, page_size, heads_outer, kv_dtype)
    prompts = [_tokens(n, seed) for seed, n in enumerate((7, 19, 2))]
    seqs = new_seqs(kv, [n + 8 for n in (7, 19, 2)], random.Random(page_size))
    out = [model(make_batch([causal_step(s, p) for s, p in zip(seqs, prompts, strict=True)]), kv)]
    for seq, prompt in zip(seqs, prompts, strict=True):
        seq.kv_committed_len = len(prompt)
    steps = [tree_step(s, 5 + i, [11, 12, 13, 14], [-1, -1, 0, 2]) for i, s in enumerate(seqs)]
    out.append(model(make_batch(steps), kv))
    return [o.logits for o in out]


@pytest.mark.parametrize("page_size", [1, 16])
def test_equals_the_torch_layer(
    model: LlamaModel, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = _ragged_then_trees(model, page_size)
    monkeypatch.setattr(cpu_layer, "switch", lambda: False)
    want = _ragged_then_trees(model, page_size)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=3e-5, rtol=0)


def _record_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of layers of each CpuStep.run call from now on."""
    runs: list[int] = []
    run = cpu_layer.CpuStep.run
    monkeypatch.setattr(
        cpu_layer.CpuStep, "run", lambda self, *a: (runs.append(len(a[0])), run(self, *a))[1]
    )
    return runs


def test_the_path_is_taken(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _record_runs(monkeypatch)
    kv = _kv(model)
    (seq,) = new_seqs(kv, [6], random.Random(0))
    model(make_batch([causal_step(seq, _tokens(6, 1))]), kv)
    assert runs == [len(model.layers)]  # every layer in one C call


def _aux_forward(model: LlamaModel, aux: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 9-token prefill's logits and the hidden states of layers `aux` (every row)."""
    kv = _kv(model)
    (seq,) = new_seqs(kv, [9], random.Random(3))
    batch = make_batch([causal_step(seq, _tokens(9, 4))])
    batch.hidden_indices = torch.arange(9)
    out = model(batch, kv, aux_layers=aux)
    assert out.hidden_states is not None
    return out.logits, out.hidden_states


@pytest.mark.parametrize("aux", [(0,), (0, 1), (1, 3), (3,)])
def test_asked_layers_end_runs_and_equal_the_torch_layers(
    model: LlamaModel, aux: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EAGLE-3 target's asked layers (3: the final norm's output) end runs of layers, each
    read between two C calls: the same hidden states as the torch layers give."""
    assert len(model.layers) == 3
    assert cpu_layer.layer_runs(3, aux) == {
        (0,): [(0, 1), (1, 3)], (0, 1): [(0, 1), (1, 2), (2, 3)], (1, 3): [(0, 2), (2, 3)],
        (3,): [(0, 3)],
    }[aux]  # fmt: skip
    runs = _record_runs(monkeypatch)
    logits, hidden = _aux_forward(model, aux)
    assert runs == [stop - start for start, stop in cpu_layer.layer_runs(3, aux)]
    monkeypatch.setattr(cpu_layer, "switch", lambda: False)
    want_logits, want_hidden = _aux_forward(model, aux)
    torch.testing.assert_close(hidden, want_hidden, atol=3e-5, rtol=0)
    torch.testing.assert_close(logits, want_logits, atol=3e-5, rtol=0)


def test_a_rows_bits_do_not_depend_on_the_rest_of_the_step(
    model: LlamaModel, attention_by: str
) -> None:
    """A sequence's decode row alone, beside other sequences' prefills and as the root row of a
    verify tree (which hides the tree's nodes from it): the same bits; so are a tree node's and
    the same tokens' chain (its siblings hidden from it)."""
    kv = _kv(model)
    prompt = _tokens(13, 2)
    (seq,) = new_seqs(kv, [32], random.Random(3))
    model(make_batch([causal_step(seq, prompt)]), kv)
    seq.kv_committed_len = len(prompt)
    alone = model(make_batch([causal_step(seq, [9])]), kv).logits[0]
    others = new_seqs(kv, [20, 4], random.Random(4))
    beside = model(
        make_batch(
            [causal_step(others[0], _tokens(20, 5)), causal_step(seq, [9]),
             causal_step(others[1], _tokens(4, 6))]
        ),
        kv,
    ).logits[20]  # fmt: skip
    tree = model(make_batch([tree_step(seq, 9, [30, 31, 32], [-1, -1, 1])]), kv).logits
    chain = model(make_batch([tree_step(seq, 9, [31, 32], [-1, 0])]), kv).logits
    assert torch.equal(alone, beside)
    assert torch.equal(alone, tree[0])
    assert torch.equal(tree[3], chain[2])  # node 32 under 31, node 30 hidden from it
    assert torch.equal(tree[2], chain[1])


ATTENTION = (
    "by query head",
    "by KV head",
    "keys split",
    "rows blocked",
    "rows blocked, keys across",
)


@contextlib.contextmanager
def _attention(by: str) -> Iterator[None]:
    """Every step's attention one way (cpu_layer.c's attend_row "by query head", attend_block a
    row at a time "by KV head", attend_split "keys split": each row's keys over the threads, or
    attend_block "rows blocked": a sequence's rows in blocks, each query head's scores alone, or
    "rows blocked, keys across": each block of keys across the lanes for all of them), whatever
    its keys and rows (where head_dim and the heads allow all but the first)."""
    assert by in ATTENTION
    blocks = by.startswith("rows blocked")
    was = cpu_layer.grouped_from(1 << 40 if by == "by query head" else 0)
    was_split = cpu_layer.split_rows(1 << 40 if by == "keys split" else 0)
    was_blocked = cpu_layer.blocked_from(0 if blocks else 1 << 40)
    across = 0 if by.endswith("keys across") else 1 << 40
    was_across = cpu_layer.across_from(across), cpu_layer.weigh_across_from(across)
    try:
        yield
    finally:
        cpu_layer.grouped_from(was)
        cpu_layer.split_rows(was_split)
        cpu_layer.blocked_from(was_blocked)
        cpu_layer.across_from(was_across[0])
        cpu_layer.weigh_across_from(was_across[1])


@pytest.fixture(params=ATTENTION)
def attention_by(request: pytest.FixtureRequest) -> Iterator[str]:
    with _attention(request.param):
        yield request.param


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_by_kv_head_gives_the_bits_by_query_head(
    model: LlamaModel, page_size: int, kv_dtype: torch.dtype
) -> None:
    """Ragged prefills and trees (keys hidden from rows, blocks of 16 keys cut short): each query
    head's operations are the same in attend_block as in attend_row, so the same logits; from a
    float16 cache too (each path's keys widened as they are loaded)."""
    with _attention("by query head"):
        by_head = _ragged_then_trees(model, page_size, kv_dtype=kv_dtype)
    for other in ("by KV head", "rows blocked", "rows blocked, keys across"):
        with _attention(other):
            by_other = _ragged_then_trees(model, page_size, kv_dtype=kv_dtype)
        for a, b in zip(by_head, by_other, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), other


@pytest.fixture(scope="module", params=["head_dim_64", "head_dim_128"])
def long_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> LlamaModel:
    """A model whose rows may see more keys than attend_split's pieces (SPLIT_KEYS, 256)."""
    torch.manual_seed(1)
    config = {**TINY_LLAMA, "max_position_embeddings": 1024}
    kv_heads = 2 if request.param == "head_dim_64" else 1
    head_dim = 64 if request.param == "head_dim_64" else 128
    hf = AutoModelForCausalLM.from_config(
        LlamaConfig(**config, num_key_value_heads=kv_heads, head_dim=head_dim),
        dtype=torch.float32,
    ).eval()
    path: Path = tmp_path_factory.mktemp(f"long_{request.param}")
    hf.save_pretrained(path)
    return load_model(str(path), torch.float32, "cpu")[0]


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    was = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def _long_rows(
    model: LlamaModel, page_size: int, threads: int, heads_outer: bool = True,
    kv_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:  # fmt: skip
    """A 601-token and a 9-token prompt prefilled together (the short row's pieces past its keys
    empty), then a decode step of the long one alone (one row), then a tree step each (nodes
    hidden from rows across a piece's edge): every forward's logits, on `threads` threads."""
    with _threads(threads):
        num_pages = 700 // page_size + 8
        kv = make_kv_cache(model.config, num_pages, page_size, kv_dtype, "cpu", heads_outer)
        lengths = (601, 9)
        prompts = [_tokens(n, 10 + n) for n in lengths]
        seqs = new_seqs(kv, [n + 12 for n in lengths], random.Random(page_size))
        batch = [causal_step(s, p) for s, p in zip(seqs, prompts, strict=True)]
        out = [model(make_batch(batch), kv)]
        for seq, prompt in zip(seqs, prompts, strict=True):
            seq.kv_committed_len = len(prompt)
        out.append(model(make_batch([causal_step(seqs[0], [7])]), kv))
        trees = [tree_step(s, 5 + i, [11, 12, 13, 14], [-1, -1, 0, 2]) for i, s in enumerate(seqs)]
        out.append(model(make_batch(trees), kv))
        return [o.logits for o in out]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("by", ["keys split", "rows blocked", "rows blocked, keys across"])
def test_long_rows_give_the_bits_by_query_head(
    long_model: LlamaModel, page_size: int, by: str, kv_dtype: torch.dtype
) -> None:
    """attend_split's pieces (scores by pieces of keys, their largest merged by max, the weighted
    sums by lanes of head_dim) and attend_block's blocks of rows (a 601-row prefill: 38 blocks,
    their rows' keys ending apart, the 9-token prompt's rows a block of their own) keep each
    query head's operations: attend_row's logits, on 2, 3 and 5 threads (attend_split's weighted
    sums in pieces of a whole head's lanes, half and a quarter of them); from a float16 cache
    too."""
    with _attention("by query head"):
        want = _long_rows(long_model, page_size, 2, kv_dtype=kv_dtype)
    for threads in (2, 3, 5):
        with _attention(by):
            got = _long_rows(long_model, page_size, threads, kv_dtype=kv_dtype)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("by", ATTENTION)
def test_a_slot_major_cache_gives_the_bits_of_a_heads_outer_one(
    long_model: LlamaModel, page_size: int, by: str
) -> None:
    """The C layer reads and writes K / V by the cache's strides: a slot-major pool (the GPU's
    layout) and the CPU's heads-outer one give the same logits, each way of attending."""
    with _attention(by):
        want = _long_rows(long_model, page_size, 2, heads_outer=True)
        got = _long_rows(long_model, page_size, 2, heads_outer=False)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with _attention(by):
        want = _ragged_then_trees(long_model, page_size, heads_outer=True)
        got = _ragged_then_trees(long_model, page_size, heads_outer=False)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_float16_cache_holds_the_float32_values_rounded(
    model: LlamaModel, page_size: int
) -> None:
    """The C layer stores K and V rounded to float16 as torch rounds them (to nearest, ties to
    even): the first layer's, computed before any attention, are the float32 cache's rounded;
    the logits stay near the float32 cache's."""
    caches, logits = [], []
    for dtype in (torch.float32, torch.float16):
        kv = _kv(model, page_size, dtype=dtype)
        (seq,) = new_seqs(kv, [40], random.Random(page_size))
        logits.append(model(make_batch([causal_step(seq, _tokens(33, 4))]), kv).logits)
        caches.append(kv.data[0])
    assert caches[1].dtype == torch.float16
    assert torch.equal(caches[0].to(torch.float16).view(torch.int16), caches[1].view(torch.int16))
    torch.testing.assert_close(logits[1], logits[0], atol=0.05, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_float16_cache_equals_the_torch_layer_on_one(
    model: LlamaModel, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch layer (the reference) reads a float16 cache widened to float32, as the C layer
    does: the same logits within what a K or V rounded the other way moves them (each layer
    stores its own K and V, a few ulp of float32 apart, so a rounding can go either way)."""
    got = _ragged_then_trees(model, page_size, kv_dtype=torch.float16)
    monkeypatch.setattr(cpu_layer, "switch", lambda: False)
    want = _ragged_then_trees(model, page_size, kv_dtype=torch.float16)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=5e-3, rtol=0)


def test_a_float16_cache_keeps_a_rows_bits_whatever_the_step(model: LlamaModel) -> None:
    """A decode row alone, beside another sequence's prefill and as a verify tree's root: the
    same bits from a float16 cache, by every way of attending."""
    for by in ATTENTION:
        with _attention(by):
            kv = _kv(model, dtype=torch.float16)
            (seq,) = new_seqs(kv, [32], random.Random(3))
            prompt = _tokens(13, 2)
            model(make_batch([causal_step(seq, prompt)]), kv)
            seq.kv_committed_len = len(prompt)
            alone = model(make_batch([causal_step(seq, [9])]), kv).logits[0]
            (other,) = new_seqs(kv, [20], random.Random(4))
            batch = make_batch([causal_step(other, _tokens(20, 5)), causal_step(seq, [9])])
            beside = model(batch, kv).logits[20]
            tree = model(make_batch([tree_step(seq, 9, [30, 31, 32], [-1, -1, 1])]), kv).logits
            assert torch.equal(alone, beside), by
            assert torch.equal(alone, tree[0]), by


@pytest.mark.skipif(
    cpu_gemm.library() is None or cpu_gemm.library().lanes != 16, reason="needs AVX-512"
)
def test_a_keys_lane_sums_are_its_dot_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_layer.c's sums16 (16 keys' lane sums at once, by block shuffles) gives each key the
    bits of _mm512_reduce_add_ps over its vector, as dot16 sums one key: 20,000 random blocks."""
    library = cpu_gemm.library()
    assert library is not None
    check = library.cdll.layer_sums16_mismatches
    check.argtypes, check.restype = [ctypes.c_int64], ctypes.c_int64
    assert check(20_000) == 0


@pytest.mark.skipif(cpu_gemm.library() is None, reason="needs AVX2 or AVX-512")
def test_a_keys_lane_sums_are_its_dot_products_with_avx2() -> None:
    """cpu_layer.c's sums8 (8 keys' lane sums at once, AVX2) gives each key the bits of dot8's
    tree over its vector: 20,000 random blocks."""
    library = cpu_gemm.library()
    assert library is not None
    check = library.cdll.layer_sums8_mismatches
    check.argtypes, check.restype = [ctypes.c_int64], ctypes.c_int64
    assert check(20_000) == 0


@pytest.mark.skipif(
    cpu_gemm.library() is None or cpu_gemm.library().lanes != 16, reason="needs AVX-512"
)
def test_exp8_gives_exp16s_bits() -> None:
    """cpu_layer.c's AVX2 e^x (exp8: 2^n as two factors) gives each lane exp16's bits, from
    where both are 0 through the subnormals to past where both are inf."""
    library = cpu_gemm.library()
    assert library is not None
    check = library.cdll.layer_exp8_mismatches
    check.argtypes = [ctypes.c_float, ctypes.c_float, ctypes.c_int64]
    check.restype = ctypes.c_int64
    assert check(-110.0, 1e-4, 2_100_000) == 0  # -110 .. 100
    assert check(-1.0, 1e-7, 2_000_000) == 0  # -1 .. 1, finely


def test_threads_do_not_change_the_bits(model: LlamaModel) -> None:
    results = []
    for count in (1, 2, 3):
        with _threads(count):
            results.append(_ragged_then_trees(model, 16))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@torch.no_grad()
def test_the_torch_layer_where_the_path_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden = torch.zeros(3, 8)
    assert cpu_layer.usable(hidden, torch.float32, 64)
    assert not cpu_layer.usable(hidden.double(), torch.float64, 64)
    assert not cpu_layer.usable(hidden, torch.bfloat16, 64)  # the cache's dtype
    assert not cpu_layer.usable(hidden, torch.float32, cpu_layer.MAX_HEAD_DIM + 2)
    with torch.enable_grad():  # (a forward autograd records)
        assert not cpu_layer.usable(hidden, torch.float32, 64)
    monkeypatch.setattr(cpu_layer, "cpu_route", lambda: "weight_major")
    assert not cpu_layer.usable(hidden, torch.float32, 64)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_layer, "switch", lambda: False)
    assert not cpu_layer.usable(hidden, torch.float32, 64)


def test_the_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_layer.switch.cache_clear()
    try:
        monkeypatch.setenv("SPECSPLIT_CPU_LAYER", "0")
        assert not cpu_layer.switch()
        cpu_layer.switch.cache_clear()
        monkeypatch.setenv("SPECSPLIT_CPU_LAYER", "on")
        with pytest.raises(SystemExit, match="SPECSPLIT_CPU_LAYER"):
            cpu_layer.switch()
    finally:
        cpu_layer.switch.cache_clear()


def test_a_weight_replaced_is_read_again(model: LlamaModel, torch_layers: None) -> None:
    """The layers' cached arguments follow a parameter given new storage."""
    layer = model.layers[0]
    first = cpu_layer.layer_args(layer)  # type: ignore[arg-type]
    assert cpu_layer.layer_args(layer) is first  # type: ignore[arg-type]
    old = layer.o_proj.weight
    try:
        layer.o_proj.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
        again = cpu_layer.layer_args(layer)  # type: ignore[arg-type]
        assert again is not first and again.o.w == layer.o_proj.weight.data_ptr()
    finally:
        layer.o_proj.weight = old
