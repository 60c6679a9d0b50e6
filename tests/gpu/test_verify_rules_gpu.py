"""Logit rules on a CUDA device: tests/unit/test_verify_rules.py's engine cases with the verifier
on CUDA graphs (float32; the forward's argmax is taken again on the bent rows), decode steps run
ahead where a round allows it (under rules too: their bending counts the token drawn on the
device), whose bending waits for nothing on the device; rules kept between rounds
(tests/unit/test_kept_rules.py), their rows on the device followed round after round
(tests/unit/test_rule_rows.py) without waiting for it. Skipped without a GPU."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from specsplit.logit_rules import NO_MASK, Allowed, LogitRules, Penalties, mask_words
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.rules_reference import rules_for
from tests.unit.test_kept_rules import (  # noqa: F401  (pytest collects them here)
    test_a_round_whose_context_differs_is_bent_by_what_it_sent,
    test_rounds_take_the_rules_their_commit_kept,
)
from tests.unit.test_rule_rows import (
    test_a_step_run_ahead_counts_its_pending_token_and_its_commit_follows,
    test_rounds_count_only_what_their_commits_appended,
)
from tests.unit.test_verify_rules import (  # noqa: F401  (pytest collects them here)
    reference,
    target_dir,
    test_bent_rows_are_the_reference_rows,
    test_decode_steps_under_rules_are_the_targets_greedy_tokens,
    test_each_sequence_is_bent_by_its_own_rules_alone,
    test_logprobs_under_rules_are_the_raw_distribution,
    test_malformed_rules_are_refused,
    test_min_p_draws_only_tokens_likely_enough,
    test_rules_rounds_are_counted_by_path,
    test_sampled_rounds_draw_from_the_bent_distribution,
    test_speculative_rounds_commit_the_targets_greedy_tokens_under_the_rules,
    test_steps_run_ahead_hold_stop_tokens_back_until_min_tokens,
    truth,
)
from verifier.kept_rules import keep_rules
from verifier.round_rules import bend_by_rules
from verifier.rounds import VerifierSeq
from verifier.rule_rows import RuleRows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda"


def _sync_round(vocab: int) -> tuple[list[VerifyInput], list[range]]:
    """A round with every rule the bending reads: a bias, the three penalties over an output and a
    prompt, min_tokens' stop tokens, min_p, a guide's masks; trees whose paths repeat tokens."""
    every = Penalties(
        bias=((3, 2.0), (5, -100.0)),
        presence=0.5,
        frequency=1.25,
        repetition=1.4,
        min_tokens=9,
        stop_ids=(7, 8),
        min_p=0.05,
    )
    bits = np.zeros((2, mask_words(vocab) * 32), dtype=bool)
    bits[0, :20], bits[1, 10:vocab] = True, True
    words = np.packbits(bits, axis=1, bitorder="little").tobytes()
    trees = [DraftTree([3, 5, 3], [-1, 0, 1]), DraftTree([2, 2], [-1, -1]), DraftTree()]
    rules = [
        rules_for(every, (8, 9, 30), Counter([3, 4, 3])),
        LogitRules(Penalties(), allowed=Allowed(words, (0, 1, NO_MASK))),
        rules_for(Penalties(presence=1.0, min_tokens=4, stop_ids=(1,)), (), Counter([6])),
    ]
    inputs, rows, start = [], [], 0
    for i, (tree, r) in enumerate(zip(trees, rules, strict=True)):
        sampling = SamplingParams(temperature=0.7)
        inputs.append(VerifyInput(f"s{i}", False, 10, [4], tree, sampling, rules=r))
        rows.append(range(start, start + len(tree) + 1))
        start += len(tree) + 1
    return inputs, rows


def test_bending_queues_behind_the_device_without_waiting_for_it() -> None:
    """A round's bending, every rule and a decode step's pending tokens (run ahead: only the
    device has them), issues no host sync (`torch.cuda.set_sync_debug_mode("error")`): a sync
    would wait for the step launched before it and make the steps run ahead serial again.
    Each bends the rows exactly as on the CPU."""
    torch.manual_seed(5)
    vocab = 48
    inputs, rows = _sync_round(vocab)
    steps = [replace(item, tree=DraftTree()) for item in inputs]  # (the guide's first row's mask)
    guided = steps[1].rules
    assert guided is not None and guided.allowed is not None
    steps[1].rules = replace(guided, allowed=replace(guided.allowed, rows=(0,)))
    step_rows = [range(i, i + 1) for i in range(len(steps))]
    pending = torch.tensor([3, 9, 6], dtype=torch.int32)
    cases = [(inputs, rows, None), (steps, step_rows, pending)]
    for items, item_rows, drawn in cases:
        logits = torch.randn(item_rows[-1].stop, vocab) * 4
        want = logits.clone()
        assert bend_by_rules(items, want, item_rows, drawn)
        got = logits.cuda()
        drawn_d = None if drawn is None else drawn.cuda()
        torch.cuda.synchronize()
        torch.cuda._sleep(10**7)  # (device work queued before it, as a step run ahead)
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert bend_by_rules(items, got, item_rows, drawn_d)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.cpu(), want)


def test_kept_rows_follow_the_commits_without_waiting_for_the_device() -> None:
    """tests/unit/test_rule_rows.py's rounds with the rows on the GPU: filled, deltas counted in,
    the tables grown, a step's pending token; each bending under sync debug mode "error" behind
    queued device work, every row the reference's, bit for bit."""
    test_rounds_count_only_what_their_commits_appended("cuda")
    test_a_step_run_ahead_counts_its_pending_token_and_its_commit_follows("cuda")


