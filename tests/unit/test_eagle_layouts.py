"""EAGLE head layouts: the EAGLE-3 checkpoint variants (layer named `layers.0.`,
`norm_before_residual`, t2d / d2t) and the older single-layer EAGLE-1/2 layout, each run on the
paged cache and compared with a dense reference of the published formulas written here from the
checkpoint's own tensors; layout detection, feature-width checks, the target's embedding and
lm_head standing in where the head has none, the target's final-normed hidden state, and lossless
greedy decoding with an EAGLE-1/2 head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from drafter.eagle import Eagle3Head, load_eagle3
from drafter.eagle_checkpoint import HEAD_WEIGHTS, detect_layout
from drafter.eagle_proposer import Eagle3Proposer
from gateway.request import GenerationRequest
from specsplit.errors import Code, ServiceError
from specsplit.messages import DraftInput, SpecParams, VerifyInput
from specsplit.model.batch import ForwardOutput
from specsplit.model.fused import rms_norm
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.step import build_forward_batch
from specsplit.tree import DraftTree
from tests.eagle_random import save_random_eagle, save_random_eagle3
from tests.support import (
    TINY_VOCAB,
    dense_step,
    generate_all,
    generated_ids,
    make_stack,
    save_tiny_llama,
)

NUM_TARGET_LAYERS = 4
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("target"), seed=0, num_layers=NUM_TARGET_LAYERS)


@pytest.fixture(scope="module")
def target(target_dir: Path) -> LlamaModel:
    model, _ = load_model(str(target_dir), dtype=torch.float64, device="cpu")
    return model


def _load(head_dir: Path, target: LlamaModel) -> Eagle3Head:
    return load_eagle3(str(head_dir), None, torch.float64, "cpu", target=target)


# -- a dense reference of both layouts ---------------------------------------------------------


def _dense_reference(
    head_dir: Path,
    target: LlamaModel,
    ids: list[int],
    positions: list[int],
    target_rows: torch.Tensor,  # [P, feature_width] for the first P tokens
    node_features: torch.Tensor,  # [T - P, H]: the head's own outputs, for the rest
    mask: torch.Tensor,  # [T, T] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over all tokens at once, from the checkpoint's tensors under their own names:
    logits [T, V or Vd] and layer outputs [T, H]."""
    cfg = json.loads((head_dir / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(head_dir / HEAD_WEIGHTS)).items()}
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = "midlayer." if "midlayer.self_attn.q_proj.weight" in w else "layers.0."

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[name]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, n, D], HF rotate_half convention
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv  # [T, D/2]
        cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
        rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
        return x * cos + rotated * sin

    emb = w.get("embed_tokens.weight", target.embed_tokens.weight)[ids]
    if "hidden_norm" in " ".join(w):  # EAGLE-3: fc fuses the target rows
        features = torch.cat([target_rows @ w["fc.weight"].T, node_features])
        hidden = norm(features, p + "hidden_norm.weight")
        x = torch.cat([norm(emb, p + "input_layernorm.weight"), hidden], dim=-1)
        residual = hidden if cfg.get("norm_before_residual") else features
    else:  # EAGLE-1/2: fc fuses the embedding with the target's (or the head's) hidden state
        features = torch.cat([target_rows, node_features])
        residual = torch.cat([emb, features], dim=-1) @ w["fc.weight"].T
        residual = residual + w["fc.bias"] if "fc.bias" in w else residual
        has_ln = p + "input_layernorm.weight" in w
        x = norm(residual, p + "input_layernorm.weight") if has_ln else residual
    t, a = len(ids), p + "self_attn."
    q = rope((x @ w[a + "q_proj.weight"].T).view(t, heads, dim))
    k = rope((x @ w[a + "k_proj.weight"].T).view(t, kv_heads, dim))
    v = (x @ w[a + "v_proj.weight"].T).view(t, kv_heads, dim)
    k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    h = residual + torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1) @ w[a + "o_proj.weight"].T
    y = norm(h, p + "post_attention_layernorm.weight")
    m = p + "mlp."
    out = h + (F.silu(y @ w[m + "gate_proj.weight"].T) * (y @ w[m + "up_proj.weight"].T)) @ (
        w[m + "down_proj.weight"].T
    )
    if "norm.weight" in w:  # EAGLE-3: its own final norm and lm_head
        return norm(out, "norm.weight") @ w["lm_head.weight"].T, out
    return out @ target.lm_head_weight.T, out  # EAGLE-1/2: the target's lm_head, no norm


