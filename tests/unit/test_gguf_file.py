"""specsplit/model/gguf_file.py against transformers' GGUF path, the reference: the same metadata
as gguf's own reader (the embedded GGUF), the same config and bit-equal tensors as transformers'
model gives (`state_dict_from_hf` over `AutoModelForCausalLM.from_pretrained(gguf_file=...)`;
the embedded GGUF's in tests/unit/test_loader.py) on small files written here for each
architecture: Llama with grouped KV heads (its q / k rows permuted by llama.cpp's converter),
a Llama named "mistral" (a Mistral), Qwen2 (q / k / v biases) and Qwen3 (q / k norms), in F32,
F16, BF16, Q8_0, Q5_1, Q4_1 and the K types, with and without a separate output matrix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quantize
from transformers import AutoConfig, AutoModelForCausalLM

from specsplit.model.config import ModelConfig
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.gguf_file import GGUFFile, hf_name, unpermute_rows
from specsplit.model.llama import state_dict_from_hf
from specsplit.model.loader import from_pretrained_args, load_config, load_model

Q = GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 96, 4, 2, 2, 128


def _reference(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """transformers' model of the file, renamed and fused as `load_model` did before."""
    name, kwargs = from_pretrained_args(path)
    hf_model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kwargs)
    config = ModelConfig.from_hf(hf_model.config, hf_model.generation_config)
    return config, state_dict_from_hf(config, hf_model.state_dict(), torch.float32, "cpu")


