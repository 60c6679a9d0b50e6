"""Drafter engine: tree shapes, prefix reuse/truncation, n-gram proposals, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.ngram import NgramProposer
from drafter.types import DraftSeq
from specsplit.errors import Code, ServiceError
from specsplit.messages import DraftInput, SpecParams
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from tests.support import TINY_VOCAB, save_tiny_llama

TOKENS = [5, 17, 99, 3, 250, 41, 8, 77, 12]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("drafter") / "draft", seed=21)


def _engine(draft_dir: Path, page_size: int = 4) -> DrafterEngine:
    model, config = load_model(str(draft_dir), dtype=torch.float64, device="cpu")
    kv = make_kv_cache(config, 128, page_size, torch.float64, "cpu")
    return DrafterEngine(
        ModelProposer(model, kv, config.vocab_size, config.max_position_embeddings)
    )


def _draft(
    engine: DrafterEngine, seq_id: str, begin: bool, start: int, new: list[int], spec: SpecParams
):
    return engine.draft([DraftInput(seq_id, begin, start, new, spec)])[0]


@pytest.mark.parametrize(
    ("topk", "num_steps", "num_draft_tokens"), [(1, 4, 4), (2, 3, 6), (4, 3, 10), (3, 1, 3)]
)
def test_tree_shape(draft_dir: Path, topk: int, num_steps: int, num_draft_tokens: int) -> None:
    engine = _engine(draft_dir)
    spec = SpecParams(num_steps, topk, num_draft_tokens)
    out = _draft(engine, "s", True, 0, TOKENS, spec)
    tree = out.tree
    tree.validate(TINY_VOCAB)  # parents earlier, siblings distinct
    assert len(tree) == num_draft_tokens
    assert max(tree.depths()) <= num_steps  # best-scored nodes need not reach the last step
    assert tree.depths().count(1) >= 1
    assert max(tree.num_children()) <= topk
    assert out.kv_committed_len == len(TOKENS)
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_chain_is_the_greedy_draft_continuation(draft_dir: Path) -> None:
    engine = _engine(draft_dir)
    chain = _draft(engine, "s", True, 0, TOKENS, SpecParams(3, 1, 3)).tree
    assert chain.parents == [-1, 0, 1]
    # feeding the chain back token by token reproduces it (same model, greedy)
    tokens = list(TOKENS)
    for expected in chain.tokens:
        step = _draft(engine, "g", True, 0, tokens, SpecParams(1, 1, 1))
        assert step.tree.tokens == [expected]
        engine.release(["g"])
        tokens.append(expected)
    engine.release(["s"])


def test_truncation_keeps_the_matching_prefix(draft_dir: Path) -> None:
    engine = _engine(draft_dir, page_size=1)
    spec = SpecParams(3, 2, 5)
    _draft(engine, "s", True, 0, TOKENS, spec)
    # the gateway's tokens diverge after position 5: the drafter keeps 5 and recomputes the rest
    changed = TOKENS[:5] + [1, 2, 3]
    after = _draft(engine, "s", False, 5, changed[5:], spec)
    fresh = _draft(engine, "f", True, 0, changed, spec)
    assert after.tree.tokens == fresh.tree.tokens and after.tree.parents == fresh.tree.parents
    assert after.kv_committed_len == len(changed)
    assert engine.seqs["s"].tokens == changed
    engine.release(["s", "f"])
    assert engine.num_pages_used == 0
    engine.check_integrity()


def test_ngram_chain_copies_what_followed_the_last_match() -> None:
    engine = DrafterEngine(NgramProposer())
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    out = _draft(engine, "s", True, 0, tokens, SpecParams(3, 1, 3))
    assert out.tree.tokens == [4, 5, 9] and out.tree.parents == [-1, 0, 1]


def test_ngram_tree_merges_distinct_matches() -> None:
    seq = DraftSeq("s", [7, 1, 2, 7, 3, 4, 7])
    proposer = NgramProposer(max_ngram=1)
    seq.state = proposer.new_state(seq)
    assert proposer.continuations(seq, 2, 3) == [[3, 4], [1, 2]]
    engine = DrafterEngine(proposer)
    out = _draft(engine, "s", True, 0, seq.tokens, SpecParams(2, 2, 4))
    assert out.tree.tokens == [3, 4, 1, 2] and out.tree.parents == [-1, 0, -1, 2]


def test_ngram_no_match_gives_empty_tree() -> None:
    engine = DrafterEngine(NgramProposer())
    out = _draft(engine, "s", True, 0, [1, 2, 3], SpecParams(3, 1, 3))
    assert len(out.tree) == 0


@pytest.mark.parametrize(
    ("case", "item", "code", "names"),
    [
        (
            "unknown_seq_id",
            DraftInput("nope", False, 0, [1], SpecParams(1, 1, 1)),
            Code.NOT_FOUND,
            "nope",
        ),
        (
            "start_past_known_tokens",
            DraftInput("live", False, 99, [1], SpecParams(1, 1, 1)),
            Code.INVALID_ARGUMENT,
            "start",
        ),
        (
            "empty_new_tokens",
            DraftInput("live", False, 2, [], SpecParams(1, 1, 1)),
            Code.INVALID_ARGUMENT,
            "new_tokens",
        ),
        # a bad draft shape is refused for its sequence only: tests/unit/test_drafter_refusals.py
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_draft_is_refused_and_changes_nothing(
    draft_dir: Path, case: str, item: DraftInput, code: Code, names: str
) -> None:
    engine = _engine(draft_dir)
    _draft(engine, "live", True, 0, TOKENS, SpecParams(2, 1, 2))
    pages = engine.num_pages_used
    with pytest.raises(ServiceError) as err:
        engine.draft([DraftInput("new", True, 0, [1, 2], SpecParams(1, 1, 1)), item])
    assert err.value.code == code and names in err.value.message
    assert set(engine.seqs) == {"live"} and engine.seqs["live"].tokens == TOKENS
    assert engine.num_pages_used == pages
    engine.release(["live"])
    assert engine.num_pages_used == 0


def test_load_sizes_the_graphs_for_the_batch_asked(draft_dir: Path) -> None:
    """--graph-max-batch reaches the engine: its CUDA graphs (on a GPU) cover batches up to it."""
    engine = DrafterEngine.load("model", str(draft_dir), num_pages=16, max_batch_size=96)
    assert engine.max_batch_size == 96
    assert DrafterEngine.load("model", str(draft_dir), num_pages=16).max_batch_size == 64
