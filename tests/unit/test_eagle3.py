"""EAGLE-3 head: paged forward vs a plain reference, lossless greedy through the stack, and the
verifier's hidden states arriving in the drafter as the target's own layer outputs."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from drafter.eagle import Eagle3Head, load_eagle3
from drafter.eagle_checkpoint import layer_names, read_tensors
from drafter.eagle_proposer import Eagle3Proposer
from drafter.tree_draft import CATCH_UP_LENS
from gateway.request import GenerationRequest
from specsplit.messages import SpecParams
from specsplit.model.config import default_aux_layers
from specsplit.model.loader import load_model
from specsplit.model.rope import apply_rotary, rope_cos_sin
from specsplit.step import build_forward_batch
from specsplit.tree import DraftTree
from tests.eagle_random import save_random_eagle3
from tests.support import (
    TINY_VOCAB,
    dense_step,
    generate_all,
    generated_ids,
    make_stack,
    save_tiny_llama,
)

MAX_NEW_TOKENS = 12
DRAFT_VOCAB = 200


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle")
    target = save_tiny_llama(root / "target", seed=0, num_layers=4)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    return {
        "target": target,
        "head": save_random_eagle3(root / "head", config, seed=3, draft_vocab_size=DRAFT_VOCAB),
    }


def _head(models: dict[str, Path]) -> Eagle3Head:
    return load_eagle3(str(models["head"]), str(models["target"]), torch.float64, "cpu")


def _reference(
    head: Eagle3Head, ids: list[int], positions: list[int], features: torch.Tensor, mask
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over all tokens at once with plain torch ops: logits [T, Vd], outputs [T, H]."""
    c, w, m = head.config, head.w, "midlayer."

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w[name]

    t = len(ids)
    x = torch.cat(
        [
            norm(head.embed[ids], m + "input_layernorm.weight"),
            norm(features, m + "hidden_norm.weight"),
        ],
        dim=-1,
    )
    a = m + "self_attn."
    q = (x @ w[a + "q_proj.weight"].T).view(t, c.num_heads, c.head_dim)
    k = (x @ w[a + "k_proj.weight"].T).view(t, c.num_kv_heads, c.head_dim)
    v = (x @ w[a + "v_proj.weight"].T).view(t, c.num_kv_heads, c.head_dim)
    cos, sin = rope_cos_sin(torch.tensor(positions), head.inv_freq, x.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    groups = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim**0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1) @ w[a + "o_proj.weight"].T
    h = features + attn
    y = norm(h, m + "post_attention_layernorm.weight")
    mlp = (F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[
        m + "mlp.down_proj.weight"
    ].T
    out = h + mlp
    return norm(out, "norm.weight") @ w["lm_head.weight"].T, out


@pytest.mark.parametrize("page_size", [1, 16])
def test_head_paged_prefill_and_tree_equal_reference(models, page_size: int) -> None:
    head = _head(models)
    assert head.config.aux_layers == default_aux_layers(4) == (1, 1, 0)
    kv = head.make_kv_cache(num_pages=64, page_size=page_size)
    seq = kv.new_seq()
    gen = torch.Generator().manual_seed(0)
    n, hidden = 9, head.config.hidden_size
    ids = torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist()
    target_rows = torch.randn(n, 3 * hidden, generator=gen, dtype=torch.float64)
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1])  # depths 1, 2, 1, 3
    tree_features = torch.randn(len(tree), hidden, generator=gen, dtype=torch.float64)
    kv.reserve(seq, n + len(tree))
    try:
        prefill = dense_step(
            seq,
            ids,
            list(range(n)),
            list(range(n)),
            torch.ones(n, n, dtype=torch.bool).tril(),
            list(range(n)),
        )
        batch, _ = build_forward_batch([prefill], kv.page_size)
        logits_p, out_p = head.forward(batch, kv, head.fuse(target_rows))
        seq.kv_committed_len = n
        mask_t = torch.zeros(len(tree), n + len(tree), dtype=torch.bool)
        mask_t[:, :n] = True
        mask_t[:, n:] = tree.ancestor_mask()
        positions_t = [n - 1 + d for d in tree.depths()]
        step = dense_step(
            seq,
            tree.tokens,
            positions_t,
            list(range(n, n + len(tree))),
            mask_t,
            list(range(len(tree))),
        )
        batch, _ = build_forward_batch([step], kv.page_size)
        logits_t, out_t = head.forward(batch, kv, tree_features)
    finally:
        kv.release(seq)
    mask = torch.zeros(n + len(tree), n + len(tree), dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    mask[n:] = mask_t
    ref_logits, ref_out = _reference(
        head,
        ids + tree.tokens,
        list(range(n)) + positions_t,
        torch.cat([head.fuse(target_rows), tree_features]),
        mask,
    )
    torch.testing.assert_close(logits_p, ref_logits[:n].float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits_t, ref_logits[n:].float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        torch.cat([out_p, out_t]), ref_out, rtol=1e-5, atol=1e-6
    )  # rms_norm in fp32


def test_head_projects_qkv_and_gate_up_in_one_gemm_each_over_the_named_weights(models) -> None:
    """The fused projections hold the checkpoint's weights, and its named weights are views of
    them (one copy in memory); the RoPE table covers the target's context past the head's."""
    head = _head(models)
    saved = layer_names(read_tensors(Path(models["head"])))
    m = "midlayer."
    for fused, names in (
        (head.qkv_weight, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        (head.gate_up_weight, ["mlp.gate_proj", "mlp.up_proj"]),
    ):
        weights = [head.w[f"{m}{name}.weight"] for name in names]
        assert torch.equal(fused, torch.cat(weights))
        for weight in weights:
            assert weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        want = [saved[f"{m}{name}.weight"].to(torch.float64) for name in names]
        assert torch.equal(fused, torch.cat(want))
    _, target_config = load_model(str(models["target"]), dtype=torch.float64, device="cpu")
    longest = max(head.config.max_position_embeddings, target_config.max_position_embeddings)
    assert head.rope.table.shape[0] > longest


def test_draft_ids_map_to_target_ids_through_d2t(models) -> None:
    head = _head(models)
    assert head.d2t is not None and head.d2t.shape == (DRAFT_VOCAB,)
    logits = torch.randn(2, DRAFT_VOCAB, dtype=torch.float32)
    full = head.target_logits(logits)
    targets = head.to_target_ids(torch.arange(DRAFT_VOCAB))
    assert full.shape == (2, TINY_VOCAB)
    assert torch.equal(full[:, targets], logits)
    assert int(torch.isfinite(full).sum()) == 2 * DRAFT_VOCAB
    assert torch.equal(full.argmax(-1), targets[logits.argmax(-1)])


def _prompts(batch_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, TINY_VOCAB, (3 + 4 * i,), generator=gen).tolist()
        for i in range(batch_size)
    ]


def _requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    return [GenerationRequest(p, MAX_NEW_TOKENS, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("overlap", ["serial", "groups"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("topk", "num_steps", "num_draft_tokens"), [(1, 3, 3), (2, 3, 6)])
def test_eagle3_speculative_greedy_equals_target_greedy(
    models,
    smollm2_tokenizer,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    page_size: int,
    overlap: str,
) -> None:
    prompts = _prompts(3, seed=11)
    plain = make_stack(models["target"], "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    expected = [generated_ids(c) for c in generate_all(plain, _requests(prompts))]
    spec = SpecParams(num_steps, topk, num_draft_tokens)
    stack = make_stack(
        models["target"],
        "eagle3",
        smollm2_tokenizer,
        spec,
        draft_dir=models["head"],
        page_size=page_size,
        overlap=overlap,
    )
    assert stack.scheduler.hidden_state_layers == (1, 1, 0)
    out = generate_all(stack, _requests(prompts))
    assert [generated_ids(c) for c in out] == expected
    for chunks in out:
        assert chunks[-1].stats is not None
        assert chunks[-1].stats.num_accepted_tokens == MAX_NEW_TOKENS


def test_a_request_that_never_drafts_asks_no_hidden_states_and_skips_the_drafter(
    models, smollm2_tokenizer
) -> None:
    """After the EAGLE drafter told the gateway its layers, a request with speculation off
    (num_steps 0) still decodes the target's tokens, but the verifier computes no features for
    it and the drafter never hears of it; a speculative request beside it still gets both."""
    stack = make_stack(
        models["target"], "eagle3", smollm2_tokenizer, SpecParams(2, 1, 2), draft_dir=models["head"]
    )
    verify_layers: dict[str, set[tuple[int, ...]]] = {}
    drafted: set[str] = set()
    verifier, drafter = stack.scheduler.verifier, stack.scheduler.drafter
    verify, draft = verifier.verify, drafter.draft

    async def spy_verify(inputs):  # type: ignore[no-untyped-def]
        for item in inputs:
            verify_layers.setdefault(item.seq_id, set()).add(item.hidden_state_layers)
        return await verify(inputs)

    async def spy_draft(inputs):  # type: ignore[no-untyped-def]
        drafted.update(item.seq_id for item in inputs)
        return await draft(inputs)

    verifier.verify, drafter.draft = spy_verify, spy_draft  # type: ignore[method-assign]
    prompts = _prompts(2, seed=13)
    generate_all(stack, _requests(prompts[:1]))  # the gateway learns the head's layers
    off = GenerationRequest(prompts[1], MAX_NEW_TOKENS, ignore_eos=True, spec=SpecParams(0, 1, 0))
    on = _requests(prompts[:1])[0]
    verify_layers.clear()
    drafted.clear()
    plain_out, spec_out = generate_all(stack, [off, on])
    plain = make_stack(models["target"], "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    expected = [generated_ids(c) for c in generate_all(plain, _requests(prompts[1::-1]))]
    assert [generated_ids(plain_out), generated_ids(spec_out)] == expected
    layers_by_request = sorted(verify_layers.values(), key=len)
    assert layers_by_request == [{()}, {(1, 1, 0)}]  # one never-drafting, one speculative
    assert len(drafted) == 1 and not drafted & {
        seq_id for seq_id, layers in verify_layers.items() if layers == {()}
    }


def test_drafter_features_are_the_targets_layer_outputs(
    models, smollm2_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every feature row the head reads is the target's (bf16) fused output of its aux layers at
    that token, as a plain prefill of the final tokens computes it; each arrives exactly once."""
    received: dict[str, list[tuple[int, torch.Tensor]]] = {}
    original = Eagle3Proposer._take_features

    def record(self: Eagle3Proposer, jobs):  # type: ignore[no-untyped-def]
        for job in jobs:
            rows = job.target_hidden_states
            if rows is not None and rows.shape[0]:
                received.setdefault(job.seq.seq_id, []).append((job.start, rows))
        return original(self, jobs)

    monkeypatch.setattr(Eagle3Proposer, "_take_features", record)
    stack = make_stack(
        models["target"], "eagle3", smollm2_tokenizer, SpecParams(2, 1, 2), draft_dir=models["head"]
    )
    prompt = _prompts(1, seed=5)[0]
    (chunks,) = generate_all(stack, _requests([prompt]))
    tokens = prompt + generated_ids(chunks)
    (calls,) = received.values()
    assert calls[0][0] == 0  # the prefill's rows, after an empty first draft
    for (start, rows), (next_start, _) in itertools.pairwise(calls):
        assert next_start == start + rows.shape[0]  # contiguous, no row twice
    features = torch.cat([rows for _, rows in calls])  # rows for tokens[0 : F]
    model = stack.verifier.model
    kv = stack.verifier.kv
    seq = kv.new_seq()
    kv.reserve(seq, len(tokens))
    try:
        step = dense_step(
            seq,
            tokens,
            list(range(len(tokens))),
            list(range(len(tokens))),
            torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril(),
            list(range(len(tokens))),
        )
        batch, _ = build_forward_batch([step], kv.page_size)
        plain = model(batch, kv, aux_layers=(1, 1, 0)).hidden_states
    finally:
        kv.release(seq)
    assert plain is not None
    assert features.dtype == torch.bfloat16
    assert features.shape[0] >= len(prompt)
    assert torch.equal(features, plain[: features.shape[0]].to(torch.bfloat16))


@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_catch_up_keeps_the_heads_drafts(models, smollm2_tokenizer, page_size: int) -> None:
    """Catch-up steps padded to the CUDA graphs' lengths (recomputing cached head entries from
    the kept features) draft what the unpadded steps draft: the same rounds, the same accepted
    tokens, the target's output."""
    prompts = _prompts(3, seed=17)
    outs = []
    for catch_up_lens in ((), CATCH_UP_LENS):
        stack = make_stack(
            models["target"],
            "eagle3",
            smollm2_tokenizer,
            SpecParams(3, 1, 3),
            draft_dir=models["head"],
            page_size=page_size,
        )
        assert isinstance(stack.drafter.proposer, Eagle3Proposer)
        stack.drafter.proposer.catch_up_lens = catch_up_lens  # padding without a GPU, eager
        outs.append(generate_all(stack, _requests(prompts)))
    plain, padded = outs
    assert [generated_ids(c) for c in padded] == [generated_ids(c) for c in plain]
    assert [c[-1].stats for c in padded] == [c[-1].stats for c in plain]
