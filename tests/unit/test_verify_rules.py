"""Logit rules (VerifyInput.rules: a bias, presence / frequency / repetition penalties): the
verifier bends each row exactly as the one-row reference does, reading the output so far and
the row's path in the tree; speculative rounds then commit exactly the target's greedy tokens
under the same rules (as plain decoding and several decode steps do); sampled rounds draw from
the bent distribution; log-probabilities stay the raw ones; a round with rules runs no decode
step ahead; the wire carries them; malformed rules are refused."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from specsplit.convert import verify_request_from_proto, verify_request_to_proto
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import LogitRules, Penalties, bend_row, distinct
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.rules_reference import rules_for
from tests.support import TINY_VOCAB
from tests.unit.test_verify_logprobs import (  # noqa: F401  (fixtures)
    PROMPT,
    _assert_close,
    _engine,
    _expected,
    device,
    reference,
    target_dir,
)
from verifier.engine import VerifierEngine
from verifier.round_rules import bend_by_rules, node_paths

# strong enough that greedy decoding under them differs from without
STRONG = Penalties(bias=((11, 3.0), (40, -100.0)), presence=1.5, frequency=2.0, repetition=1.8)
NUM_TOKENS = 14
SAMPLED = SamplingParams(temperature=0.7)


def _rules(penalties: Penalties | None, output: list[int]) -> LogitRules | None:
    return rules_for(penalties, distinct(PROMPT), Counter(output))


def _greedy(reference: LlamaForCausalLM, penalties: Penalties | None) -> list[int]:  # noqa: F811
    """The target's first NUM_TOKENS + 3 greedy tokens under `penalties`, a full forward
    each."""
    out: list[int] = []
    for _ in range(NUM_TOKENS + 3):
        with torch.no_grad():
            row = reference(torch.tensor([PROMPT + out])).logits[0, -1].float()
        rules = _rules(penalties, out)
        out.append(int((row if rules is None else bend_row(row, rules, [])).argmax()))
    return out


@pytest.fixture(scope="module")
def truth(reference: LlamaForCausalLM) -> list[int]:  # noqa: F811
    return _greedy(reference, STRONG)


def reference_bend(
    inputs: list[VerifyInput], rows: list[range], logits: torch.Tensor
) -> torch.Tensor:
    """The logits with each row of each input with rules bent alone by `bend_row` (its path in
    the tree, its place among its rows, the round's temperature)."""
    want = logits.clone()
    for item, r in zip(inputs, rows, strict=True):
        if item.rules is not None:
            paths = [[], *node_paths(item.tree)]
            for j, row in enumerate(r):
                temperature = item.sampling.temperature
                want[row] = bend_row(logits[row], item.rules, paths[j], temperature, at=j)
    return want


# each kind of rule alone, and together (tests/unit/test_bend_rules_kernel.py reads them too)
EACH_RULE = [
    pytest.param(Penalties(bias=((2, 1.5), (7, -100.0), (9, 40.0))), id="bias"),
    pytest.param(Penalties(repetition=1.7), id="repetition"),
    pytest.param(Penalties(repetition=0.6), id="repetition-below-1"),
    pytest.param(Penalties(presence=0.75, frequency=-1.25), id="presence-frequency"),
    pytest.param(Penalties(min_tokens=7, stop_ids=(1, 4, 11)), id="min-tokens"),
    pytest.param(replace(STRONG, min_tokens=7, stop_ids=(1, 4, 11)), id="min-tokens-and-all"),
    pytest.param(Penalties(min_p=0.2), id="min-p"),
    pytest.param(
        replace(STRONG, min_tokens=7, stop_ids=(1, 4, 11), min_p=0.05), id="min-p-and-all"
    ),
    pytest.param(STRONG, id="all"),
]


@pytest.mark.parametrize("penalties", EACH_RULE)
def test_bent_rows_are_the_reference_rows(
    penalties: Penalties,
    device: str,  # noqa: F811
    kernel: bool | None = None,  # (tests/unit/test_bend_rules_kernel.py: the kernels)
) -> None:
    """Every row of every sequence with rules as `bend_row` bends it alone (bit for bit), the
    row's path read: trees whose paths repeat tokens of the output and of themselves; a
    sequence without rules between them untouched. (min_tokens 7: the first's output holds 5
    tokens, its rows of depth 0 and 1 hold the stop tokens back; the third's holds 3. min_p
    reads the rounds' temperature.)"""
    torch.manual_seed(3)
    vocab = 48
    trees = [
        DraftTree([4, 6, 4, 9, 4, 6], [-1, -1, 0, 2, 3, 1]),
        DraftTree([1, 2], [-1, 0]),
        DraftTree(),
    ]
    rules = [
        rules_for(penalties, distinct([1, 2, 3, 3, 9, 40]), Counter([4, 4, 5, 9, 11])),
        None,
        rules_for(penalties, (0, 47), Counter([47, 6, 6])),
    ]
    inputs = [
        VerifyInput(f"s{i}", False, 10, [4], tree, SAMPLED, rules=r)
        for i, (tree, r) in enumerate(zip(trees, rules, strict=True))
    ]
    starts = [0, len(trees[0]) + 1, len(trees[0]) + len(trees[1]) + 2]
    rows = [range(s, s + len(t) + 1) for s, t in zip(starts, trees, strict=True)]
    logits = torch.randn(rows[-1].stop, vocab) * 4
    want = reference_bend(inputs, rows, logits)
    got = logits.clone().to(device)  # (on a GPU: the same float32 ops, bit for bit)
    assert bend_by_rules(inputs, got, rows, kernel=kernel)
    got = got.cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[rows[1].start : rows[1].stop], logits[rows[1].start : rows[1].stop])
    assert not torch.equal(got, logits)
    assert not bend_by_rules([VerifyInput("x", False, 1, [4], DraftTree())], got, rows[:1])