def _assert_loads_as_transformers(path: str) -> None:
    config, expected = _reference(path)
    model, loaded = load_model(path, torch.float32, "cpu")
    assert loaded == config and load_config(path) == config
    state = model.state_dict()
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """[rows, row bytes] of K-type blocks: random bits, the float16 scales small and finite
    (Q4_K / Q5_K: d and dmin first; Q6_K: d last)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    scale = np.full(len(blocks), 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.Q6_K:
        blocks[:, -2:] = scale
    else:
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale // 2
    return blocks.reshape(rows, cols // block_size * type_size)


def _write(
    path: Path, arch: str, qtype: Q, *, tied: bool, bias: bool = False, qk_norm: bool = False,
    name: str = "tiny", head_dim: int = HIDDEN // HEADS, hidden: int = HIDDEN, ffn: int = FFN,
    minimal: bool = False, heads: int = HEADS,
) -> str:  # fmt: skip
    """A small random checkpoint as llama.cpp's converter writes one (q / k rows permuted for
    `llama`), its layer matrices in `qtype`, norms and biases in F32. (transformers takes a
    Qwen3's head_dim from its config class, 128, not from the file.) gguf cannot quantize to
    the K types: their blocks are random bytes with small scales (`_k_blocks`). `minimal`:
    without the keys a config class has defaults for (context, RoPE base, RMS epsilon, KV
    heads: `heads` as many, special ids)."""
    rng = np.random.default_rng(7)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_vocab_size(VOCAB)
    if not minimal:
        writer.add_context_length(256)
        writer.add_head_count_kv(KV_HEADS)
        writer.add_rope_freq_base(50_000.0)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    kv_heads = heads if minimal else KV_HEADS
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim

    def matrix(tensor_name: str, rows: int, cols: int, heads: int = 0) -> None:
        if qtype in K_QUANTS:
            writer.add_tensor(tensor_name, _k_blocks(rng, rows, cols, qtype), raw_dtype=qtype)
            return
        w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.1
        if heads and arch == "llama":  # llama.cpp's permute: [heads, 2, half] -> [heads, half, 2]
            w = w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
        if qtype == Q.F32:
            writer.add_tensor(tensor_name, w)
        elif qtype == Q.F16:
            writer.add_tensor(tensor_name, w.astype(np.float16))
        else:
            writer.add_tensor(tensor_name, quantize(w, qtype), raw_dtype=qtype)

    def vector(tensor_name: str, size: int) -> None:
        writer.add_tensor(tensor_name, 1.0 + rng.standard_normal(size, dtype=np.float32) * 0.1)

    matrix("token_embd.weight", VOCAB, hidden)
    for i in range(LAYERS):
        blk = f"blk.{i}."
        vector(blk + "attn_norm.weight", hidden)
        matrix(blk + "attn_q.weight", q_rows, hidden, heads)
        matrix(blk + "attn_k.weight", kv_rows, hidden, kv_heads)
        matrix(blk + "attn_v.weight", kv_rows, hidden)
        matrix(blk + "attn_output.weight", hidden, q_rows)
        if bias:
            for part, size in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                vector(f"{blk}attn_{part}.bias", size)
        if qk_norm:
            vector(blk + "attn_q_norm.weight", head_dim)
            vector(blk + "attn_k_norm.weight", head_dim)
        vector(blk + "ffn_norm.weight", hidden)
        matrix(blk + "ffn_gate.weight", ffn, hidden)
        matrix(blk + "ffn_up.weight", ffn, hidden)
        matrix(blk + "ffn_down.weight", hidden, ffn)
    vector("output_norm.weight", hidden)
    if not tied:
        matrix("output.weight", VOCAB, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(
    ("arch", "qtype", "tied", "options"),
    [
        ("llama", Q.F32, False, {}),
        ("llama", Q.Q8_0, True, {}),
        ("llama", Q.BF16, False, {}),
        ("llama", Q.Q5_1, True, {}),
        ("qwen2", Q.Q4_1, False, {"bias": True}),
        ("qwen3", Q.Q8_0, True, {"qk_norm": True, "head_dim": 128}),
    ],
    ids=[
        "llama-f32",
        "llama-q8_0-tied",
        "llama-bf16",
        "llama-q5_1-tied",
        "qwen2-q4_1-bias",
        "qwen3-q8_0-qk-norm",
    ],
)
def test_each_architecture_loads_as_transformers_loads_it(
    tmp_path: Path, arch: str, qtype: Q, tied: bool, options: dict[str, object]
) -> None:
    path = _write(tmp_path / "model.gguf", arch, qtype, tied=tied, **options)  # type: ignore[arg-type]
    _assert_loads_as_transformers(path)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_quantized_files_load_as_transformers_loads_them(tmp_path: Path, qtype: Q) -> None:
    """The types most GGUF files use (Q4_K_M holds Q4_K and Q6_K): 256-weight blocks."""
    path = _write(tmp_path / "k.gguf", "llama", qtype, tied=False, head_dim=64, hidden=256, ffn=512)
    _assert_loads_as_transformers(path)


def test_a_llama_file_named_mistral_is_a_mistral_with_llamas_tensors(tmp_path: Path) -> None:
    """transformers' config of it is a Mistral's (its model does not load: gguf-py knows no
    "mistral" tensor names); the tensors are those of the same file named otherwise."""
    mistral = _write(tmp_path / "mistral.gguf", "llama", Q.F16, tied=False, name="mistral")
    llama = _write(tmp_path / "llama.gguf", "llama", Q.F16, tied=False)
    name, kwargs = from_pretrained_args(mistral)
    expected = ModelConfig.from_hf(AutoConfig.from_pretrained(name, **kwargs))
    assert load_config(mistral) == expected and expected.model_type == "mistral"
    _, tensors = _reference(llama)
    model, _ = load_model(mistral, torch.float32, "cpu")
    assert all(torch.equal(model.state_dict()[k], t) for k, t in tensors.items())


@pytest.mark.parametrize(
    ("name", "heads"), [("llama", 4), ("mistral", 8), ("qwen2", 32), ("qwen3", 32)]
)
def test_a_files_config_without_optional_keys_is_transformers(
    tmp_path: Path, name: str, heads: int
) -> None:
    """Where the file leaves a key out, `model_config` takes what transformers' config class
    gives (`_DEFAULTS`: context, RoPE base, epsilon, KV heads, special ids, sliding window),
    without importing transformers. (`heads`: as many as the class's KV heads, a constant but
    for Llama's.)"""
    arch = "llama" if name == "mistral" else name
    path = _write(
        tmp_path / "min.gguf", arch, Q.F32, tied=True, name=name, minimal=True, heads=heads,
        head_dim=HIDDEN // heads,
    )  # fmt: skip
    dir_name, kwargs = from_pretrained_args(path)
    expected = ModelConfig.from_hf(AutoConfig.from_pretrained(dir_name, **kwargs))
    assert load_config(path) == expected and expected.model_type == name


def test_loading_a_gguf_file_imports_no_transformers() -> None:
    code = (
        "import sys, torch; from specsplit.model import embedded, loader; "
        "path = embedded.embedded_default_model_path(); loader.load_config(path); "
        "loader.load_model(path, torch.float32, 'cpu', num_layers=1); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_the_metadata_and_tensor_infos_are_ggufs_own_readers() -> None:
    """Every key's value and every tensor's shape, type and data as gguf.GGUFReader reads them
    (the reader adds the header's counts as GGUF.* fields)."""
    path = embedded_default_model_path()
    reader = GGUFReader(path)
    with GGUFFile(path) as file:
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert file.metadata == fields
        assert len(file.tensors) == len(reader.tensors)
        for tensor in reader.tensors:
            info = file.tensors[tensor.name]
            assert info.qtype == tensor.tensor_type and info.offset == tensor.data_offset
            assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
            assert np.array_equal(file.raw(info), tensor.data), tensor.name


def test_closing_while_a_raw_view_is_held_leaves_the_view_readable() -> None:
    with GGUFFile(embedded_default_model_path()) as file:
        info = file.tensors["output_norm.weight"]
        held, expected = file.raw(info), file.array(info)
    assert np.array_equal(held, expected)


def test_unpermute_rows_undoes_llama_cpps_permute() -> None:
    heads, head_dim = 3, 8
    original = torch.arange(heads * head_dim * 2, dtype=torch.float32).reshape(heads * head_dim, 2)
    permuted = original.reshape(heads, 2, head_dim // 2, 2).transpose(1, 2).reshape(-1, 2)
    assert not torch.equal(permuted, original)
    assert torch.equal(unpermute_rows(permuted, heads), original)


def test_names_map_to_transformers_and_others_are_left_out() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None


def test_a_file_that_is_not_gguf_or_of_another_architecture_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))
    other = tmp_path / "other.gguf"
    writer = GGUFWriter(str(other), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_config(str(other))
