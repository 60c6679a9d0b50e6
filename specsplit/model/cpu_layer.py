"""The decoder layers in one call on the CPU: cpu_layer.c's `layers_forward`, `layer_forward` a
layer (float32), built with cpu_gemm.c's GEMM into one library (specsplit/model/cpu_gemm.py);
a run of layers a call, cut after each layer whose output an EAGLE-3 head reads (`layer_runs`).

Why: with the projections in the fixed-order kernel, the rest of a CPU step (norms, RoPE, the
K/V store, the per-sequence attention's gathers and SDPA, residuals, SiLU: ~25 torch ops a
layer) took a third of the embedded default's decode step, mostly per-op overhead. In C each
row (and each row and head in attention) is computed by itself, so a row's bits do not depend
on the rest of the step, as with the fixed-order GEMM.

`SPECSPLIT_CPU_LAYER=0` keeps the torch layer (DecoderLayer.forward, this path's reference);
the path needs the fixed-order route (specsplit/model/linear.py's `cpu_route`), float32
activations, a float32 or float16 cache (`KV_DTYPES`), and a head_dim of at most 512.
"""

from __future__ import annotations

import ctypes
import functools
import operator
from typing import Any

import torch

from specsplit.model import cpu_gemm, cpu_quant
from specsplit.model.batch import ForwardBatch
from specsplit.model.cpu_gemm import WeightArgs, weight_args
from specsplit.model.linear import cpu_route
from specsplit.switches import env_switch

# a layer is model/llama.py's DecoderLayer (not imported: llama imports this module)
DecoderLayer = Any

MAX_HEAD_DIM = 512  # cpu_layer.c's rope_row buffer
# the caches it reads and writes: float32, or float16 (K and V rounded once as they are stored,
# widened back as they are read: half the bytes a long context's step streams)
KV_DTYPES = (torch.float32, torch.float16)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


# a layer's vectors as cpu_layer.c's Layer names them: (field, submodule, parameter) of a
# DecoderLayer (the submodule or the parameter may be absent: NULL)
_VECTORS = (
    ("input_norm", "input_layernorm", "weight"), ("qkv_b", "qkv_proj", "bias"),
    ("q_norm", "q_norm", "weight"), ("k_norm", "k_norm", "weight"), ("o_b", "o_proj", "bias"),
    ("post_norm", "post_attention_layernorm", "weight"), ("gate_up_b", "gate_up_proj", "bias"),
    ("down_b", "down_proj", "bias"),
)  # fmt: skip
# its projections: (field, submodule), each a Weight
_PROJECTIONS = (
    ("qkv", "qkv_proj"),
    ("o", "o_proj"),
    ("gate_up", "gate_up_proj"),
    ("down", "down_proj"),
)


class LayerArgs(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "inter")),
        ("eps", ctypes.c_float),
        *((name, _ptr) for name, _, _ in _VECTORS),
        *((name, WeightArgs) for name, _ in _PROJECTIONS),
    ]


class StepArgs(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _i64),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slot_mapping", _ptr),
        ("key_slots", _ptr),
        ("key_start", _ptr),
        ("num_keys", _ptr),
        ("masks", _ptr),
        ("mask_start", _ptr),
        ("max_keys", _i64),
        ("kv_slot_stride", _i64),
        ("kv_head_stride", _i64),
        ("scale", ctypes.c_float),
        ("lanes", ctypes.c_int),
        ("threads", ctypes.c_int),
        ("kv_half", ctypes.c_int),
        ("scratch", _ptr),
    ]


@functools.cache
def switch() -> bool:
    """$SPECSPLIT_CPU_LAYER: "1" (default) or "0"."""
    return env_switch("SPECSPLIT_CPU_LAYER")


@functools.cache
def _functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    lib = cpu_gemm.library()
    assert lib is not None
    forward, scratch = lib.cdll.layers_forward, lib.cdll.layer_scratch_floats
    forward.argtypes = [_ptr, _i64, ctypes.POINTER(StepArgs), _ptr, _ptr, _ptr]
    forward.restype = None
    scratch.argtypes = [ctypes.POINTER(LayerArgs), _i64, _i64, ctypes.c_int]
    scratch.restype = _i64
    return forward, scratch


def _swap_setting(name: str, value: int) -> int:
    """cpu_layer.c's setting `name` (a swap_setting function) set to `value`; what it was."""
    lib = cpu_gemm.library()
    assert lib is not None
    fn = getattr(lib.cdll, name)
    fn.argtypes, fn.restype = [_i64], _i64
    return int(fn(value))