def test_each_sequence_is_bent_by_its_own_rules_alone(
    device: str,  # noqa: F811
    kernel: bool | None = None,
) -> None:
    """A round whose sequences ask for different rules (a bias only, counts only, min_tokens
    only, repetition with its prompt, all of them, none) on trees of one shape and of others:
    every row as `bend_row` bends it alone, bit for bit; the table carries only what each
    sequence's rules read, so no sequence's entries reach another's rows."""
    torch.manual_seed(11)
    vocab = 40
    kinds = [
        Penalties(bias=((3, 2.0), (5, -7.5))),
        Penalties(presence=0.5, frequency=1.25),
        Penalties(min_tokens=3, stop_ids=(0, 2)),  # (held at depths 0 and 1, not 2)
        None,
        Penalties(repetition=1.4),
        replace(STRONG, bias=((3, 1.0),), min_tokens=9, stop_ids=(7,)),
        Penalties(frequency=-0.5),
    ]
    trees = [
        DraftTree([3, 5, 3], [-1, 0, 1]),
        DraftTree([5, 3, 5], [-1, 0, 1]),
        DraftTree([7, 7, 2, 7], [-1, 0, -1, 2]),
        DraftTree([1], [-1]),
        DraftTree([9, 3, 9], [-1, 0, 1]),
        DraftTree(),
        DraftTree([3, 3, 3], [-1, 0, 1]),
    ]
    outputs = [[3, 4], [5, 5, 3], [1], [2], [9, 8], [3] * 5, [3, 6]]
    inputs, rows, start = [], [], 0
    for i, (penalties, tree, output) in enumerate(zip(kinds, trees, outputs, strict=True)):
        rules = rules_for(penalties, (8, 9, 30), Counter(output))
        inputs.append(VerifyInput(f"s{i}", False, 10, [4], tree, SAMPLED, rules=rules))
        rows.append(range(start, start + len(tree) + 1))
        start += len(tree) + 1
    logits = torch.randn(start, vocab) * 4
    want = reference_bend(inputs, rows, logits)
    got = logits.clone().to(device)
    assert bend_by_rules(inputs, got, rows, kernel=kernel)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[rows[3].start : rows[3].stop], logits[rows[3].start : rows[3].stop])