def _paged(
    head: Eagle3Head, seed: int, page_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A prefill of 9 tokens from target rows, then a 4-node tree fed the head's own-width
    features, on the paged cache: (logits, outputs) of all 13 rows + the inputs for a reference."""
    gen = torch.Generator().manual_seed(seed)
    c, n = head.config, 9
    ids = torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist()
    rows = torch.randn(n, c.feature_width, generator=gen, dtype=torch.float64)
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1])  # depths 1, 2, 1, 3
    tree_features = torch.randn(len(tree), c.hidden_size, generator=gen, dtype=torch.float64)
    kv = head.make_kv_cache(num_pages=64, page_size=page_size)
    seq = kv.new_seq()
    kv.reserve(seq, n + len(tree))
    mask = torch.zeros(n + len(tree), n + len(tree), dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    mask[n:, :n] = True
    mask[n:, n:] = tree.ancestor_mask()
    positions = list(range(n)) + [n - 1 + d for d in tree.depths()]
    try:
        prefill = dense_step(seq, ids, positions[:n], list(range(n)), mask[:n, :n], list(range(n)))
        logits_p, out_p = head.forward(
            build_forward_batch([prefill], kv.page_size)[0], kv, head.fuse(rows)
        )
        seq.kv_committed_len = n
        nodes = list(range(n, n + len(tree)))
        step = dense_step(seq, tree.tokens, positions[n:], nodes, mask[n:], list(range(len(tree))))
        logits_t, out_t = head.forward(
            build_forward_batch([step], kv.page_size)[0], kv, tree_features
        )
    finally:
        kv.release(seq)
    inputs = {
        "ids": ids + tree.tokens,
        "positions": positions,
        "target_rows": rows,
        "node_features": tree_features,
        "mask": mask,
    }
    return torch.cat([logits_p, logits_t]), torch.cat([out_p, out_t]), inputs


def _assert_matches_reference(head_dir: Path, target: LlamaModel) -> Eagle3Head:
    head = _load(head_dir, target)
    logits, out, inputs = _paged(head, seed=1)
    ref_logits, ref_out = _dense_reference(head_dir, target, **inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)  # rms_norm in fp32
    torch.testing.assert_close(logits, ref_logits.float(), rtol=1e-5, atol=1e-5)
    return head


# -- EAGLE-3 checkpoint variants ---------------------------------------------------------------


def test_eagle3_layers0_names_give_the_logits_of_midlayer_names(tmp_path: Path, target) -> None:
    config = target.config
    mid = save_random_eagle3(tmp_path / "mid", config, seed=4, draft_vocab_size=100)
    layers0 = save_random_eagle3(
        tmp_path / "l0", config, seed=4, draft_vocab_size=100, prefix="layers.0."
    )
    assert "layers.0.hidden_norm.weight" in load_file(str(layers0 / HEAD_WEIGHTS))
    logits_mid, out_mid, _ = _paged(_load(mid, target), seed=2)
    logits_l0, out_l0, _ = _paged(_load(layers0, target), seed=2)
    assert torch.equal(logits_mid, logits_l0)
    assert torch.equal(out_mid, out_l0)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_head_matches_dense_reference(
    tmp_path: Path, target, norm_before_residual: bool
) -> None:
    head_dir = save_random_eagle3(
        tmp_path / "head", target.config, seed=5, norm_before_residual=norm_before_residual
    )
    head = _assert_matches_reference(head_dir, target)
    assert head.config.norm_before_residual is norm_before_residual


def test_norm_before_residual_changes_the_output(tmp_path: Path, target) -> None:
    after = save_random_eagle3(tmp_path / "after", target.config, seed=6)
    before = save_random_eagle3(
        tmp_path / "before", target.config, seed=6, norm_before_residual=True
    )
    _, out_after, _ = _paged(_load(after, target), seed=3)
    _, out_before, _ = _paged(_load(before, target), seed=3)
    assert (out_after - out_before).abs().max() > 0.1


def test_eagle3_t2d_is_ignored_and_d2t_is_optional(tmp_path: Path, target) -> None:
    small = _load(
        save_random_eagle3(tmp_path / "small", target.config, seed=7, draft_vocab_size=50), target
    )
    assert "t2d" not in small.w and small.d2t is not None
    full = _load(save_random_eagle3(tmp_path / "full", target.config, seed=7), target)
    assert full.d2t is None
    logits = torch.randn(2, TINY_VOCAB)
    assert full.target_logits(logits) is logits
    tensors = load_file(str(tmp_path / "small" / HEAD_WEIGHTS))
    del tensors["d2t"]
    save_file(tensors, str(tmp_path / "small" / HEAD_WEIGHTS))
    with pytest.raises(ValueError, match="without d2t"):
        _load(tmp_path / "small", target)


# -- EAGLE-1/2 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("fc_bias", "input_layernorm"), [(True, False), (False, True)])
def test_eagle1_head_matches_dense_reference(
    tmp_path: Path, target, fc_bias: bool, input_layernorm: bool
) -> None:
    head_dir = save_random_eagle(
        tmp_path / "head", target.config, seed=8, fc_bias=fc_bias, input_layernorm=input_layernorm
    )
    head = _assert_matches_reference(head_dir, target)
    assert ("fc.bias" in head.w) is fc_bias
    assert ("midlayer.input_layernorm.weight" in head.w) is input_layernorm


def test_layout_detection_from_architectures_and_names(tmp_path: Path, target) -> None:
    config = target.config
    eagle3 = _load(save_random_eagle3(tmp_path / "e3", config, seed=1), target)
    assert (eagle3.config.layout, eagle3.config.aux_layers) == ("eagle3", (1, 1, 0))
    eagle1 = _load(save_random_eagle(tmp_path / "e1", config, seed=1), target)
    assert (eagle1.config.layout, eagle1.config.aux_layers) == ("eagle", (NUM_TARGET_LAYERS,))
    assert eagle1.config.feature_width == config.hidden_size
    eagle3_names = ["fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight"]
    assert detect_layout({"architectures": ["LlamaForCausalLM"]}, eagle3_names) == "eagle3"
    assert detect_layout({"architectures": ["Eagle3LlamaForCausalLM"]}, ["fc.weight"]) == "eagle3"
    eagle1_names = ["fc.weight", "layers.0.self_attn.q_proj.weight"]
    assert detect_layout({"architectures": ["LlamaForCausalLM"]}, eagle1_names) == "eagle"
    with pytest.raises(ValueError, match="not an EAGLE head"):
        detect_layout({"architectures": ["LlamaForCausalLM"]}, ["model.embed_tokens.weight"])


def test_two_layer_heads_are_refused(tmp_path: Path, target) -> None:
    head_dir = save_random_eagle(tmp_path / "head", target.config, seed=1)
    tensors = load_file(str(head_dir / HEAD_WEIGHTS))
    tensors["layers.1.post_attention_layernorm.weight"] = torch.ones(target.config.hidden_size)
    save_file(tensors, str(head_dir / HEAD_WEIGHTS))
    with pytest.raises(ValueError, match="only single-layer"):
        _load(head_dir, target)


# -- feature width -----------------------------------------------------------------------------


def test_fc_width_must_match_the_aux_layers_at_load(tmp_path: Path, target) -> None:
    head_dir = save_random_eagle3(tmp_path / "head", target.config, seed=1)
    config = json.loads((head_dir / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2]  # fc takes 3 layers
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 192\), want \(64, 128\)"):
        _load(head_dir, target)


def test_draft_call_with_rows_of_the_wrong_width_is_invalid(tmp_path: Path, target) -> None:
    from drafter.engine import DrafterEngine

    head = _load(save_random_eagle(tmp_path / "head", target.config, seed=1), target)
    engine = DrafterEngine(Eagle3Proposer(head, head.make_kv_cache(16, 16)))
    rows = torch.zeros(2, 3 * target.config.hidden_size)  # EAGLE-3 width for an EAGLE-1 head
    spec = SpecParams(2, 1, 2)
    with pytest.raises(ServiceError, match=r"want \[rows, 64\]") as err:
        engine.draft([DraftInput("s", True, 0, [3, 4, 5], spec, target_hidden_states=rows)])
    assert err.value.code == Code.INVALID_ARGUMENT
    engine.release(["s"])
    engine.check_integrity()


# -- embeddings and lm_head from the target ----------------------------------------------------


@pytest.mark.parametrize("layout", ["eagle3", "eagle"])
def test_embeds_with_the_targets_embedding_when_the_head_has_none(
    tmp_path: Path, target, layout: str
) -> None:
    save = save_random_eagle3 if layout == "eagle3" else save_random_eagle
    plain = _load(save(tmp_path / "plain", target.config, seed=9), target)
    assert torch.equal(plain.embed, target.embed_tokens.weight)
    own_dir = save(tmp_path / "own", target.config, seed=9, embed=True)
    own = _load(own_dir, target)
    own_embed = load_file(str(own_dir / HEAD_WEIGHTS))["embed_tokens.weight"].double()
    assert torch.equal(own.embed, own_embed)
    assert not torch.equal(own.embed, target.embed_tokens.weight)


def test_eagle1_logits_come_from_the_targets_lm_head(tmp_path: Path, target) -> None:
    head = _load(save_random_eagle(tmp_path / "head", target.config, seed=1), target)
    assert "norm.weight" not in head.w
    assert torch.equal(head.w["lm_head.weight"], target.lm_head_weight)


# -- the target's last hidden state, after its final norm --------------------------------------


def _plain_prefill(
    target: LlamaModel, ids: list[int], aux_layers: tuple[int, ...] = ()
) -> ForwardOutput:
    """The target over `ids` on a scratch cache; ForwardOutput with every row."""
    n = len(ids)
    kv = make_kv_cache(target.config, 8, 16, torch.float64, "cpu")
    seq = kv.new_seq()
    kv.reserve(seq, n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    step = dense_step(seq, ids, list(range(n)), list(range(n)), mask, list(range(n)))
    try:
        return target(build_forward_batch([step], kv.page_size)[0], kv, aux_layers=aux_layers)
    finally:
        kv.release(seq)


def test_aux_layer_num_layers_is_the_final_normed_hidden_state(target) -> None:
    n = NUM_TARGET_LAYERS
    out = _plain_prefill(target, [5, 9, 2, 7, 1, 3], aux_layers=(n - 1, n))
    assert out.hidden_states is not None
    last_layer, final = out.hidden_states.split(target.config.hidden_size, dim=-1)  # [6, H] each
    assert torch.equal(final, rms_norm(last_layer, target.norm.weight, target.config.rms_norm_eps))
    torch.testing.assert_close(out.logits, (final @ target.lm_head_weight.T).float())


def test_verifier_accepts_layers_up_to_num_layers(target) -> None:
    from verifier.engine import VerifierEngine

    c = target.config
    kv = make_kv_cache(c, 16, 16, torch.float64, "cpu")
    verifier = VerifierEngine(target, kv, c.max_position_embeddings, c.vocab_size)
    tree = DraftTree([4], [-1])
    bad = VerifyInput("s", True, 0, [1, 2, 3], tree, hidden_state_layers=(NUM_TARGET_LAYERS + 1,))
    with pytest.raises(ServiceError, match=r"outside \[0, 4\]"):
        verifier.verify([bad])
    good = VerifyInput("s", True, 0, [1, 2, 3], tree, hidden_state_layers=(NUM_TARGET_LAYERS,))
    (result,) = verifier.verify([good])
    assert result.hidden_states is not None
    assert result.hidden_states.shape == (3 + result.num_accepted_drafts, c.hidden_size)
    verifier.release(["s"])
    verifier.check_integrity()


def test_eagle1_pass_through_head_reads_what_the_targets_lm_head_reads(
    tmp_path: Path, target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fc = [0 | I] and a layer that adds nothing, the head's logits are lm_head(feature):
    at the root, fed the verifier's rows for layer num_layers, they are the target's own logits
    at the last prompt token (up to the rows' bf16 rounding)."""
    from drafter.engine import DrafterEngine
    from verifier.engine import VerifierEngine

    c = target.config
    head_dir = save_random_eagle(tmp_path / "head", c, seed=1, fc_bias=False)
    tensors = load_file(str(head_dir / HEAD_WEIGHTS))
    eye = torch.eye(c.hidden_size)
    tensors["fc.weight"] = torch.cat([torch.zeros_like(eye), eye], dim=1)
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    save_file(tensors, str(head_dir / HEAD_WEIGHTS))
    head = _load(head_dir, target)
    prompt = [5, 9, 2, 7, 1, 3]
    kv = make_kv_cache(c, 16, 16, torch.float64, "cpu")
    verifier = VerifierEngine(target, kv, c.max_position_embeddings, c.vocab_size)
    layers = head.config.aux_layers
    verify = VerifyInput("s", True, 0, prompt, DraftTree(), hidden_state_layers=layers)
    (verified,) = verifier.verify([verify])
    verifier.release(["s"])
    rows = verified.hidden_states  # [6, H] bf16
    assert rows is not None
    target_logits = _plain_prefill(target, prompt).logits[-1]  # [V] at the last prompt token

    recorded: list[torch.Tensor] = []
    original = Eagle3Head.forward

    def record(self: Eagle3Head, batch, kv, features):  # type: ignore[no-untyped-def]
        logits, out = original(self, batch, kv, features)
        recorded.append(logits)
        return logits, out

    monkeypatch.setattr(Eagle3Head, "forward", record)
    engine = DrafterEngine(Eagle3Proposer(head, head.make_kv_cache(16, 16)))
    tokens = prompt + [verified.bonus_token]
    (drafted,) = engine.draft(
        [DraftInput("s", True, 0, tokens, SpecParams(1, 1, 1), target_hidden_states=rows)]
    )
    engine.release(["s"])
    root_logits = recorded[0][0]
    lm_head_of_rows = F.linear(rows[-1].double(), target.lm_head_weight).float()
    assert torch.equal(root_logits, lm_head_of_rows)
    torch.testing.assert_close(root_logits, target_logits, rtol=0.02, atol=0.02)
    assert drafted.tree.tokens == [verified.bonus_token]


# -- lossless greedy with an EAGLE-1/2 head ----------------------------------------------------


def _requests(seed: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, TINY_VOCAB, (3 + 4 * i,), generator=gen).tolist() for i in range(3)]
    return [GenerationRequest(p, MAX_NEW_TOKENS, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize(("topk", "num_steps", "num_draft_tokens"), [(1, 3, 3), (2, 3, 6)])
def test_eagle1_speculative_greedy_equals_target_greedy(
    tmp_path: Path,
    target_dir: Path,
    target,
    smollm2_tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
) -> None:
    head_dir = save_random_eagle(tmp_path / "head", target.config, seed=11)
    plain = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    expected = [generated_ids(c) for c in generate_all(plain, _requests(seed=11))]
    tree_sizes: list[int] = []
    original = Eagle3Proposer.propose

    def record(self: Eagle3Proposer, jobs):  # type: ignore[no-untyped-def]
        trees = original(self, jobs)
        tree_sizes.extend(len(tree) for tree in trees)
        return trees

    monkeypatch.setattr(Eagle3Proposer, "propose", record)
    spec = SpecParams(num_steps, topk, num_draft_tokens)
    stack = make_stack(target_dir, "eagle3", smollm2_tokenizer, spec, draft_dir=head_dir)
    assert stack.scheduler.hidden_state_layers == (NUM_TARGET_LAYERS,)
    out = generate_all(stack, _requests(seed=11))
    assert [generated_ids(c) for c in out] == expected
    assert num_draft_tokens in tree_sizes  # the head drafted full trees, not only empty ones
