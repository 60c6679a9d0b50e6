"""An EAGLE drafter's target features live in one pool beside the head's KV, a row per KV slot:
appended round by round (one scatter for the batch), truncated by length, kept through the
scratch of every round and a pool too full for a round, and counted when the pool is sized."""

from __future__ import annotations

import pytest
import torch

from drafter.eagle import Eagle3Head, load_eagle3
from drafter.eagle_proposer import Eagle3Proposer
from drafter.engine import DrafterEngine
from specsplit.errors import Code, ServiceError
from specsplit.messages import DraftInput, SpecParams
from specsplit.model.llama import LlamaModel
from specsplit.model.loader import load_model
from tests.eagle_random import save_random_eagle3
from tests.support import save_tiny_llama

SPEC = SpecParams(3, 1, 3)
HeadAndTarget = tuple[Eagle3Head, LlamaModel]


@pytest.fixture(scope="module")
def head_and_target(tmp_path_factory: pytest.TempPathFactory) -> HeadAndTarget:
    root = tmp_path_factory.mktemp("features")
    path = save_tiny_llama(root / "target", seed=0, num_layers=4)
    target, _ = load_model(str(path), dtype=torch.float32, device="cpu")
    head_dir = save_random_eagle3(root / "head", target.config, seed=1)
    return load_eagle3(str(head_dir), None, torch.float32, "cpu", target=target), target


def _engine(
    head_and_target: HeadAndTarget, num_pages: int, page_size: int = 4
) -> tuple[DrafterEngine, Eagle3Proposer]:
    """A drafter engine over the head, and its proposer (the feature pool's owner)."""
    head, _ = head_and_target
    proposer = Eagle3Proposer(head, head.make_kv_cache(num_pages, page_size))
    return DrafterEngine(proposer), proposer


def test_features_appended_and_truncated_round_by_round_are_the_rows_sent(
    head_and_target: HeadAndTarget,
) -> None:
    engine, proposer = _engine(head_and_target, num_pages=64)
    width = proposer.feature_width
    gen = torch.Generator().manual_seed(0)
    sent: dict[str, torch.Tensor] = {}  # per sequence the rows the drafter should hold
    tokens: dict[str, list[int]] = {}
    for round_index in range(40):
        inputs = []
        for seq_id in ("a", "b", "c"):
            begin = seq_id not in tokens
            held = sent.get(seq_id, torch.zeros(0, width))
            if round_index % 13 == 12 and held.shape[0] > 6:  # cut back: a stop point, a fault
                keep = held.shape[0] - 4
                held = held[:keep]
                tokens[seq_id] = tokens[seq_id][: keep + 1]
            start = 0 if begin else held.shape[0]
            new = [int(t) for t in torch.randint(3, 200, (1 + round_index % 3,), generator=gen)]
            known = tokens.get(seq_id, [])[:start]
            rows = torch.randn(len(known) + len(new) - 1 - start, width, generator=gen)
            inputs.append(
                DraftInput(
                    seq_id, begin, start, known[start:] + new, SPEC, target_hidden_states=rows
                )
            )
            tokens[seq_id] = known + new
            sent[seq_id] = torch.cat([held, rows])
        engine.draft(inputs)
        for seq_id, rows in sent.items():
            seq = engine.seqs[seq_id]
            assert torch.equal(proposer.feature_rows(seq, 0, rows.shape[0]), rows), round_index
    engine.release(list(sent))
    engine.check_integrity()
    assert engine.num_pages_used == 0


def test_a_pool_too_full_for_a_round_keeps_the_features_held(
    head_and_target: HeadAndTarget,
) -> None:
    engine, proposer = _engine(head_and_target, num_pages=6)
    width = proposer.feature_width
    rows = torch.randn(9, width, generator=torch.Generator().manual_seed(1))
    engine.draft([DraftInput("a", True, 0, list(range(3, 13)), SPEC, target_hidden_states=rows)])
    seq = engine.seqs["a"]
    before = proposer.feature_rows(seq, 0, 9)
    many = torch.randn(40, width)  # more rows than the pool holds
    with pytest.raises(ServiceError) as err:
        engine.draft(
            [DraftInput("a", False, 9, list(range(20, 61)), SPEC, target_hidden_states=many)]
        )
    assert err.value.code == Code.RESOURCE_EXHAUSTED
    assert torch.equal(proposer.feature_rows(seq, 0, 9), before)
    engine.release(["a"])
    engine.check_integrity()


def test_the_pool_sized_from_memory_counts_the_features(head_and_target: HeadAndTarget) -> None:
    """The bytes a page is sized by (Eagle3Proposer.load divides the free memory by them) are
    what a page allocates: its head K/V and its feature rows, the larger part."""
    head, _ = head_and_target
    num_pages, page_size = 8, 4
    proposer = Eagle3Proposer(head, head.make_kv_cache(num_pages, page_size))
    allocated = proposer.kv.data.nbytes + proposer.features.nbytes
    per_page = Eagle3Proposer.bytes_per_page(head, page_size)
    assert allocated == (num_pages + 1) * per_page  # the scratch page's too
    assert proposer.features.nbytes > proposer.kv.data.nbytes
