"""Our LlamaModel forward against transformers' logits on tiny random checkpoints.

Each architecture is built from a config, given O(1) random weights (so attention is peaky and
biases/norm weights matter), saved with save_pretrained, loaded by our loader in float32 and
compared on prefill, ragged batches, paged decode, tree steps, aux hidden states and truncation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from specsplit.model.batch import ForwardBatch
from specsplit.model.config import ModelConfig
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from tests.forward_steps import (
    TINY_LLAMA,
    VOCAB,
    causal_step,
    make_batch,
    new_seqs,
    tree_step,
)

pytestmark = [
    pytest.mark.raw_kv,  # forward math on hand-built caches
    pytest.mark.usefixtures("one_torch_thread"),
]

ATOL = 3e-5  # float32; logits are O(1..10), observed max error 1.2e-5
# and relative: a logit of ~44 (the qwen2 MQA tree's) came 3.05e-5 off with the C layer's
# AVX2 variant (SPECSPLIT_CPU_AVX512=0), 7e-7 of it
RTOL = 1e-6


def _hf_configs() -> dict[str, PreTrainedConfig]:
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return {
        "llama_gqa_untied_linear_rope": LlamaConfig(
            **TINY_LLAMA,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0},
        ),
        "llama_tied_llama3_rope_biases": LlamaConfig(
            **TINY_LLAMA,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=llama3_rope,
        ),
        "qwen2_attention_bias_mqa": Qwen2Config(
            **TINY_LLAMA, num_key_value_heads=1, tie_word_embeddings=True
        ),
        "qwen3_qk_norm_wide_heads": Qwen3Config(
            **TINY_LLAMA, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
        ),
        "mistral_gqa": MistralConfig(**TINY_LLAMA, num_key_value_heads=2, sliding_window=None),
    }


ARCHS = list(_hf_configs())


def _randomize_(model: torch.nn.Module) -> None:
    """O(1) activations: unit-variance embeddings, 1/sqrt(fan_in) matrices, norms near 1."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)


@dataclass
class Arch:
    hf: Any  # transformers CausalLM, float32, random weights
    model: LlamaModel
    config: ModelConfig


@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Arch:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        _hf_configs()[request.param], attn_implementation="eager", dtype=torch.float32
    ).eval()
    _randomize_(hf)
    path: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, config = load_model(str(path), torch.float32, "cpu")
    return Arch(hf=hf, model=model, config=config)


# --- batch building (the engines have their own builders) ---------------------------------


def random_tokens(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=generator).tolist()


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of the transformers model on one sequence."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0].float()


def split_rows(logits: torch.Tensor, batch: ForwardBatch) -> list[torch.Tensor]:
    return list(logits.split(batch.cu_seqlens_q.diff().tolist()))


# --- cases ---------------------------------------------------------------------------------


def test_prefill_single_sequence_matches_hf(arch: Arch) -> None:
    gen = torch.Generator().manual_seed(1)
    prompt = random_tokens(37, gen)
    kv = make_kv_cache(arch.config, num_pages=3, page_size=16, dtype=torch.float32, device="cpu")
    (seq,) = new_seqs(kv, [len(prompt)], random.Random(1))
    out = arch.model(make_batch([causal_step(seq, prompt)]), kv)
    expected = hf_logits(arch.hf, prompt)
    assert out.logits.dtype == torch.float32
    assert out.logits.shape == (len(prompt), VOCAB)
    assert out.hidden_states is None
    torch.testing.assert_close(out.logits, expected, atol=ATOL, rtol=RTOL)


