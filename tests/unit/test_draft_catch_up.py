"""Catch-up padding (the drafter's CUDA-graph-ready steps): a round's new tokens per sequence
are padded to one length in `catch_up_lens` by recomputing cached entries; the drafts, the
committed lengths and the KV pages are those of the unpadded steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.tree_draft import CATCH_UP_LENS
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from tests.support import TINY_VOCAB, save_tiny_llama


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("catch_up") / "draft", seed=33)


def _engine(draft_dir: Path, catch_up_lens: tuple[int, ...], page_size: int) -> DrafterEngine:
    model, config = load_model(str(draft_dir), dtype=torch.float64, device="cpu")
    kv = make_kv_cache(config, 256, page_size, torch.float64, "cpu")
    proposer = ModelProposer(model, kv, config.vocab_size, config.max_position_embeddings)
    proposer.catch_up_lens = catch_up_lens  # padding without a GPU: the graphs' shapes, eager
    return DrafterEngine(proposer)


def _rounds(engine: DrafterEngine, spec: SpecParams) -> list[list[DraftOutput]]:
    """Three sequences, five rounds; each round brings 1..4 new tokens per sequence (accepted
    drafts + bonus), different per sequence: ragged catch-ups."""
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (9, 14, 11)]
    ids = ["a", "b", "c"]
    first = [DraftInput(i, True, 0, t, spec) for i, t in zip(ids, tokens, strict=True)]
    outs = [engine.draft(first)]
    for r in range(5):
        inputs = []
        for b, (seq_id, toks) in enumerate(zip(ids, tokens, strict=True)):
            start = len(toks)
            toks += torch.randint(3, TINY_VOCAB, (1 + (r + b) % 4,), generator=gen).tolist()
            inputs.append(DraftInput(seq_id, False, start, toks[start:], spec))
        outs.append(engine.draft(inputs))
        engine.check_integrity()
    return outs


def test_catch_up_starts_pad_every_step_to_one_captured_length(draft_dir: Path) -> None:
    proposer = _engine(draft_dir, CATCH_UP_LENS, 4).proposer
    assert isinstance(proposer, ModelProposer)
    # new lengths 1, 3, 2 -> 4 each (the next captured length), ending where they did
    assert proposer._catch_up_starts([9, 11, 18], [10, 14, 20]) == [6, 10, 16]
    # a sequence shorter than the length: no padding for anyone (ragged, eager)
    assert proposer._catch_up_starts([0, 11], [3, 14]) == [0, 11]
    # longer than the largest captured length: no padding
    assert proposer._catch_up_starts([0, 30], [9, 40]) == [0, 30]
    # no captured lengths: as they are
    proposer.catch_up_lens = ()
    assert proposer._catch_up_starts([9, 11], [10, 14]) == [9, 11]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("spec", [SpecParams(3, 1, 3), SpecParams(3, 2, 5)])
def test_padded_catch_up_drafts_the_same_trees(
    draft_dir: Path, page_size: int, spec: SpecParams
) -> None:
    plain = _engine(draft_dir, (), page_size)
    padded = _engine(draft_dir, CATCH_UP_LENS, page_size)
    for want, got in zip(_rounds(plain, spec), _rounds(padded, spec), strict=True):
        assert [o.tree.tokens for o in got] == [o.tree.tokens for o in want]
        assert [o.tree.parents for o in got] == [o.tree.parents for o in want]
        assert [o.kv_committed_len for o in got] == [o.kv_committed_len for o in want]
    assert padded.num_pages_used == plain.num_pages_used
    for engine in (plain, padded):
        engine.release(["a", "b", "c"])
        assert engine.num_pages_used == 0