def grouped_from(keys: int) -> int:
    """Steps whose longest row sees at least `keys` keys attend by KV head (cpu_layer.c's
    attend_block a row at a time: a KV head's keys read once for all its query heads), shorter
    ones by query head; the same bits either way. Returns the number it replaces (tests: 0 for
    always, a large number for never)."""
    return _swap_setting("layer_grouped_from", keys)


def split_rows(rows: int) -> int:
    """Steps of at most `rows` rows that attend by KV head split each row's keys (and then its
    lanes of head_dim) over the threads (cpu_layer.c's attend_split); the same bits. Returns the
    number it replaces (tests: 0 for no step, a large number for every step)."""
    return _swap_setting("layer_split_rows", rows)


def blocked_from(rows: int) -> int:
    """Steps of at least `rows` rows attend by blocks of a sequence's rows (cpu_layer.c's
    attend_block: a block's keys read once for its rows and a KV head's query heads); the same
    bits. Returns the number it replaces (tests: 0 for every step, a large number for none)."""
    return _swap_setting("layer_blocked_from", rows)


def across_from(pairs: int) -> int:
    """Blocks of rows with at least `pairs` (row, query head) pairs a KV head score each block of
    16 keys across the lanes (cpu_layer.c's keys_across and scores_across: a block's keys
    transposed once for all its pairs); the same bits. Returns the number it replaces (tests: 0
    for every block, a large number for none)."""
    return _swap_setting("layer_across_from", pairs)


def weigh_across_from(pairs: int) -> int:
    """Blocks of rows with at least `pairs` (row, query head) pairs a KV head (and at least
    weigh_across's pairs at once) weigh each key's V for several pairs at once (cpu_layer.c's
    weigh_across); the same bits. Returns the number it replaces (tests: 0 for every block, a
    large number for none)."""
    return _swap_setting("layer_weigh_across_from", pairs)


def usable(hidden: torch.Tensor, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a step of `hidden` takes this path (module docstring)."""
    return (
        hidden.device.type == "cpu"
        and hidden.dtype == torch.float32
        and kv_dtype in KV_DTYPES
        and not torch.is_grad_enabled()
        and head_dim <= MAX_HEAD_DIM
        and switch()
        and cpu_route() == "fixed"
    )


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _parameter(layer: DecoderLayer, module: str, kind: str) -> torch.Tensor | None:
    """A parameter read from the modules' dicts (None: no such module or parameter): through
    nn.Module's attribute lookup the layer's check cost ~12 us a layer, 0.36 ms of a 20.8 ms
    step of the embedded default (0.07 ms so)."""
    held = layer._modules.get(module)
    return None if held is None else held._parameters.get(kind)


def layer_args(layer: DecoderLayer) -> LayerArgs:
    """The layer's sizes and weights as cpu_layer.c reads them (built again when a weight
    changed storage or its packed blocks came or went: the key, the parameters' storages and
    the packed runs themselves, held by the cache so that none is freed while it is kept)."""
    vectors = [_parameter(layer, module, kind) for _, module, kind in _VECTORS]
    weights = [_parameter(layer, module, "weight") for _, module in _PROJECTIONS]
    packs = [None if w is None else cpu_quant.packed(w) for w in weights]
    ptrs = [None if t is None else t.data_ptr() for t in (*vectors, *weights)]
    cached: tuple[list[int | None], list[Any], LayerArgs] | None = layer.__dict__.get("_cpu_args")
    if cached is not None and cached[0] == ptrs and all(map(operator.is_, cached[1], packs)):
        return cached[2]
    for t in (*vectors, *weights):
        assert t is None or (t.dtype == torch.float32 and t.is_contiguous()), "float32 weights"
    projections = [
        weight_args(weight, runs)  # type: ignore[arg-type]
        for weight, runs in zip(weights, packs, strict=True)
    ]
    args = LayerArgs(
        layer.input_layernorm.weight.shape[0],
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        layer.down_proj.weight.shape[1],
        layer.input_layernorm.eps,
        *map(_ptr_of, vectors),
        *projections,
    )
    layer._cpu_args = (ptrs, packs, args)  # type: ignore[assignment]
    return args


def _visible_runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a sequence's visibility [q_len, kv_len] (bool): each row's keys up to its last
    visible one (its num_keys: the keys past it are hidden, and a hidden key changes none of a
    row's sums), and whether the row sees every one of those (then it needs no mask). A causal
    prefill's row t of n sees n - q_len + t + 1 keys, all of them: without this each row scored
    all n keys and read its mask for each (the embedded default's 3,000-token prefill: 15.3 s)."""
    count = mask.shape[1]
    ends = (mask * torch.arange(1, count + 1, dtype=torch.int64)).amax(-1)
    return ends, mask.sum(-1) == ends


