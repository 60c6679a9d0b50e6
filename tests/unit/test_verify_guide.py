"""A guide's masks (LogitRules.allowed, guided decoding) on the verifier: every masked row is the
one-row reference's bit for bit (every token the row's mask leaves out -inf, after the
penalties, before min_p), rows without a mask untouched; speculative rounds commit exactly the
target's greedy tokens under the masks and sampled ones draw only allowed tokens; a guided round
takes one decode step (its masks are the gateway's); the wire carries the masks; malformed ones
are refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from specsplit.convert import verify_request_from_proto, verify_request_to_proto
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import NO_MASK, Allowed, Penalties, mask_words
from specsplit.messages import VerifyInput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.rules_reference import rules_for
from tests.support import TINY_VOCAB
from tests.unit.test_verify_logprobs import (  # noqa: F401  (fixtures)
    PROMPT,
    _engine,
    device,
    reference,
    target_dir,
)
from tests.unit.test_verify_rules import reference_bend
from verifier.round_rules import _masks, bend_by_rules

NUM_TOKENS = 12
SAMPLED = SamplingParams(temperature=0.8, seed=3)


def _words(allowed: np.ndarray) -> bytes:
    """A bool [V] as a mask's words."""
    bits = np.zeros(mask_words(len(allowed)) * 32, dtype=bool)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").tobytes()


def _allowed_at(k: int, vocab: int = TINY_VOCAB) -> np.ndarray:
    """The tokens allowed as the output's k-th token: a pattern that moves with k."""
    t = np.arange(vocab)
    return (t * 7 + 3 * k) % 5 != 0


def _guided(depths: list[int], k: int, vocab: int = TINY_VOCAB) -> Allowed:
    """Masks for rows at these depths when the output holds k tokens (row j: _allowed_at(k + d))."""
    order = sorted(set(depths))
    return Allowed(
        b"".join(_words(_allowed_at(k + d, vocab)) for d in order),
        tuple(order.index(d) for d in depths),
    )


def _rules_for_tree(tree: DraftTree, k: int, penalties: Penalties | None = None):
    return rules_for(penalties, (), Counter(), _guided([0, *tree.depths()], k))


@pytest.mark.parametrize(
    "penalties", [None, Penalties(presence=1.0, min_p=0.2)], ids=["alone", "with-penalties"]
)
def test_masked_rows_are_the_reference_rows(
    penalties: Penalties | None,
    device: str,  # noqa: F811
    kernel: bool | None = None,  # (tests/unit/test_bend_rules_kernel.py: the kernels)
) -> None:
    torch.manual_seed(5)
    vocab = 70
    trees = [
        DraftTree([4, 6, 4, 9], [-1, -1, 0, 2]),
        DraftTree([1], [-1]),
        DraftTree([3, 5], [-1, 0]),
    ]
    masks = [
        Allowed(
            _words(_allowed_at(1, vocab)) + _words(_allowed_at(2, vocab)), (0, 1, NO_MASK, 0, 1)
        ),
        None,
        Allowed(_words(np.arange(vocab) < 3), (0, 0, 0)),
    ]
    inputs = []
    for i, (tree, allowed) in enumerate(zip(trees, masks, strict=True)):
        rules = None if allowed is None else rules_for(penalties, (), Counter([4, 8]), allowed)
        inputs.append(VerifyInput(f"s{i}", False, 10, [4], tree, SAMPLED, rules=rules))
    starts = np.cumsum([0] + [len(t) + 1 for t in trees]).tolist()
    rows = [range(s, s + len(t) + 1) for s, t in zip(starts[:-1], trees, strict=True)]
    logits = torch.randn(starts[-1], vocab) * 4
    want = reference_bend(inputs, rows, logits)
    got = logits.clone().to(device)
    assert bend_by_rules(inputs, got, rows, kernel=kernel)
    got = got.cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[rows[1].start : rows[1].stop], logits[rows[1].start : rows[1].stop])
    if penalties is None:  # (min_p cuts further) an unmasked row of a guided sequence: as it was
        assert torch.equal(got[2], logits[2])
        row = got[rows[2].start]
        assert torch.isinf(row[3:]).all() and torch.isfinite(row[:3]).all()


def _greedy_under_masks(reference: LlamaForCausalLM) -> list[int]:  # noqa: F811
    out: list[int] = []
    for k in range(NUM_TOKENS + 3):
        with torch.no_grad():
            row = reference(torch.tensor([PROMPT + out])).logits[0, -1].float()
        row[torch.from_numpy(~_allowed_at(k))] = -torch.inf
        out.append(int(row.argmax()))
    return out