def test_ragged_batch_of_three_matches_hf(arch: Arch) -> None:
    gen = torch.Generator().manual_seed(2)
    prompts = [random_tokens(n, gen) for n in (5, 23, 1)]
    kv = make_kv_cache(arch.config, num_pages=12, page_size=4, dtype=torch.float32, device="cpu")
    seqs = new_seqs(kv, [len(p) for p in prompts], random.Random(2))
    batch = make_batch([causal_step(s, p) for s, p in zip(seqs, prompts, strict=True)])
    out = arch.model(batch, kv)
    for got, prompt in zip(split_rows(out.logits, batch), prompts, strict=True):
        torch.testing.assert_close(got, hf_logits(arch.hf, prompt), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("page_size", [1, 16])
def test_incremental_decode_through_shuffled_pages_matches_hf(arch: Arch, page_size: int) -> None:
    """Two sequences: prefill part of each prompt together, then one token per sequence per
    step; every step's logits equal the full-sequence logits at that position."""
    gen = torch.Generator().manual_seed(3)
    prompts = [random_tokens(21, gen), random_tokens(34, gen)]
    prefill_lens = [9, 25]
    kv = make_kv_cache(
        arch.config, num_pages=64, page_size=page_size, dtype=torch.float32, device="cpu"
    )
    seqs = new_seqs(kv, [len(p) for p in prompts], random.Random(page_size))
    expected = [hf_logits(arch.hf, p) for p in prompts]

    batch = make_batch(
        [causal_step(s, p[:n]) for s, p, n in zip(seqs, prompts, prefill_lens, strict=True)]
    )
    out = arch.model(batch, kv)
    for got, want, n in zip(split_rows(out.logits, batch), expected, prefill_lens, strict=True):
        torch.testing.assert_close(got, want[:n], atol=ATOL, rtol=RTOL)
    for seq, n in zip(seqs, prefill_lens, strict=True):
        seq.kv_committed_len = n

    num_decode_steps = 0
    while any(s.kv_committed_len < len(p) for s, p in zip(seqs, prompts, strict=True)):
        live = [i for i, s in enumerate(seqs) if s.kv_committed_len < len(prompts[i])]
        steps = [causal_step(seqs[i], [prompts[i][seqs[i].kv_committed_len]]) for i in live]
        out = arch.model(make_batch(steps), kv)
        for row, i in enumerate(live):
            pos = seqs[i].kv_committed_len
            torch.testing.assert_close(out.logits[row], expected[i][pos], atol=ATOL, rtol=RTOL)
            seqs[i].kv_committed_len += 1
        num_decode_steps += 1
    assert num_decode_steps == 12  # the longer remainder (21 - 9) sets the step count


def path_to(node: int, tree_tokens: list[int], parents: list[int]) -> list[int]:
    path: list[int] = []
    while node >= 0:
        path.insert(0, tree_tokens[node])
        node = parents[node]
    return path


def test_tree_step_nodes_match_hf_on_their_linear_paths(arch: Arch) -> None:
    """Two sequences, each: prefill all but the last prompt token, then one step with that
    pending token and a draft tree (a branching tree and a chain)."""
    gen = torch.Generator().manual_seed(4)
    prompts = [random_tokens(11, gen), random_tokens(18, gen)]
    trees = [
        (random_tokens(7, gen), [-1, -1, 0, 0, 1, 2, 5]),  # depths 1 1 2 2 2 3 4
        (random_tokens(3, gen), [-1, 0, 1]),  # a chain (topk = 1)
    ]
    kv = make_kv_cache(arch.config, num_pages=16, page_size=4, dtype=torch.float32, device="cpu")
    seqs = new_seqs(
        kv, [len(p) + len(t[0]) for p, t in zip(prompts, trees, strict=True)], random.Random(4)
    )
    arch.model(make_batch([causal_step(s, p[:-1]) for s, p in zip(seqs, prompts, strict=True)]), kv)
    for seq, prompt in zip(seqs, prompts, strict=True):
        seq.kv_committed_len = len(prompt) - 1

    steps = [
        tree_step(s, p[-1], toks, parents)
        for s, p, (toks, parents) in zip(seqs, prompts, trees, strict=True)
    ]
    batch = make_batch(steps)
    out = arch.model(batch, kv)
    for rows, prompt, (toks, parents) in zip(
        split_rows(out.logits, batch), prompts, trees, strict=True
    ):
        torch.testing.assert_close(rows[0], hf_logits(arch.hf, prompt)[-1], atol=ATOL, rtol=RTOL)
        for j in range(len(toks)):
            want = hf_logits(arch.hf, prompt + path_to(j, toks, parents))[-1]
            torch.testing.assert_close(rows[j + 1], want, atol=ATOL, rtol=RTOL)


def test_aux_hidden_states_equal_hf_layer_outputs(arch: Arch) -> None:
    """Layer i's output (pre final norm) is HF's hidden_states[i + 1]; the last layer's output is
    taken by a hook, since HF's hidden_states[-1] is after the final norm. Listed order kept."""
    gen = torch.Generator().manual_seed(5)
    prompt = random_tokens(13, gen)
    kv = make_kv_cache(arch.config, num_pages=1, page_size=16, dtype=torch.float32, device="cpu")
    (seq,) = new_seqs(kv, [len(prompt)], random.Random(5))
    batch = make_batch([causal_step(seq, prompt)])
    batch.logit_indices = torch.tensor([12, 0, 7])
    last = arch.config.num_layers - 1
    out = arch.model(batch, kv, aux_layers=(last, 0, 1))

    captured: list[torch.Tensor] = []
    hook = arch.hf.model.layers[last].register_forward_hook(
        lambda _m, _i, output: captured.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            hf_out = arch.hf(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    finally:
        hook.remove()
    rows = batch.logit_indices
    expected = torch.cat(
        [captured[0][0, rows], hf_out.hidden_states[1][0, rows], hf_out.hidden_states[2][0, rows]],
        dim=-1,
    )
    assert out.hidden_states is not None
    assert out.hidden_states.shape == (3, 3 * arch.config.hidden_size)
    torch.testing.assert_close(out.hidden_states, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.logits, hf_out.logits[0, rows], atol=ATOL, rtol=RTOL)


def test_truncated_matches_hf_with_first_k_layers(arch: Arch) -> None:
    k = 2
    hf_config = arch.hf.config.__class__.from_dict(arch.hf.config.to_dict())
    hf_config.num_hidden_layers = k
    if getattr(hf_config, "layer_types", None) is not None:
        hf_config.layer_types = hf_config.layer_types[:k]
    hf_short = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    missing, _unexpected = hf_short.load_state_dict(arch.hf.state_dict(), strict=False)
    assert missing == [] or set(missing) <= {"lm_head.weight"}  # tied lm_head is re-tied

    short = arch.model.truncated(k)
    assert short.config.num_layers == k
    assert short.embed_tokens.weight.data_ptr() == arch.model.embed_tokens.weight.data_ptr()
    assert short.layers[1] is arch.model.layers[1]

    gen = torch.Generator().manual_seed(6)
    prompt = random_tokens(19, gen)
    kv = make_kv_cache(short.config, num_pages=2, page_size=16, dtype=torch.float32, device="cpu")
    assert len(kv.k) == k
    (seq,) = new_seqs(kv, [len(prompt)], random.Random(6))
    out = short(make_batch([causal_step(seq, prompt)]), kv)
    torch.testing.assert_close(out.logits, hf_logits(hf_short, prompt), atol=ATOL, rtol=RTOL)