@pytest.mark.parametrize("vocab", [49152, 128256], ids=["smollm2", "llama3"])
def test_kernels_bend_real_vocabularies_as_torchs_ops(vocab: int) -> None:
    """specsplit/kernels/bend_rules.py's Triton kernels (the GPU's default) against torch's ops on
    the GPU, bit for bit, at real vocabularies: 32 sequences of every kind of rule (the guide's
    masks among them) on trees of up to 8 nodes, each path in its own kept rows, over three
    rounds of commits (the kept counts followed by the kernels' atomics), min_p's cut over
    whole rows; a step run ahead's pending tokens last."""
    rng = np.random.default_rng(vocab)
    bits = rng.random((3, mask_words(vocab) * 32)) < 0.5
    words = np.packbits(bits, axis=1, bitorder="little").tobytes()
    kinds = [
        Penalties(bias=((3, 2.0), (vocab - 1, -7.5))),
        Penalties(presence=0.5, frequency=1.25),
        Penalties(repetition=1.4, min_p=0.05),
        Penalties(repetition=1.3, presence=0.2, min_tokens=40, stop_ids=(1, 2, vocab - 2)),
    ]
    outputs = [list(rng.integers(0, vocab, 30)) for _ in range(32)]
    seqs = [[VerifierSeq(f"s{i}", None) for i in range(32)] for _ in range(2)]  # type: ignore[arg-type]
    kept = [RuleRows(vocab, "cuda"), RuleRows(vocab, "cuda")]
    for step in range(4):
        inputs, rows, start = [], [], 0
        for i in range(32):
            n = 0 if step == 3 else int(rng.integers(0, 9))
            tokens = rng.integers(0, vocab, n).tolist()
            tokens[: n // 2] = outputs[i][: n // 2]  # (paths repeating the output)
            tree = DraftTree(tokens, [int(rng.integers(-1, j)) for j in range(n)])
            allowed = (
                Allowed(words, tuple(rng.integers(-1, 3, n + 1).tolist())) if i % 5 == 0 else None
            )
            prompt = tuple(sorted(set(rng.integers(0, vocab, 20).tolist())))
            rules = rules_for(kinds[i % 4], prompt, Counter(outputs[i]), allowed)
            sampling = SamplingParams(temperature=0.8)
            inputs.append(VerifyInput(f"s{i}", False, 10, [4], tree, sampling, rules=rules))
            rows.append(range(start, start + n + 1))
            start += n + 1
        logits = torch.randn(start, vocab, device="cuda") * 4
        pending = torch.randint(0, vocab, (32,), device="cuda") if step == 3 else None
        got, want = logits.clone(), logits.clone()
        assert bend_by_rules(inputs, got, rows, pending, (kept[0], seqs[0]), kernel=True)
        assert bend_by_rules(inputs, want, rows, pending, (kept[1], seqs[1]), kernel=False)
        assert torch.equal(got, want)
        assert not torch.equal(got, logits)
        for i, item in enumerate(inputs):  # each commits its tree's first node and a token
            appended = item.tree.tokens[:1] + [int(rng.integers(0, vocab))]
            for side in seqs:
                keep_rules(item, side[i], appended)
            outputs[i] += appended
        assert all(seq.rule_slot is not None and seq.rule_slot.deltas for seq in seqs[0])
