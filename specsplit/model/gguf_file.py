"""A GGUF file's weights read straight into a transformers-named state dict (`GGUFStateDict`),
without building the transformers model: the header and metadata parsed once with `struct`
over a memory map (`GGUFFile`, 0.05 s for the embedded default), each tensor dequantized when it
is read (by the `gguf` package on the host; for a GPU, common formats on the GPU from their
stored bytes, specsplit/model/gguf_dequant.py), and the config transformers would make
(`model_config`, without importing transformers).

transformers' own GGUF path (`from_pretrained(gguf_file=...)`) parses the metadata twice with
`gguf.GGUFReader` (1.9 s each for SmolLM2's 49k-token vocabulary: a numpy view per string),
rebuilds a tensor name map for each of the model's modules and allocates a model in `dtype` to
copy the tensors into: the embedded default took ~11 s to load on the 2-core VM, ~16 s in each
of `up`'s three processes at once (bench/RESULTS.md). The tensors here are the same: the
same dequantization, and the query / key rows put back in the checkpoint's order as
transformers does for the `llama` architecture (llama.cpp's converter interleaves each head's
rotary halves; tests/unit/test_gguf_file.py compares every tensor with transformers').

Covers the architectures whose config ModelConfig supports: `llama` (Llama, SmolLM2 and
Mistral, which llama.cpp writes as `llama`), `qwen2`, `qwen3`.
"""

from __future__ import annotations

import logging
import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from specsplit.model import gguf_dequant
from specsplit.model.config import ModelConfig

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ARCHITECTURES = ("llama", "qwen2", "qwen3")
PERMUTED = ("llama",)  # architectures whose q / k rows llama.cpp's converter permuted

# GGUF metadata value types (gguf.GGUFValueType): struct formats of the scalar ones
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY |= {10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# tensor types read as stored (the others dequantized to float32 by gguf)
_AS_STORED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}

