"""Sampling through the real engines draws from the target's own distribution (DESIGN.md §2).

A tiny random target with a 16-token vocabulary and a different random draft model; many
seeded requests generate two tokens each. The empirical distributions of the first token, the
second token and the pair are compared with the exact ones computed from transformers' model.
Tolerance on total variation: 1.5 * sqrt(K / N) for K outcomes and N samples (the expected
distance of a correct sampler is below 0.5 * sqrt(2K / (pi N)), about a quarter of that), so
the bound shrinks as samples grow. With draft-ahead the requests generate four tokens, so that
rounds take sampled chains drafted ahead, and each token's marginal is checked; and the chains
drafted ahead are themselves checked as draws from the distributions they report (a biased
uniform, u squared, gives a distance twice the bound).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from drafter.engine import DrafterEngine
from gateway.request import GenerationRequest
from specsplit.messages import DraftInput, SpecParams
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams, target_probs
from specsplit.tree import DraftTree
from tests.eagle_random import save_random_eagle3
from tests.support import generate_all, generated_ids, make_stack, save_tiny_llama

VOCAB = 16
NUM_SAMPLES = 3000
PROMPT = [3, 7, 1, 12, 5]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sampling_models")
    target = save_tiny_llama(root / "target", seed=3, vocab_size=VOCAB)
    _, config = load_model(str(target), dtype=torch.float32, device="cpu")
    return {
        "target": target,
        "draft": save_tiny_llama(root / "draft", seed=4, vocab_size=VOCAB, num_layers=1),
        "eagle3": save_random_eagle3(root / "head", config, seed=5),
    }


def _exact_pair_distribution(target_dir: Path, sampling: SamplingParams) -> torch.Tensor:
    """[V, V] probability of (first, second) generated token under plain target sampling."""
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    with torch.no_grad():
        first = target_probs(model(torch.tensor([PROMPT])).logits[0, -1:], sampling)[0]
        seconds = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = target_probs(model(seconds).logits[:, -1], sampling)  # [V, V]
    return first.double()[:, None] * second.double()


def _total_variation(counts: Counter[object], probs: dict[object, float], n: int) -> float:
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


def assert_pairs_follow(pairs: list[tuple[int, ...]], exact: torch.Tensor) -> None:
    """Sampled (first, second) token pairs follow `exact` ([V, V] probabilities): each token's
    distribution within the total-variation bound, the likeliest pairs each within 5 sigma."""
    first = {t: float(exact[t].sum()) for t in range(VOCAB)}
    second = {t: float(exact[:, t].sum()) for t in range(VOCAB)}
    n = len(pairs)
    assert {p[0] for p in pairs} <= {t for t, v in first.items() if v > 0}
    for counts, probs in [
        (Counter(p[0] for p in pairs), first),
        (Counter(p[1] for p in pairs), second),
    ]:
        support = sum(1 for v in probs.values() if v > 0)
        assert _total_variation(counts, probs, n) < 1.5 * math.sqrt(support / n)
    joint = {(a, b): float(exact[a, b]) for a in range(VOCAB) for b in range(VOCAB)}
    pair_counts = Counter(pairs)
    for cell in sorted(joint, key=joint.__getitem__, reverse=True)[:8]:
        p = joint[cell]
        assert abs(pair_counts[cell] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9, cell


def _stack(models, tokenizer, drafter: str, spec: SpecParams, overlap: str, num_pages: int):
    """A float32 stack with `drafter` ("model": the random draft model, or "eagle3") that takes
    every request into one batch."""
    stack = make_stack(
        models["target"],
        drafter,
        tokenizer,
        spec,
        draft_dir=models[drafter if drafter == "eagle3" else "draft"],
        dtype=torch.float32,
        num_pages=num_pages,
        overlap=overlap,
    )
    stack.scheduler.max_batch_size = 1000
    return stack


@pytest.mark.parametrize(
    ("name", "spec", "sampling", "overlap"),
    [
        ("chain_with_draft_probs", SpecParams(3, 1, 3), SamplingParams(temperature=1.0), "serial"),
        ("tree_topk2", SpecParams(2, 2, 4), SamplingParams(temperature=0.8), "serial"),
        (
            "tree_topk4_top_p_top_k",
            SpecParams(2, 4, 6),
            SamplingParams(temperature=1.3, top_p=0.9, top_k=8),
            "serial",
        ),
        (
            "eagle3_chain_with_draft_probs",
            SpecParams(3, 1, 3),
            SamplingParams(temperature=1.0),
            "serial",
        ),
        ("eagle3_tree_topk2", SpecParams(2, 2, 4), SamplingParams(temperature=0.8), "serial"),
        # pipelined groups: a group's trees are drafted while the other group is verified
        ("groups_chain", SpecParams(3, 1, 3), SamplingParams(temperature=1.0), "groups"),
        ("groups_tree_topk2", SpecParams(2, 2, 4), SamplingParams(temperature=0.8), "groups"),
        # two tokens: no round takes a tree drafted ahead (test_tokens_drafted_ahead_... below
        # does); "both" runs its groups rounds above --ahead-max-batch
        ("ahead_chain", SpecParams(3, 1, 3), SamplingParams(temperature=1.0), "ahead"),
        ("both_chain", SpecParams(3, 1, 3), SamplingParams(temperature=1.0), "both"),
    ],
)
def test_first_tokens_follow_target_distribution(
    models,
    smollm2_tokenizer,
    name: str,
    spec: SpecParams,
    sampling: SamplingParams,
    overlap: str,
) -> None:
    drafter = "eagle3" if name.startswith("eagle3") else "model"
    stack = _stack(models, smollm2_tokenizer, drafter, spec, overlap, num_pages=2048)
    requests = [
        GenerationRequest(
            list(PROMPT),
            2,
            SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed=i),
            ignore_eos=True,
        )
        for i in range(NUM_SAMPLES)
    ]
    pairs = [tuple(generated_ids(chunks)) for chunks in generate_all(stack, requests)]
    assert all(len(p) == 2 for p in pairs)

    exact = _exact_pair_distribution(models["target"], sampling)
    first = {t: float(exact[t].sum()) for t in range(VOCAB)}
    second = {t: float(exact[:, t].sum()) for t in range(VOCAB)}
    joint = {(a, b): float(exact[a, b]) for a in range(VOCAB) for b in range(VOCAB)}
    n = len(pairs)
    for counts, probs in [
        (Counter(p[0] for p in pairs), first),
        (Counter(p[1] for p in pairs), second),
    ]:
        support = sum(1 for v in probs.values() if v > 0)
        assert _total_variation(counts, probs, n) < 1.5 * math.sqrt(support / n)
    # the pair has up to V^2 outcomes: check it only on the cells that hold most of the mass
    top = sorted(joint, key=joint.__getitem__, reverse=True)[:8]
    pair_counts = Counter(pairs)
    for cell in top:
        p = joint[cell]
        assert abs(pair_counts[cell] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9, cell


AHEAD_TOKENS = 4
AHEAD_SAMPLES = 2000


def _exact_marginals(
    target_dir: Path, sampling: SamplingParams, length: int, prompt: list[int] = PROMPT
) -> list[torch.Tensor]:
    """[V] probability of each of the first `length` generated tokens after `prompt` under
    plain target sampling, over every prefix of the tokens before it (V ** (length - 1) at the
    last)."""
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    prefixes, weights = torch.tensor([prompt]), torch.ones(1, dtype=torch.float64)
    marginals = []
    with torch.no_grad():
        for t in range(length):
            probs = target_probs(model(prefixes).logits[:, -1], sampling).double()  # [P, V]
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            if t + 1 < length:
                tokens = torch.arange(VOCAB).repeat(len(prefixes))[:, None]
                prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), tokens], dim=1)
                weights = joint.reshape(-1)
    return marginals


@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_tokens_drafted_ahead_follow_target_distribution(
    models, smollm2_tokenizer, drafter: str
) -> None:
    """Draft-ahead of sampled chains (overlap "ahead"): rounds take the chains drafted ahead
    for their outcomes, drawn at the drafter's next uniforms with their draft distributions
    (an EAGLE head's from its own features past the root), and each of the first four tokens
    follows the target's own distribution (misses run plain, the default)."""
    spec, sampling = SpecParams(3, 1, 3), SamplingParams(temperature=1.0)
    stack = _stack(models, smollm2_tokenizer, drafter, spec, "ahead", num_pages=4096)
    requests = [
        GenerationRequest(list(PROMPT), AHEAD_TOKENS, SamplingParams(1.0, seed=i), ignore_eos=True)
        for i in range(AHEAD_SAMPLES)
    ]
    outs = [generated_ids(chunks) for chunks in generate_all(stack, requests)]
    assert all(len(out) == AHEAD_TOKENS for out in outs)
    assert stack.scheduler.num_ahead_hits > AHEAD_SAMPLES // 4  # rounds took trees drafted ahead
    n = len(outs)
    for t, exact in enumerate(_exact_marginals(models["target"], sampling, AHEAD_TOKENS)):
        probs = {v: float(exact[v]) for v in range(VOCAB)}
        counts = Counter(out[t] for out in outs)
        support = sum(1 for v in probs.values() if v > 0)
        assert _total_variation(counts, probs, n) < 1.5 * math.sqrt(support / n), t


LOOKUP_PROMPT = [3, 7, 1, 12, 3, 7, 1, 12, 5, 3, 7]  # repeats: prompt lookup finds chains


def test_tokens_of_lookup_steps_follow_target_distribution(models, smollm2_tokenizer) -> None:
    """Rounds of 4 decode steps whose steps verify chains of prompt lookup (--decode-lookup 3:
    deterministic drafts from the sequence's own tokens, accepted against the target's
    distribution): each of the first four tokens follows the target's own distribution."""
    sampling = SamplingParams(temperature=1.0)
    stack = make_stack(models["target"], "ngram", smollm2_tokenizer, SpecParams(0, 1, 0),
                       dtype=torch.float32, num_pages=4096, decode_steps=4, decode_lookup=3,
                       decode_lookup_max_batch=AHEAD_SAMPLES)  # fmt: skip
    stack.scheduler.max_batch_size = 1000
    stack.verifier.lookup_min_ngram = 1  # (one-token matches too: more chains, some accepted)
    requests = [
        GenerationRequest(
            list(LOOKUP_PROMPT), AHEAD_TOKENS, SamplingParams(1.0, seed=i), ignore_eos=True
        )
        for i in range(AHEAD_SAMPLES)
    ]
    outs = [generated_ids(chunks) for chunks in generate_all(stack, requests)]
    assert all(len(out) == AHEAD_TOKENS for out in outs)
    # chains were taken (427 of 6,377 drafts accepted when written)
    assert stack.verifier.num_lookup_accepted > AHEAD_SAMPLES // 10
    n = len(outs)
    exact = _exact_marginals(models["target"], sampling, AHEAD_TOKENS, LOOKUP_PROMPT)
    for t, marginal in enumerate(exact):
        probs = {v: float(marginal[v]) for v in range(VOCAB)}
        counts = Counter(out[t] for out in outs)
        support = sum(1 for v in probs.values() if v > 0)
        assert _total_variation(counts, probs, n) < 1.5 * math.sqrt(support / n), t


@pytest.mark.parametrize("device_expansion", [True, False], ids=["device", "forks"])
def test_chains_drafted_ahead_are_draws_from_the_distributions_they_report(
    models, device_expansion: bool
) -> None:
    """What acceptance's exactness rests on for trees drafted ahead: a sampled chain drafted
    ahead for an outcome is a draw from the draft distributions it reports. A newcomer's first
    draft-ahead call (no chain verified: guesses at the root, the same for every seed) for many
    seeded sequences: per guessed bonus token, the chains' first drafts follow the row they
    report for it, and their second drafts the rows reported after each first draft."""
    chain, n = SpecParams(3, 1, 3), AHEAD_SAMPLES
    # a page a sequence, and one a fork of it (the forks' reference copies the partial page)
    engine = DrafterEngine.load(
        "model", str(models["draft"]), dtype=torch.float32, num_pages=6 * n, page_size=16
    )
    engine.proposer.device_expansion = device_expansion  # type: ignore[attr-defined]
    items = [
        DraftInput(f"s{i}", True, 0, list(PROMPT), chain, SamplingParams(1.0, seed=i),
                   verifying=DraftTree(), ahead_guesses=4)
        for i in range(n)
    ]  # fmt: skip
    by_bonus: dict[int, list[DraftTree]] = {}
    for out in engine.draft(items):
        assert len(out.ahead) == 4
        for ahead in out.ahead:
            by_bonus.setdefault(ahead.tokens[-1], []).append(ahead.tree)
    assert len(by_bonus) == 4
    bound = 1.5 * math.sqrt(VOCAB / n)
    for trees in by_bonus.values():
        assert len(trees) == n and all(len(tree) == chain.num_steps for tree in trees)
        rows = torch.stack([tree.draft_probs.dense() for tree in trees])  # type: ignore[union-attr]
        for step in range(2):  # each draft against the mean of the rows it was drawn from
            want = rows[:, step].double().mean(dim=0)
            counts = Counter(tree.tokens[step] for tree in trees)
            probs = {v: float(want[v]) for v in range(VOCAB)}
            assert _total_variation(counts, probs, n) < bound, step
    engine.release([item.seq_id for item in items])
    assert engine.num_pages_used == 0