def test_guided_rounds_commit_the_targets_greedy_tokens_under_the_masks(
    target_dir: Path,  # noqa: F811
    reference: LlamaForCausalLM,  # noqa: F811
    device: str,  # noqa: F811
) -> None:
    """Trees of the right tokens, a token the mask leaves out and decoys, each row's mask the
    one for its place in the output: the target's greedy tokens under the masks."""
    truth = _greedy_under_masks(reference)
    engine = _engine(target_dir, device)
    first = VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=_rules_for_tree(DraftTree(), 0))
    got = [engine.verify([first])[0].bonus_token]
    refused = 0
    while len(got) < NUM_TOKENS:
        k = len(got)
        banned = int(np.flatnonzero(~_allowed_at(k + 1))[0])  # the mask leaves it out
        tree = DraftTree([banned, truth[k], truth[k + 1], truth[k + 2]], [-1, -1, 1, 2])
        item = VerifyInput(
            "s", False, len(PROMPT) + k - 1, got[-1:], tree, rules=_rules_for_tree(tree, k)
        )
        out = engine.verify([item])[0]
        refused += out.new_tokens[0] != banned
        got += out.new_tokens
    assert got[:NUM_TOKENS] == truth[:NUM_TOKENS]
    assert all(_allowed_at(k)[t] for k, t in enumerate(got))
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_sampled_guided_rounds_draw_only_allowed_tokens(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
) -> None:
    engine = _engine(target_dir, device)
    rng = np.random.default_rng(2)
    first = VerifyInput(
        "s", True, 0, PROMPT, DraftTree(), SAMPLED, rules=_rules_for_tree(DraftTree(), 0)
    )
    got = [engine.verify([first])[0].bonus_token]
    while len(got) < 3 * NUM_TOKENS:
        k = len(got)
        tree = DraftTree([int(t) for t in rng.integers(0, TINY_VOCAB, 3)], [-1, 0, 1])
        item = VerifyInput(
            "s", False, len(PROMPT) + k - 1, got[-1:], tree, SAMPLED,
            rules=_rules_for_tree(tree, k),
        )  # fmt: skip
        got += engine.verify([item])[0].new_tokens
    assert all(_allowed_at(k)[t] for k, t in enumerate(got))
    engine.release(["s"])


def _refused(engine, item: VerifyInput) -> None:
    with pytest.raises(ServiceError) as err:
        engine.verify([item])
    assert err.value.code == Code.INVALID_ARGUMENT
    assert engine.num_pages_used == 0 and not engine.seqs


@pytest.mark.parametrize(
    "allowed",
    [
        Allowed(b"\xff" * 5, (0,)),  # not whole masks
        Allowed(_words(_allowed_at(0)), (0, 0)),  # rows for a tree of one node
        Allowed(_words(_allowed_at(0)), (1,)),  # no mask 1
        Allowed(_words(_allowed_at(0)), (-2,)),
        Allowed(_words(np.zeros(TINY_VOCAB, dtype=bool)), (0,)),  # allows nothing
    ],
    ids=["partial-mask", "rows-count", "mask-missing", "below-no-mask", "empty"],
)
def test_malformed_masks_are_refused(target_dir: Path, device: str, allowed: Allowed) -> None:  # noqa: F811
    engine = _engine(target_dir, device)
    _refused(
        engine,
        VerifyInput(
            "s", True, 0, PROMPT, DraftTree(), rules=rules_for(None, (), Counter(), allowed)
        ),
    )


def test_a_mask_allowing_tokens_past_the_vocabulary_is_refused() -> None:
    vocab = 70  # (3 words: 26 bits of the last past it)
    good = _words(np.arange(vocab) % 2 == 0)
    Allowed(good, (0,)).validate(vocab, 1)
    with pytest.raises(ValueError, match="past the vocab"):
        Allowed(b"\xff" * (4 * mask_words(vocab)), (0,)).validate(vocab, 1)


def test_a_guided_round_takes_one_decode_step(target_dir: Path, device: str) -> None:  # noqa: F811
    engine = _engine(target_dir, device)
    rules = _rules_for_tree(DraftTree(), 0)
    assert rules is not None and not rules.carried
    first = engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree(), rules=rules)])[0]
    item = VerifyInput("s", False, len(PROMPT), [first.bonus_token], DraftTree(), rules=rules)
    item.decode_steps = 3
    with pytest.raises(ServiceError) as err:
        engine.verify([item])
    assert err.value.code == Code.INVALID_ARGUMENT and "guide" in err.value.message
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_masks_cross_the_wire() -> None:
    tree = DraftTree([4, 6], [-1, 0])
    inputs = [
        VerifyInput("a", False, 3, [4], tree, rules=_rules_for_tree(tree, 2)),
        VerifyInput("b", False, 5, [6], DraftTree()),
        VerifyInput(
            "c",
            False,
            5,
            [6],
            DraftTree(),
            rules=rules_for(Penalties(presence=0.5), (), Counter([1])),
        ),
        VerifyInput(
            "d",
            False,
            5,
            [6],
            tree,
            rules=rules_for(Penalties(presence=0.5), (), Counter([1]), _guided([0, 1, 2], 0)),
        ),
    ]
    back = verify_request_from_proto(verify_request_to_proto(inputs))
    assert [item.rules for item in back] == [item.rules for item in inputs]
    assert back[0].rules is not None and back[0].rules.allowed is not None
    assert back[2].rules is not None and back[2].rules.allowed is None


def test_a_rounds_equal_masks_travel_once() -> None:
    """Rows of one guide in one state share a mask, across sequences too: the round's table holds
    each distinct mask once."""
    tree = DraftTree([4, 6], [-1, 0])
    same = _rules_for_tree(tree, 2)  # masks for depths 0, 1, 2: three
    other = rules_for(None, (), Counter(), _guided([0, 0, 0], 3))  # k 3: depth 0 is k 2's depth 1
    inputs = [
        VerifyInput("a", False, 3, [4], tree, rules=same),
        VerifyInput("b", False, 3, [4], tree, rules=same),
        VerifyInput("c", False, 3, [4], tree, rules=other),
        VerifyInput(
            "d", False, 3, [4], tree, rules=rules_for(Penalties(presence=0.5), (), Counter([1]))
        ),
    ]
    rows = [range(3 * i, 3 * i + 3) for i in range(4)]
    mask_of, masks = _masks(list(zip(inputs, rows, strict=True)), TINY_VOCAB)
    assert len(masks) == 3
    assert mask_of == [0, 1, 2, 0, 1, 2, 1, 1, 1, NO_MASK, NO_MASK, NO_MASK]