# GGUF metadata keys -> transformers' config keys, as transformers maps them for these
# architectures (its GGUF_CONFIG_MAPPING): "{architecture}." + key, then the tokenizer's ids
_CONFIG = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_HEAD_DIM = {"llama": "rope.dimension_count"}  # (transformers ignores it for qwen2 / qwen3)
# what transformers' config classes (5.x) give where the mapped keys leave a field out: Llama's
# and Mistral's head_dim hidden / heads (from_hf's fallback), Qwen3's 128 (transformers takes
# it from the class, not the file); Llama's KV heads as many as the query heads, the others' a
# constant; Mistral's sliding window (Qwen2's and Qwen3's off)
_COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "hidden_act": "silu"}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON
    | {"vocab_size": 32_000, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": _COMMON
    | {"vocab_size": 32_000, "max_position_embeddings": 131_072, "bos_token_id": 1}
    | {"eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": _COMMON
    | {"vocab_size": 151_936, "max_position_embeddings": 32_768, "num_key_value_heads": 32},
    "qwen3": _COMMON
    | {"vocab_size": 151_936, "max_position_embeddings": 32_768, "num_key_value_heads": 32}
    | {"head_dim": 128},
}
_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# GGUF tensor names -> transformers' (per layer: "blk.{i}." -> "model.layers.{i}.")
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # transformers' order (GGUF lists the fastest dimension first)
    qtype: GGMLQuantizationType
    offset: int  # from the start of the file


class _Cursor:
    """Reads GGUF's little-endian fields from a buffer, in order."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        raw = bytes(self.buffer[self.pos : self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:  # numbers: one view, copied out of the map
                dtype = np.dtype(_NUMPY[item_type])
                items = np.frombuffer(self.buffer, dtype, count, self.pos).copy()
                self.pos += count * dtype.itemsize
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"GGUF: unknown metadata value type {value_type}")
        return self.scalar(_SCALARS[value_type])


class GGUFFile:
    """A GGUF file's metadata (`metadata`: key -> value) and tensor infos (`tensors`, by GGUF
    name), the tensors read from a read-only memory map (`array`: dequantized, float32 for the
    quantized types and BF16, as stored for F32 / F16). Use as a context manager (closes the
    map)."""

    def __init__(self, path: str) -> None:
        self._file: BinaryIO = open(path, "rb")  # noqa: SIM115 (closed by close())
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._view = memoryview(self._map)
        cursor = _Cursor(self._view)
        if bytes(self._view[:4]) != MAGIC:
            self.close()
            raise ValueError(f"{path}: not a GGUF file")
        cursor.pos = 4
        version = cursor.scalar("<I")
        num_tensors, num_keys = cursor.scalar("<Q"), cursor.scalar("<Q")
        if version < 2:
            self.close()
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and later)")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_keys):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            qtype, offset = GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cursor.pos // alignment) * alignment
        self.tensors = {
            name: TensorInfo(name, shape, qtype, start + offset)
            for name, shape, qtype, offset in infos
        }
        # per (format, device type): whether the device's dequantization gave gguf's values on
        # the first row it read (`tensor`); False: that format is read by gguf's numpy
        self._on_device: dict[tuple[GGMLQuantizationType, str], bool] = {}

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def supported_architecture(self) -> str:
        """`architecture`, one of ARCHITECTURES (else ValueError)."""
        arch = self.architecture
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported; supported: {ARCHITECTURES}"
            )
        return arch

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes (quantized types) or values, shaped as GGUF rows: [..., row
        bytes] for the quantized types (what `gguf.dequantize` takes), else `shape`."""
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        count = int(np.prod(info.shape))
        nbytes = count // block_size * type_size
        data = np.frombuffer(self._view, np.uint8, nbytes, info.offset)
        if info.qtype in _AS_STORED:
            return data.view(_AS_STORED[info.qtype]).reshape(info.shape)
        return data.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)

    def array(self, info: TensorInfo) -> np.ndarray:
        """The tensor dequantized, in `info.shape` (a new array, not a view of the map)."""
        raw = self.raw(info)
        if info.qtype in _AS_STORED:
            return np.array(raw)
        return dequantize(raw, info.qtype).reshape(info.shape)

    def tensor(self, info: TensorInfo, device: torch.device) -> torch.Tensor:
        """The tensor dequantized (float32, or F16's float16), in `info.shape`, on `device`: off
        the CPU a format `gguf_dequant` covers goes there as its stored bytes and is dequantized
        there (the same values: a format's first tensor's first row is checked against gguf's,
        and read by gguf if it differs), the rest by gguf's numpy on the host (on the CPU too:
        torch's ops are no faster there, 0.3-0.9x on one thread, 0.6-1.5x on two by format,
        bench/gguf_dequant.py)."""
        key = (info.qtype, device.type)
        if (
            device.type != "cpu"
            and gguf_dequant.supported(info.qtype)
            and self._on_device.get(key, True)
        ):
            raw = self.raw(info)
            values = gguf_dequant.dequantize(torch.from_numpy(np.array(raw)).to(device), info.qtype)
            assert values is not None
            if key not in self._on_device:  # its first tensor: its first row against gguf's
                self._on_device[key] = _same_first_row(raw, values, info.qtype)
            if self._on_device[key]:
                return values.reshape(info.shape)
        return torch.from_numpy(self.array(info)).to(device)

    def close(self) -> None:
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # an array from `raw` still views the map: it goes when collected
            pass
        self._file.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same_first_row(raw: np.ndarray, values: torch.Tensor, qtype: GGMLQuantizationType) -> bool:
    """Whether `values` (a tensor dequantized on a device) begin with gguf's values of `raw`'s
    first row, bit for bit; logs a warning where not (its format is then read by gguf)."""
    row_bytes = raw.shape[-1]
    want = np.ascontiguousarray(dequantize(raw.reshape(-1, row_bytes)[:1], qtype), np.float32)
    got = values.reshape(-1, want.shape[-1])[:1].cpu().numpy()
    same = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
    if not same:
        log.warning(
            "GGUF %s dequantized on %s differs from gguf's values: read by gguf on the host",
            qtype.name,
            values.device,
        )
    return same