class CpuStep:
    """One forward's arguments to cpu_layer.c, shared by its layers: the rows' RoPE and slots,
    each row's keys (its sequence's, from the batch's reference plan) and visibility."""

    def __init__(
        self,
        batch: ForwardBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
        first: DecoderLayer,
        cache: torch.Tensor,
    ) -> None:
        lib = cpu_gemm.library()
        assert lib is not None
        num_tokens = batch.input_ids.shape[0]
        key_start = torch.zeros(num_tokens, dtype=torch.int64)
        num_keys = torch.zeros(num_tokens, dtype=torch.int64)
        mask_start = torch.full((num_tokens,), -1, dtype=torch.int64)
        slots, masks = [], []
        key_offset = mask_offset = max_keys = 0
        for q_start, q_end, seq_slots, mask in batch.reference_plan():
            kv_len = seq_slots.shape[0]
            key_start[q_start:q_end] = key_offset
            num_keys[q_start:q_end] = kv_len
            slots.append(seq_slots)
            key_offset += kv_len
            max_keys = max(max_keys, kv_len)
            if mask is not None:
                ends, whole = _visible_runs(mask)
                num_keys[q_start:q_end] = ends
                if bool(whole.all()):
                    continue  # (a prefill's causal rows: each sees all its keys up to its end)
                q_len = q_end - q_start
                rows = torch.arange(q_len, dtype=torch.int64)
                starts = mask_offset + rows * kv_len
                mask_start[q_start:q_end] = torch.where(whole, -1, starts)
                masks.append(mask.reshape(-1).to(torch.uint8))
                mask_offset += q_len * kv_len
        self._keep = (
            cos := cos.contiguous(),
            sin := sin.contiguous(),
            slot_mapping := batch.slot_mapping.to(torch.int64).contiguous(),
            key_slots := (torch.cat(slots) if slots else torch.zeros(1, dtype=torch.int64)),
            key_start,
            num_keys,
            mask_rows := torch.cat(masks) if masks else None,
            mask_start,
        )
        threads = torch.get_num_threads()
        forward, scratch_floats = _functions()
        self.args = StepArgs(
            num_tokens,
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            key_slots.data_ptr(),
            key_start.data_ptr(),
            num_keys.data_ptr(),
            _ptr_of(mask_rows),
            mask_start.data_ptr(),
            max_keys,
            *cache.stride()[:2],
            first.head_dim**-0.5,
            lib.lanes,
            threads,
            cache.dtype == torch.float16,
            None,
        )
        size = scratch_floats(ctypes.byref(layer_args(first)), num_tokens, max_keys, threads)
        self.scratch = torch.empty(size, dtype=torch.float32)
        self.args.scratch = self.scratch.data_ptr()
        self._forward = forward

    def run(
        self, layers: list[DecoderLayer], hidden: torch.Tensor, k: list[torch.Tensor],
        v: list[torch.Tensor],
    ) -> None:  # fmt: skip
        """`hidden` [T, hidden] (contiguous float32) through `layers` in turn, in place, in one
        C call; layer i's K/V written into `k[i]` / `v[i]` [num_slots, num_kv_heads, head_dim]
        (the strides of the `cache` this step was built with)."""
        assert hidden.is_contiguous() and len(layers) == len(k) == len(v)
        strides = (self.args.kv_slot_stride, self.args.kv_head_stride, 1)
        assert all(t.stride() == strides for t in (*k, *v)), "the step's K/V strides"
        count = len(layers)
        args = (_ptr * count)(*(ctypes.addressof(layer_args(layer)) for layer in layers))
        k_ptrs = (_ptr * count)(*(t.data_ptr() for t in k))
        v_ptrs = (_ptr * count)(*(t.data_ptr() for t in v))
        self._forward(args, count, ctypes.byref(self.args), hidden.data_ptr(), k_ptrs, v_ptrs)


def layer_runs(num_layers: int, aux_layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """The layers as runs [start, stop) that `CpuStep.run` takes in one call each: a run ends
    after every layer whose output is asked for (`aux_layers`, read between the calls)."""
    stops = sorted({i + 1 for i in aux_layers if i < num_layers} | {num_layers})
    return list(zip([0, *stops[:-1]], stops, strict=True))
