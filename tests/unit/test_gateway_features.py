"""The target's feature rows the gateway holds for an EAGLE drafter (gateway/features.py): only
the rows the drafter has not had yet, about one round's, not the sequence's history; a drafter
that loses its sequences (restarted) gets every row again from a re-verify of their tokens, and
the output stays the target's own greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gateway.drafting as drafting_module
from gateway.clients import DrafterClient
from gateway.features import FeatureRows
from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.stack import LocalStack
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from tests.eagle_random import save_target_and_drafters
from tests.support import generate_all, generated_ids, make_stack

SPEC = SpecParams(3, 1, 3)
MAX_NEW_TOKENS = 24


def _rows(start: int, n: int, width: int = 3) -> torch.Tensor:
    """n rows for tokens [start, start + n), each filled with its token."""
    return torch.arange(start, start + n)[:, None].repeat(1, width).float()


def _held(features: FeatureRows) -> list[int]:
    rows = features.rows_from(features.start)
    return [] if rows is None else rows[:, 0].long().tolist()


def test_rows_from_spans_chunks_and_one_chunk_is_a_view() -> None:
    features = FeatureRows()
    for start, n in ((0, 5), (5, 2), (7, 3)):
        features.append(_rows(start, n))
    assert features.end == 10
    for index in (0, 4, 5, 6, 9, 10):
        rows = features.rows_from(index)
        assert rows is not None and rows[:, 0].long().tolist() == list(range(index, 10))
    view = features.rows_from(8)
    assert view is not None and view.data_ptr() == features.chunks[-1][1:].data_ptr()


def test_drop_before_lets_whole_chunks_go_and_keeps_the_end() -> None:
    features = FeatureRows()
    for start, n in ((0, 5), (5, 2), (7, 3)):
        features.append(_rows(start, n))
    features.drop_before(6)  # inside the second chunk: it stays whole
    assert (features.start, features.num_rows, features.end) == (5, 5, 10)
    assert _held(features) == list(range(5, 10))
    features.drop_before(10)
    assert (features.start, features.num_rows, features.chunks) == (10, 0, [])
    features.append(_rows(10, 4))
    assert _held(features) == list(range(10, 14))
    with pytest.raises(AssertionError):
        features.rows_from(9)  # let go


def test_keep_truncates_above_and_below_the_rows_held() -> None:
    features = FeatureRows()
    for start, n in ((0, 5), (5, 2), (7, 3)):
        features.append(_rows(start, n))
    features.drop_before(5)
    features.keep(8)  # inside the rows held
    assert (features.start, features.end) == (5, 8) and _held(features) == [5, 6, 7]
    features.keep(3)  # below them: none held, the re-verify brings tokens 3 on
    assert (features.start, features.end, features.chunks) == (3, 3, [])
    features.append(_rows(3, 2))
    assert _held(features) == [3, 4]


def test_a_copy_shares_the_rows_but_not_the_appends() -> None:
    features = FeatureRows()
    features.append(_rows(0, 4))
    other = features.copy()
    other.append(_rows(4, 2))
    assert features.end == 4 and other.end == 6
    assert features.nbytes == 4 * 3 * 4 and other.nbytes == 6 * 3 * 4


# -- through the scheduler (in-process stack, a tiny random target and EAGLE-3 head) ---------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("features"))


def _requests() -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(11)
    return [
        GenerationRequest(
            torch.randint(3, 500, (4 + 3 * i,), generator=gen).tolist(),
            MAX_NEW_TOKENS,
            ignore_eos=True,
        )
        for i in range(3)
    ]


class _Watching:
    """A drafter client that records, at every Draft, each item's (seq_id, begin, start, rows
    sent, tokens sent) and the most rows the gateway holds for any running sequence; at Draft
    number `lose_at` the drafter first forgets every sequence (as a restarted one would)."""

    def __init__(self, inner: DrafterClient, scheduler: Scheduler, lose_at: int = -1) -> None:
        self.inner, self.scheduler, self.lose_at = inner, scheduler, lose_at
        self.calls = 0
        self.items: list[tuple[str, bool, int, int, int]] = []
        self.most_rows_held = 0
        self.lost_at_items = -1  # len(items) when the drafter lost its sequences

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        self.calls += 1
        if self.calls == self.lose_at:
            await self.inner.release([seq.seq_id for seq in self.scheduler.running])
            self.lost_at_items = len(self.items)
        for seq in self.scheduler.running:
            self.most_rows_held = max(self.most_rows_held, seq.features.num_rows)
        for item in inputs:
            rows = item.target_hidden_states
            sent = 0 if rows is None else rows.shape[0]
            self.items.append((item.seq_id, item.begin, item.start, sent, len(item.new_tokens)))
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)


def _target_only(models: dict[str, Path], tokenizer: object) -> list[list[int]]:
    stack = make_stack(models["target"], "ngram", tokenizer, SpecParams(0, 1, 0))
    return [generated_ids(c) for c in generate_all(stack, _requests())]


def _eagle_stack(models: dict[str, Path], tokenizer: object, overlap: str) -> LocalStack:
    return make_stack(
        models["target"],
        "eagle3",
        tokenizer,
        SPEC,
        draft_dir=models["eagle3"],
        dtype=torch.float32,
        overlap=overlap,
    )


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_the_gateway_holds_about_one_rounds_rows(models, smollm2_tokenizer, overlap) -> None:
    """Every row reaches the drafter exactly once, and the gateway holds at most the rows of
    one Verify (the prompt's, or a round's 1 + accepted drafts), however long the sequence."""
    expected = _target_only(models, smollm2_tokenizer)
    stack = _eagle_stack(models, smollm2_tokenizer, overlap)
    watching = _Watching(stack.scheduler.drafter, stack.scheduler)
    stack.scheduler.drafter = watching
    out = generate_all(stack, _requests())
    assert [generated_ids(chunks) for chunks in out] == expected
    longest_prompt = max(len(r.prompt_ids) for r in _requests())
    assert 0 < watching.most_rows_held <= max(longest_prompt, 1 + SPEC.num_draft_tokens)
    sent: dict[str, int] = {}  # rows sent per sequence, each Draft's start where the last ended
    for seq_id, _, start, rows, _ in watching.items:
        if rows:
            assert start == sent.get(seq_id, 0), (seq_id, start, sent)
            sent[seq_id] = start + rows
    assert len(sent) == 3 and min(sent.values()) > longest_prompt


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_a_drafter_that_loses_its_sequences_gets_every_row_again(
    models, smollm2_tokenizer, overlap, monkeypatch
) -> None:
    """The drafter forgets the sequences mid-generation (NOT_FOUND on the next Draft): the
    gateway no longer holds their early rows, so the verifier verifies their tokens again from
    token 0 (a Truncate to 0) and the drafter's next catch-up gets a row for every token. The
    output is the target's, and no KV is left."""
    monkeypatch.setattr(drafting_module, "DRAFTER_RETRY_S", 0.0)
    expected = _target_only(models, smollm2_tokenizer)
    stack = _eagle_stack(models, smollm2_tokenizer, overlap)
    watching = _Watching(stack.scheduler.drafter, stack.scheduler, lose_at=5)
    stack.scheduler.drafter = watching
    out = generate_all(stack, _requests())
    assert [generated_ids(chunks) for chunks in out] == expected
    assert watching.lost_at_items >= 0 and stack.scheduler.num_feature_restarts > 0
    after = watching.items[watching.lost_at_items :]
    caught_up = {
        seq_id for seq_id, _, start, rows, tokens in after if start == 0 and rows == tokens - 1 > 0
    }
    lost = {seq_id for seq_id, *_ in watching.items[: watching.lost_at_items]}
    assert lost and caught_up == lost
