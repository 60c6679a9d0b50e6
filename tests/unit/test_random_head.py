"""bench/random_model.py's random EAGLE-3 head (`--eagle3-head`): written in the published
layout, it loads as the drafter service loads a head, shaped as the target."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig

from bench.random_model import save_eagle3_head
from drafter.eagle import load_eagle3
from tests.support import TINY_VOCAB, save_tiny_llama

DRAFT_VOCAB = 48


def test_the_random_head_loads_shaped_as_its_target(tmp_path: Path) -> None:
    target = save_tiny_llama(tmp_path / "target", seed=0, num_layers=4)
    config = LlamaConfig.from_pretrained(target)
    save_eagle3_head(str(tmp_path / "head"), config, DRAFT_VOCAB, "cpu", torch.float32)
    head = load_eagle3(str(tmp_path / "head"), str(target), torch.float32, "cpu")
    c = head.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads) == (64, 4, 2)
    assert c.intermediate_size == config.intermediate_size
    assert c.feature_width == 3 * 64  # three target layers' outputs, fused
    ids = head.to_target_ids(torch.arange(DRAFT_VOCAB))
    assert ids.tolist() == sorted(set(ids.tolist()))  # distinct, in order
    assert int(ids[0]) >= 0 and int(ids[-1]) < TINY_VOCAB


def test_the_mirrored_draft_predicts_its_target(tmp_path: Path) -> None:
    """`--mirror-draft`: the target's layers past the first add nothing, so the one-layer draft
    gives the target's logits at a fraction of its layers (each later layer adds zeros; to the
    last bit of float64, not bit for bit: transformers 5.24's forward differs there by 1e-15)."""
    from transformers import LlamaForCausalLM

    from bench.random_model import mirror

    target = save_tiny_llama(tmp_path / "target", seed=3, num_layers=4)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float64)
    mirror(model, 1, str(tmp_path / "draft"))
    draft = LlamaForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float64)
    assert (model.config.num_hidden_layers, draft.config.num_hidden_layers) == (4, 1)
    tokens = torch.randint(3, TINY_VOCAB, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(tokens).logits, draft(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_sharpened_mirror_draft_still_predicts_its_target_with_a_peaked_distribution(
    tmp_path: Path,
) -> None:
    """`--logit-scale`: the logits are S times the unscaled model's (the final norm's weight
    scaled), the mirrored draft shares that norm and still gives the target's logits, and the
    top token's probability at temperature 1 rises."""
    from transformers import LlamaForCausalLM

    from bench.random_model import mirror, sharpen

    target = save_tiny_llama(tmp_path / "target", seed=3, num_layers=4)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float64)
    tokens = torch.randint(3, TINY_VOCAB, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        flat = model(tokens).logits
    sharpen(model, 8.0)
    with torch.no_grad():
        sharp = model(tokens).logits
    torch.testing.assert_close(sharp, 8.0 * flat, rtol=1e-10, atol=1e-10)
    mirror(model, 1, str(tmp_path / "draft"))
    draft = LlamaForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float64)
    with torch.no_grad():
        want, got = model(tokens).logits, draft(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert bool((sharp.softmax(-1).amax(-1) > flat.softmax(-1).amax(-1)).all())