def test_speculative_rounds_commit_the_targets_greedy_tokens_under_the_rules(
    target_dir: Path,  # noqa: F811
    reference: LlamaForCausalLM,  # noqa: F811
    device: str,  # noqa: F811
    truth: list[int],
) -> None:
    """Trees of the right tokens, a wrong one and decoys, each round's rules the output so far:
    the target's greedy tokens under the rules, which differ from those without."""
    assert truth != _greedy(reference, None)
    engine = _engine(target_dir, device)
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []))
    out = engine.verify([first])[0]
    got = [out.bonus_token]
    while len(got) < NUM_TOKENS:
        k = len(got)  # the next two right, then a wrong one; a decoy beside the first
        wrong, decoy = (truth[k + 2] + 1) % TINY_VOCAB, (truth[k] + 5) % TINY_VOCAB
        tree = DraftTree([decoy, truth[k], truth[k + 1], wrong], [-1, -1, 1, 2])
        item = VerifyInput(
            "s", False, len(PROMPT) + len(got) - 1, got[-1:], tree, rules=_rules(STRONG, got)
        )
        out = engine.verify([item])[0]
        got += out.new_tokens
    assert got[:NUM_TOKENS] == truth[:NUM_TOKENS]
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_decode_steps_under_rules_are_the_targets_greedy_tokens(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
    truth: list[int],
) -> None:
    """A round of several decode steps reads each step's token into the next step's rules; the
    steps run ahead under rules (each counting the token the step before drew, on the device)
    and are taken by the round that asks for them: the further steps of a round, and the next
    round with its rules through that token; a round that asks otherwise (no rules) drops it."""
    engine = _engine(target_dir, device)
    first = engine.verify(
        [VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []))]
    )
    got = [first[0].bonus_token]
    used = engine.num_ahead_used
    item = VerifyInput("s", False, len(PROMPT), got[-1:], DraftTree(), rules=_rules(STRONG, got))
    item.decode_steps = 6
    out = engine.verify([item])[0]
    got += out.new_tokens
    assert engine.num_ahead_used == used + 6  # (the first round's next step, then its own)
    assert engine._ahead is not None and engine._ahead.inputs[0].rules == _rules(STRONG, got)
    packed = engine._ahead.packed  # one step runs ahead under rules: none queues behind it
    assert not engine._extend_ahead(engine._ahead, depth=3)
    assert engine._ahead.follower is None and engine._ahead.packed is packed
    item = VerifyInput(
        "s", False, out.kv_committed_len, got[-1:], DraftTree(), rules=_rules(STRONG, got)
    )
    got += engine.verify([item])[0].new_tokens
    assert engine.num_ahead_used == used + 7
    assert got == truth[: len(got)] and len(got) == 8
    dropped = engine.num_ahead_dropped
    plain = VerifyInput("s", False, len(PROMPT) + len(got) - 1, got[-1:], DraftTree())
    engine.verify([plain])
    assert engine.num_ahead_dropped == dropped + 1 and engine._ahead is not None
    engine.release(["s"])
    assert engine.num_pages_used == 0


def _rules_counts() -> dict[str, float]:
    """The verifier's forwards, its rules rounds by path and the eager ones by why, so far."""
    from prometheus_client import REGISTRY

    def get(name: str, label: str, value: str) -> float:
        return REGISTRY.get_sample_value(f"specsplit_{name}_total", {label: value}) or 0.0

    forwards = get("verifier_forwards", "path", "graph") + get("verifier_forwards", "path", "eager")
    paths = {path: get("verifier_rules_rounds", "path", path) for path in ("graph", "eager")}
    whys = ("no graphs", "logits", "refill", "masks")
    return {
        "forwards": forwards,
        **paths,
        **{why: get("verifier_eager_rules_rounds", "why", why) for why in whys},
    }


def test_rules_rounds_are_counted_by_path(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
) -> None:
    """`specsplit_verifier_rules_rounds_total{path}` counts each forward bent by rules once (a
    round's, each decode step's run ahead), `..._eager_rules_rounds_total{why}` the eager ones
    by why: on the CPU all eager with no graphs; on a GPU (as served) the steady decode steps
    by a rules graph. A sequence without rules counts none."""
    engine = _engine(target_dir, device)
    before = _rules_counts()
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []))
    got = [engine.verify([first])[0].bonus_token]
    item = VerifyInput("s", False, len(PROMPT), got[-1:], DraftTree(), rules=_rules(STRONG, got))
    item.decode_steps = 6
    got += engine.verify([item])[0].new_tokens
    engine.release(["s"])
    now = _rules_counts()
    seen = {key: now[key] - before[key] for key in now}
    assert seen["forwards"] >= 8  # (the prefill, six steps, one more run ahead)
    assert seen["graph"] + seen["eager"] == seen["forwards"]
    whys = ("no graphs", "logits", "refill", "masks")
    assert sum(seen[why] for why in whys) == seen["eager"]
    if device == "cpu":
        assert seen["eager"] == seen["no graphs"] == seen["forwards"]
    else:
        assert seen["graph"] >= 5 and seen["no graphs"] == 0
    plain = VerifyInput("p", True, 0, PROMPT, DraftTree())
    engine.verify([plain])
    after = _rules_counts()
    assert after["forwards"] > now["forwards"]
    assert after["graph"] + after["eager"] == now["graph"] + now["eager"]
    engine.release(["p"])
    assert engine.num_pages_used == 0


