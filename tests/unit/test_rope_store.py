"""The RoPE + K/V store Triton kernel equals its plain-torch reference (float32, under the Triton
interpreter on the CPU): the rotated q it returns and every row of the cache after it, for
decode and ragged token counts, GQA, head_dim 16/64/128, q/k/v split from one fused qkv row,
caches as strided views of a pool of layers, shuffled slots and a padding slot written by
several tokens; and its wrapper refuses what it cannot run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from specsplit.kernels.rope_store import rope_store, rope_store_reference
from specsplit.model.rope import rope_cos_sin, rope_inv_freq

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


SENTINEL = 7.0  # cache rows no token writes, and the other layers, keep this value
NUM_LAYERS, LAYER = 3, 1  # the caches under test are layer 1's of a 3-layer pool


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D], a view of qkv
    k: torch.Tensor  # [T, Hk, D], a view of qkv
    v: torch.Tensor  # [T, Hk, D], a view of qkv
    cos: torch.Tensor  # [T, D]
    sin: torch.Tensor  # [T, D]
    k_cache: torch.Tensor  # [num_slots, Hk, D], a view of `pool`
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64

    def args(self) -> dict[str, Any]:
        return dict(self.__dict__)


def make_case(
    num_tokens: int,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    slots: list[int] | None = None,  # default: T distinct shuffled slots
    num_slots: int = 64,
    seed: int = 0,
) -> tuple[Case, torch.Tensor]:
    """A case and the pool its caches are views of: [layers, 2 (K, V), num_slots, Hk, D],
    filled with SENTINEL, as KVCache lays it out."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen)  # the fused projection's output
    kv_width = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_width, kv_width], dim=-1)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    inv_freq = rope_inv_freq(head_dim, 10000.0, None)
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32)
    if slots is None:
        slots = torch.randperm(num_slots, generator=gen)[:num_tokens].tolist()
    pool = torch.full((NUM_LAYERS, 2, num_slots, num_kv_heads, head_dim), SENTINEL)
    case = Case(
        q=q.view(num_tokens, num_heads, head_dim),
        k=k.view(num_tokens, num_kv_heads, head_dim),
        v=v.view(num_tokens, num_kv_heads, head_dim),
        cos=cos,
        sin=sin,
        k_cache=pool[LAYER, 0],
        v_cache=pool[LAYER, 1],
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return case, pool


def run_both(case: Case, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel and reference on copies of the same pool: (kernel's q, reference's q), after
    asserting the two pools are equal."""
    ref_pool = pool.clone()
    ref_case = replace(case, k_cache=ref_pool[LAYER, 0], v_cache=ref_pool[LAYER, 1])
    want = rope_store_reference(**ref_case.args())
    got = rope_store(**case.args())
    torch.testing.assert_close(pool, ref_pool, atol=1e-6, rtol=1e-6)
    return got, want


def assert_matches_reference(case: Case, pool: torch.Tensor) -> None:
    """The rotated q, the written cache rows, and SENTINEL everywhere else in the pool."""
    got, want = run_both(case, pool)
    assert got.shape == case.q.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    written = torch.zeros(pool.shape[2], dtype=torch.bool)
    written[case.slot_mapping] = True
    assert (pool[:, :, ~written] == SENTINEL).all(), "a slot no token maps to was written"
    others = [layer for layer in range(NUM_LAYERS) if layer != LAYER]
    assert (pool[others] == SENTINEL).all(), "another layer's cache was written"


def test_decode_one_token() -> None:
    assert_matches_reference(*make_case(1))


@pytest.mark.parametrize("num_tokens", [7, 33])
def test_ragged_token_counts(num_tokens: int) -> None:
    assert_matches_reference(*make_case(num_tokens))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 128), (32, 8, 16), (2, 1, 16)],  # SmolLM2, MHA, Llama-8B's heads, MQA
)
def test_gqa_layouts_and_head_dims(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    case, pool = make_case(5, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    assert_matches_reference(case, pool)


def test_rotation_of_a_known_vector() -> None:
    """An exact value: position p rotates each (x[i], x[i + D/2]) pair by p * inv_freq[i]."""
    head_dim, position = 4, 3
    inv_freq = rope_inv_freq(head_dim, 10000.0, None)  # [D/2]
    cos, sin = rope_cos_sin(torch.tensor([position]), inv_freq, torch.float32)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [T=1, H=1, D]
    case, _ = make_case(1, num_heads=1, num_kv_heads=1, head_dim=head_dim)
    case = replace(case, q=x, k=x.clone(), cos=cos, sin=sin)
    got = rope_store(**case.args())
    c, s = (position * inv_freq).cos(), (position * inv_freq).sin()
    want = torch.cat([x[0, 0, :2] * c - x[0, 0, 2:] * s, x[0, 0, 2:] * c + x[0, 0, :2] * s])
    torch.testing.assert_close(got[0, 0], want)
    torch.testing.assert_close(case.k_cache[case.slot_mapping[0], 0], want)


def test_shuffled_slots_land_in_their_rows() -> None:
    slots = [41, 3, 17, 63, 0, 22]  # out of order, the first and last slot of the pool
    case, pool = make_case(len(slots), slots=slots)
    assert_matches_reference(case, pool)
    for token, slot in enumerate(slots):
        torch.testing.assert_close(pool[LAYER, 1, slot], case.v[token])


def test_padding_tokens_share_one_scratch_slot() -> None:
    """CUDA-graph padding: several padded tokens (same inputs) write one scratch slot."""
    scratch = 63
    case, pool = make_case(6, slots=[5, 9, scratch, scratch, scratch, scratch])
    for t in (3, 4, 5):  # padding rows carry what the first padding row does
        for tensor in (case.q, case.k, case.v, case.cos, case.sin):
            tensor[t] = tensor[2]
    assert_matches_reference(case, pool)


def test_out_buffer_is_written_in_place() -> None:
    case, pool = make_case(3)
    out = torch.full_like(case.q, SENTINEL)
    got = rope_store(**case.args(), out=out)
    assert got.data_ptr() == out.data_ptr()
    ref_pool = pool.clone()
    ref_case = replace(case, k_cache=ref_pool[LAYER, 0], v_cache=ref_pool[LAYER, 1])
    torch.testing.assert_close(out, rope_store_reference(**ref_case.args()))


def test_no_tokens_writes_nothing() -> None:
    case, pool = make_case(0)
    assert rope_store(**case.args()).shape == (0, 4, 16)
    assert (pool == SENTINEL).all()


def _strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]


BAD_INPUTS: dict[str, tuple[Callable[[Case], Case], str]] = {
    "slot_mapping int32": (lambda c: replace(c, slot_mapping=c.slot_mapping.int()), "int64"),
    "slot_mapping shorter than T": (
        lambda c: replace(c, slot_mapping=c.slot_mapping[:-1]),
        "slot_mapping",
    ),
    "k with fewer tokens than q": (lambda c: replace(c, k=c.k[:-1], v=c.v[:-1]), "num_kv_heads"),
    "cos with fewer tokens than q": (lambda c: replace(c, cos=c.cos[:-1]), "cos .* and sin"),
    "k and v shapes differ": (lambda c: replace(c, v=c.v[:, :1]), "k and v"),
    "cos in another dtype": (lambda c: replace(c, cos=c.cos.double()), "float16/bfloat16"),
    "q in float64": (
        lambda c: replace(c, **{n: getattr(c, n).double() for n in ("q", "k", "v", "cos", "sin")}),
        "float16/bfloat16",
    ),
    "head_dim not a power of two": (
        lambda c: replace(c, **{n: getattr(c, n)[..., :12] for n in ("q", "k", "v", "cos", "sin")}),
        "power of two",
    ),
    "cache heads differ from k's": (
        lambda c: replace(c, k_cache=c.k_cache[:, :1], v_cache=c.v_cache[:, :1]),
        "k_cache",
    ),
    "cache dtypes differ": (lambda c: replace(c, v_cache=c.v_cache.double()), "one floating"),
    "q last dim strided": (lambda c: replace(c, q=_strided_last_dim(c.q)), "contiguous"),
    "cache last dim strided": (
        lambda c: replace(c, k_cache=_strided_last_dim(c.k_cache)),
        "contiguous",
    ),
    "slot_mapping on another device": (
        lambda c: replace(c, slot_mapping=c.slot_mapping.to("meta")),
        "device",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_wrapper_rejects_bad_inputs(name: str) -> None:
    mutate, match = BAD_INPUTS[name]
    case, _ = make_case(4)
    with pytest.raises(ValueError, match=match):
        rope_store(**mutate(case).args())


def test_wrapper_rejects_cpu_tensors_without_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case, _ = make_case(1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        rope_store(**case.args())