def model_config(file: GGUFFile) -> ModelConfig:
    """The config transformers builds from this file's metadata (its `load_gguf_checkpoint`'s,
    for these architectures: `ModelConfig.from_hf` of it), without transformers (~1.4 s of a
    service's start on a 2-core VM: its import and its config classes) nor parsing the file
    again: the mapped keys, the tokenizer's special ids, the vocabulary's size from its tokens
    where the file names none, tied embeddings where it has no `output.weight`, the config
    class's defaults for what the file leaves out (`_DEFAULTS`); a `llama` file named
    "mistral" is a Mistral. tests/unit/test_gguf_file.py compares it with transformers'."""
    arch = file.supported_architecture()
    meta = file.metadata
    model_type = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    config: dict[str, Any] = {"model_type": model_type, **_DEFAULTS[model_type]}
    config["tie_word_embeddings"] = "output.weight" not in file.tensors
    keys = dict(_CONFIG)
    if arch in _HEAD_DIM:
        keys[_HEAD_DIM[arch]] = "head_dim"
    for key, name in keys.items():
        if f"{arch}.{key}" in meta:
            config[name] = meta[f"{arch}.{key}"]
    for key, name in _TOKEN_IDS.items():
        if key in meta:
            config[name] = meta[key]
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    return ModelConfig.from_hf(SimpleNamespace(**config))  # (no KV heads: as many as queries)


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a GGUF tensor (None: none of ours, e.g. rope_freqs)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    return None


def unpermute_rows(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A q or k projection's rows (or bias) in the checkpoint's order: llama.cpp's converter
    stores each head's [2, head_dim / 2] rotary halves interleaved as [head_dim / 2, 2]."""
    half = weights.shape[0] // num_heads // 2
    rows = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return rows.transpose(1, 2).reshape(weights.shape)


class GGUFStateDict(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors by transformers' names, each dequantized (float32, or F16's float16)
    when read, on `device` (`GGUFFile.tensor`), q / k rows in the checkpoint's order
    (`unpermute_rows`, the `llama` architecture). Reading a tensor once is the point:
    `state_dict_from_hf` casts and moves each as it reads it, so no whole float32 copy of the
    model is ever held."""

    def __init__(
        self,
        file: GGUFFile,
        num_heads: int,
        num_kv_heads: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.file = file
        self.device = torch.device(device)  # where each tensor is dequantized (GGUFFile.tensor)
        self.permuted = file.supported_architecture() in PERMUTED
        self.heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
        self._infos = {}
        for info in file.tensors.values():
            name = hf_name(info.name)
            if name is not None:
                self._infos[name] = info

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._in_order(name, self.file.tensor(self._infos[name], self.device))

    def _in_order(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """A tensor's rows (values or stored bytes) in the checkpoint's order."""
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]  # e.g. "self_attn.q_proj"
        if self.permuted and module in self.heads:
            return unpermute_rows(rows, self.heads[module])
        return rows

    def stored(self, name: str) -> tuple[GGMLQuantizationType, torch.Tensor]:
        """The tensor's format and stored bytes (uint8 [rows, row bytes], a copy, rows in the
        checkpoint's order as `__getitem__` puts them) of a 2-D quantized tensor."""
        info = self._infos[name]
        assert len(info.shape) == 2 and info.qtype not in _AS_STORED, (name, info)
        raw = torch.from_numpy(np.array(self.file.raw(info)))
        return info.qtype, self._in_order(name, raw).contiguous()

    def qtype(self, name: str) -> GGMLQuantizationType:
        return self._infos[name].qtype

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)