@pytest.mark.parametrize("min_tokens", [3, 6])
def test_steps_run_ahead_hold_stop_tokens_back_until_min_tokens(
    target_dir: Path,  # noqa: F811
    reference: LlamaForCausalLM,  # noqa: F811
    device: str,  # noqa: F811
    min_tokens: int,
) -> None:
    """min_tokens over decode rounds whose steps run ahead: a step's held stop tokens count the
    token the step before drew (on the device, not yet in its rules), so the output is the
    target's greedy one under the rules. The stop token is the one the target picks as the
    output's token min_tokens, the first it may: a step that counted one token short would
    hold it back there."""
    base = Penalties(presence=0.5)
    stop = _greedy(reference, base)[min_tokens]
    penalties = replace(base, min_tokens=min_tokens, stop_ids=(stop,))
    want = _greedy(reference, penalties)
    assert want[min_tokens] == stop
    engine = _engine(target_dir, device)
    out = engine.verify(
        [VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(penalties, []))]
    )
    got = [out[0].bonus_token]
    while len(got) < 10:
        committed = len(PROMPT) + len(got) - 1
        item = VerifyInput(
            "s", False, committed, got[-1:], DraftTree(), rules=_rules(penalties, got)
        )
        got += engine.verify([item])[0].new_tokens
    assert got == want[: len(got)]
    assert engine.num_ahead_used >= 5
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_sampled_rounds_draw_from_the_bent_distribution(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
) -> None:
    """A +100 bias makes its token all but certain; -100 on all but two tokens leaves those
    two: speculative sampled rounds draw from that, drafts or not."""
    sampling = SamplingParams(temperature=1.0, seed=11)
    for penalties, allowed in (
        (Penalties(bias=((13, 100.0),)), {13}),
        (Penalties(bias=tuple((t, -100.0) for t in range(TINY_VOCAB) if t not in (3, 4))), {3, 4}),
    ):
        engine = _engine(target_dir, device)
        first = VerifyInput(
            "s", True, 0, PROMPT, DraftTree(), sampling, rules=_rules(penalties, [])
        )
        got = engine.verify([first])[0].new_tokens
        for _ in range(4):
            tree = DraftTree([13, 3, 4, 9], [-1, 0, 1, 2])
            item = VerifyInput(
                "s", False, len(PROMPT) + len(got) - 1, got[-1:], tree, sampling,
                rules=_rules(penalties, got),
            )  # fmt: skip
            got += engine.verify([item])[0].new_tokens
        assert set(got) <= allowed and len(got) >= 5
        engine.release(["s"])


def test_logprobs_under_rules_are_the_raw_distribution(
    target_dir: Path,  # noqa: F811
    reference: LlamaForCausalLM,  # noqa: F811
    device: str,  # noqa: F811
    truth: list[int],
) -> None:
    """The rules choose the tokens; their log-probabilities are the target's own."""
    engine = _engine(target_dir, device)
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules(STRONG, []), logprobs=2)
    out = engine.verify([first])[0]
    got = [out.bonus_token]
    tree = DraftTree(truth[1:4], [-1, 0, 1])
    item = VerifyInput("s", False, len(PROMPT), got, tree, rules=_rules(STRONG, got), logprobs=2)
    out = engine.verify([item])[0]
    assert got + out.new_tokens == truth[:5]
    _assert_close(
        out.logprobs, _expected(reference, PROMPT + truth[:5], len(PROMPT) + 1, 2), device
    )
    engine.release(["s"])


