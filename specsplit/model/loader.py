"""Load a checkpoint (safetensors directory or GGUF file) into LlamaModel.

A directory goes through transformers (its model read on the CPU; we then rename, fuse and cast
the weights onto `device` and drop the transformers model: peak host memory about one copy of
the checkpoint in `dtype`, two when device is the CPU and fused tensors are built). A GGUF
file is read by specsplit/model/gguf_file.py: its metadata parsed once into the config
transformers would make of it, each tensor dequantized, cast and moved in turn (the embedded
default: ~2 s against ~11 through transformers' model, 2-core VM).
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from specsplit.model import cpu_gemm, cpu_quant
from specsplit.model.config import ModelConfig
from specsplit.model.gguf_file import GGUFFile, GGUFStateDict, model_config
from specsplit.model.linear import cpu_route
from specsplit.model.llama import LlamaModel, state_dict_from_hf
from specsplit.model.tokenizer_cache import cached_tokenizer

log = logging.getLogger(__name__)


def _is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def _check_gguf_exists(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")


def _open_gguf(path: str) -> GGUFFile:
    _check_gguf_exists(path)
    return GGUFFile(path)


def from_pretrained_args(path: str) -> tuple[str, dict[str, Any]]:
    """(name_or_dir, kwargs) for transformers' from_pretrained: a .gguf file is passed as its
    directory plus gguf_file=<basename>."""
    if _is_gguf(path):
        _check_gguf_exists(path)
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path is neither a directory nor a .gguf file: {path}")
    return path, {}


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str,
    num_layers: int | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """Our model and its config from a checkpoint directory or .gguf file. With `num_layers`,
    keep only the first `num_layers` decoder layers (the others are never copied to device,
    nor, from a GGUF file, dequantized)."""
    log.info("loading %s", path)
    if _is_gguf(path):
        with _open_gguf(path) as file:  # (each tensor read, cast and moved in turn)
            config = _truncated(model_config(file), num_layers, path)
            weights = GGUFStateDict(file, config.num_heads, config.num_kv_heads, device)
            state_dict = state_dict_from_hf(config, weights, dtype, device)
            model = LlamaModel.from_state_dict(config, state_dict, device)
            if packs_weights(dtype, device):
                _pack(model, weights)
    else:
        from transformers import AutoModelForCausalLM  # (not imported for a GGUF file: ~1.4 s)

        name, kwargs = from_pretrained_args(path)
        hf_model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
        config = ModelConfig.from_hf(hf_model.config, getattr(hf_model, "generation_config", None))
        config = _truncated(config, num_layers, path)
        state_dict = state_dict_from_hf(config, hf_model.state_dict(), dtype, device)
        del hf_model
        model = LlamaModel.from_state_dict(config, state_dict, device)
        if packs_weights(dtype, device):  # a bfloat16 checkpoint's weights read as such
            for weight in model_matrices(model):
                cpu_quant.attach_bfloat16(weight)
    del state_dict
    gc.collect()
    log.info(
        "loaded %s: %s, %d layers, hidden %d, vocab %d, %s on %s",
        path,
        config.model_type,
        config.num_layers,
        config.hidden_size,
        config.vocab_size,
        dtype,
        device,
    )
    return model, config


def packs_weights(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model's matrices are kept packed beside their float32 values where they can be
    (specsplit/model/cpu_quant.py: a GGUF's quantized blocks, bfloat16 values): float32 on the
    CPU, on the fixed-order route."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and cpu_quant.switch()
        and cpu_route() == "fixed"
    )


# our fused projections: (module, the transformers projections stacked in it)
_FUSED = (
    ("qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("o_proj", ("self_attn.o_proj",)),
    ("gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("down_proj", ("mlp.down_proj",)),
)


def model_matrices(model: LlamaModel) -> list[torch.Tensor]:
    """The weights the model multiplies by: each layer's projections, then the LM head."""
    layers = list(model.layers)
    weights = [getattr(layer, module).weight for layer in layers for module, _ in _FUSED]
    return [*weights, model.lm_head_weight]