@pytest.mark.parametrize(
    "rules",
    [
        LogitRules(Penalties(bias=((TINY_VOCAB, 1.0),))),
        LogitRules(Penalties(bias=((3, 101.0),))),
        LogitRules(Penalties(bias=((5, 1.0), (3, 1.0)))),
        LogitRules(Penalties(presence=2.5)),
        LogitRules(Penalties(repetition=0.0)),
        LogitRules(Penalties(frequency=1.0), (5, 3), (1, 2)),
        LogitRules(Penalties(frequency=1.0), (5,), (0,)),
        LogitRules(Penalties(frequency=1.0), (3, 5), (1,)),
        LogitRules(Penalties(repetition=1.5), prompt=(9, 9)),
    ],
    ids=[
        "token-past-vocab",
        "bias-past-100",
        "bias-unsorted",
        "presence-past-2",
        "repetition-0",
        "counts-unsorted",
        "count-0",
        "counts-short",
        "prompt-twice",
    ],
)
def test_malformed_rules_are_refused(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
    rules: LogitRules,
) -> None:
    engine: VerifierEngine = _engine(target_dir, device)
    with pytest.raises(ServiceError) as err:
        engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=rules)])
    assert err.value.code == Code.INVALID_ARGUMENT
    assert engine.num_pages_used == 0 and not engine.seqs


def test_rules_cross_the_wire() -> None:
    rules = _rules(STRONG, [4, 4, 7])
    assert rules is not None and rules.prompt == distinct(PROMPT)
    inputs = [
        VerifyInput("a", False, 3, [4], DraftTree(), rules=rules),
        VerifyInput("b", False, 5, [6], DraftTree()),
        VerifyInput("c", False, 5, [6], DraftTree(), rules=_rules(Penalties(presence=0.5), [1])),
    ]
    back = verify_request_from_proto(verify_request_to_proto(inputs))
    assert [item.rules for item in back] == [item.rules for item in inputs]
    assert back[2].rules is not None and back[2].rules.prompt == ()  # (read by repetition only)
    assert not verify_request_to_proto(inputs[1:2]).rules


def test_rules_after_reads_the_new_tokens() -> None:
    """`after` is the gateway's rules for the longer output (`rules_for`), min_tokens dropped
    once reached alike: a step run ahead is taken only where they are equal. Its arrays (the
    verifier's, made only to fill a sequence's rows on the device) are equal to those of the
    rules for the longer output."""
    rules = _rules(STRONG, [4, 9])
    assert rules is not None
    assert rules.after([9, 2, 9]) == _rules(STRONG, [4, 9, 9, 2, 9])
    assert rules.after([9]).counter[9] == 2 and rules.counter[9] == 1
    rng = random.Random(5)
    for _ in range(200):
        penalties = replace(STRONG, min_tokens=rng.randint(0, 12), stop_ids=(1, 3))
        output = [rng.randrange(30) for _ in range(rng.randint(0, 10))]
        rules = _rules(penalties, output)
        assert rules is not None
        more = [rng.randrange(40) for _ in range(rng.randint(0, 4))]
        want = _rules(penalties, output + more)
        assert rules.after(more) == want
        rules.arrays  # noqa: B018  (made: `after` makes its own, not carried)
        after = rules.after(more)
        assert "arrays" not in after.__dict__
        for got, expected in zip(after.arrays, want.arrays, strict=True):
            assert got.dtype == expected.dtype and np.array_equal(got, expected)


def test_min_p_draws_only_tokens_likely_enough(target_dir: Path, device: str) -> None:  # noqa: F811
    """Sampled rounds at temperature 1 with min_p 0.3: every token drawn (drafts accepted or
    the bonus) is at least 0.3 times as likely as the likeliest at its place (the raw
    log-probabilities, top 1 the likeliest's)."""
    sampling = SamplingParams(temperature=1.0, seed=4)
    rules = LogitRules(Penalties(min_p=0.3))
    engine = _engine(target_dir, device)
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), sampling, logprobs=1, rules=rules)
    outs = [engine.verify([first])[0]]
    got = outs[0].new_tokens
    for _ in range(6):
        tree = DraftTree([got[-1], 3, 4], [-1, 0, 1])
        item = VerifyInput(
            "s", False, len(PROMPT) + len(got) - 1, got[-1:], tree, sampling,
            logprobs=1, rules=rules,
        )  # fmt: skip
        outs.append(engine.verify([item])[0])
        got += outs[-1].new_tokens
    cut = math.log(0.3) - 1e-4
    for out in outs:
        assert out.logprobs is not None
        for own, top in zip(out.logprobs.logprobs, out.logprobs.top_logprobs, strict=True):
            assert own - top[0] >= cut
    engine.release(["s"])