def _pack(model: LlamaModel, weights: GGUFStateDict) -> None:
    """Attach packed blocks (cpu_quant) to each of the model's matrices whose parts the file
    stores in packable formats (a run of rows each format), else its bfloat16 copy where its
    values are bfloat16: the layers' projections and the LM head (the embedding where tied)."""
    sources = [  # each matrix's tensors in the file (transformers' names), in model_matrices' order
        tuple(f"model.layers.{i}.{part}.weight" for part in parts)
        for i in range(len(model.layers))
        for _, parts in _FUSED
    ]
    sources.append((_EMBEDDING if model.lm_head is None else _LM_HEAD,))
    targets = list(zip(model_matrices(model), sources, strict=True))
    attached = 0
    to_panels, half = cpu_gemm.int8_route(), cpu_gemm.half_panels()
    for weight, names in targets:
        if all(cpu_quant.supported(weights.qtype(name)) for name in names):
            runs = cpu_quant.cat([cpu_quant.pack(*weights.stored(name)) for name in names])
            if to_panels:
                runs = tuple(
                    cpu_quant.panels(run, half) if run.kind in cpu_quant.PANEL_KINDS else run
                    for run in runs
                )
            attached += cpu_quant.attach(weight, runs)
        else:  # (a BF16 file's: bfloat16 values)
            attached += cpu_quant.attach_bfloat16(weight)
    log.info(
        "packed %d of %d matrices for the CPU's kernel%s", attached, len(targets),
        " (4-bit and 8-bit in panels: x as two 8-bit parts, AMX or VNNI)" if to_panels else "",
    )  # fmt: skip


def _truncated(config: ModelConfig, num_layers: int | None, path: str) -> ModelConfig:
    """The config with its first `num_layers` layers only (None: all); warns of a sliding
    window our forward does not apply."""
    if num_layers is not None:
        if not 0 < num_layers <= config.num_layers:
            raise ValueError(f"num_layers={num_layers} not in [1, {config.num_layers}]")
        config = replace(config, num_layers=num_layers)
    if config.sliding_window is not None and config.sliding_window < config.max_position_embeddings:
        log.warning(
            "%s: sliding window %d is not applied; outputs match the checkpoint only for "
            "contexts up to %d tokens",
            path,
            config.sliding_window,
            config.sliding_window,
        )
    return config


def load_config(path: str) -> ModelConfig:
    """The checkpoint's config without its weights (EOS ids merged with its generation
    config's, where one is shipped: GGUF files carry none)."""
    if _is_gguf(path):
        with _open_gguf(path) as file:
            return model_config(file)
    from transformers import AutoConfig, GenerationConfig

    name, kwargs = from_pretrained_args(path)
    try:
        generation_config = GenerationConfig.from_pretrained(name, **kwargs)
    except (OSError, ValueError):
        generation_config = None
    return ModelConfig.from_hf(AutoConfig.from_pretrained(name, **kwargs), generation_config)


def load_embeddings(
    path: str, dtype: torch.dtype
) -> tuple[ModelConfig, torch.Tensor, torch.Tensor]:
    """A checkpoint's config, token embedding and lm_head weight (the embedding where tied), on
    the CPU in `dtype`, without reading a decoder layer: what an EAGLE head takes of its
    target. From a GGUF file the two tensors alone are dequantized; from a directory they are
    read from its safetensors files (`_safetensors_names`; transformers' whole model, an 8B's
    ~16 GB in bf16, where it has none)."""
    if _is_gguf(path):
        with _open_gguf(path) as file:
            config = model_config(file)
            weights: Mapping[str, torch.Tensor] = GGUFStateDict(
                file, config.num_heads, config.num_kv_heads
            )
            return config, *_embeddings(config, weights, dtype)
    config = load_config(path)
    files = _safetensors_names(path, config.tie_word_embeddings)
    if files is None:
        model, _ = load_model(path, dtype, "cpu", num_layers=1)
        return config, model.embed_tokens.weight.detach(), model.lm_head_weight.detach()
    from safetensors import safe_open

    tensors = {}
    for name, part in files.items():
        with safe_open(os.path.join(path, part), framework="pt") as opened:
            tensors[name] = opened.get_tensor(name)
    return config, *_embeddings(config, tensors, dtype)


_EMBEDDING, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # transformers' names


def _embeddings(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    embed = weights[_EMBEDDING].to(dtype)
    return embed, embed if config.tie_word_embeddings else weights[_LM_HEAD].to(dtype)


def _safetensors_names(path: str, tied: bool) -> dict[str, str] | None:
    """The safetensors file holding each of the embedding and the lm_head in a checkpoint
    directory (the lm_head only where not `tied`); None where they are not all found in
    safetensors files."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as opened:
            weight_map = dict.fromkeys(opened.keys(), "model.safetensors")
    else:
        return None
    names = [_EMBEDDING] if tied else [_EMBEDDING, _LM_HEAD]
    if not all(name in weight_map for name in names):
        return None
    return {name: weight_map[name] for name in names}


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer (AutoTokenizer; for a .gguf converted from its metadata once,
    then read from specsplit/model/tokenizer_cache.py's entry)."""
    from transformers import AutoTokenizer

    name, kwargs = from_pretrained_args(path)
    if _is_gguf(path):
        return cached_tokenizer(path, lambda: AutoTokenizer.from_pretrained(name, **kwargs))
    return AutoTokenizer.from_pretrained(name, **kwargs)
