"""A drafter refusal for one sequence never turns drafting off for the others: the drafter
refuses a draft shape per sequence (an empty tree, its tokens still taken), and the gateway,
when the drafter refuses a whole round, drafts the sequences one by one and leaves only the
refused one without drafts. Outputs stay the target's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafter.engine import DrafterEngine, TreeLimits
from drafter.ngram import NgramProposer
from gateway.request import GenerationRequest
from inprocess.stack import LocalStack
from specsplit.errors import Code, ServiceError
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from tests.support import check_no_leaks, generated_ids, make_stack, save_tiny_llama

REPEATING = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # prompt lookup drafts 3, 4, 1, ... after it


def _input(seq_id: str, spec: SpecParams, begin: bool = True, start: int = 0) -> DraftInput:
    tokens = REPEATING if begin else REPEATING[start:]
    return DraftInput(seq_id, begin, start, list(tokens), spec)


@pytest.mark.parametrize(
    "bad",
    [
        SpecParams(1000, 1000, 1000),  # the request: over the drafter's limits
        SpecParams(3, 1, 2),  # inconsistent: a chain of 3 steps has 3 nodes
        SpecParams(2, 2, 7),  # more nodes than 2 steps of top-2 can make
        SpecParams(2, 0, 2),  # topk 0
    ],
)
def test_drafter_refuses_a_bad_shape_for_that_sequence_only(bad: SpecParams) -> None:
    engine = DrafterEngine(NgramProposer(vocab_size=100, max_context=512), TreeLimits())
    outputs = engine.draft([_input("bad", bad), _input("good", SpecParams(2, 1, 2))])
    assert [out.seq_id for out in outputs] == ["bad", "good"]
    assert len(outputs[0].tree) == 0  # no drafts for the bad one
    assert outputs[1].tree.tokens == [3, 4]  # the other one drafts as usual
    assert engine.seqs["bad"].tokens == REPEATING  # its tokens were taken all the same
    # next round, a shape within the limits drafts again from where it is
    again = engine.draft([_input("bad", SpecParams(2, 1, 2), begin=False, start=9)])
    assert again[0].tree.tokens == [3, 4]
    engine.release(["bad", "good"])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("refusals") / "target", seed=11)


class _PickyDrafter:
    """The stack's own drafter, refusing (RESOURCE_EXHAUSTED) every round that holds a sequence
    with the `refused` shape, as a drafter out of memory for that one would."""

    def __init__(self, stack: LocalStack, refused: SpecParams) -> None:
        self.inner = stack.scheduler.drafter
        self.refused = refused
        self.rounds: list[int] = []
        stack.scheduler.drafter = self

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        self.rounds.append(len(inputs))
        if any(item.spec == self.refused for item in inputs):
            raise ServiceError(Code.RESOURCE_EXHAUSTED, "drafter KV full")
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)


def test_one_refused_sequence_does_not_stop_drafting_for_the_others(
    target_dir, smollm2_tokenizer
) -> None:
    refused, good = SpecParams(2, 1, 2), SpecParams(3, 1, 3)
    requests = [
        GenerationRequest([5, 6, 7, 8], 16, spec=refused, ignore_eos=True),
        GenerationRequest([9, 10, 11], 16, spec=good, ignore_eos=True),
    ]
    target_only = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    expected = [generated_ids(c) for c in target_only.generate_all(requests)]
    # the draft model is the target itself: every draft it makes is accepted
    stack = make_stack(target_dir, "model", smollm2_tokenizer, good)
    drafter = _PickyDrafter(stack, refused)
    results = stack.generate_all(requests)
    assert [generated_ids(c) for c in results] == expected
    stats = [chunks[-1].stats for chunks in results]
    assert stats[0] is not None and stats[0].num_accepted_drafts == 0
    # every round of the good one accepted its 3 drafts (16 = 4 rounds of 3 + 1)
    assert stats[1] is not None and stats[1].num_accepted_drafts == 12, stats[1]
    assert stats[1].rounds == 4
    assert drafter.rounds[:3] == [2, 1, 1]  # refused together, then one by one: never again
    assert all(n == 1 for n in drafter.rounds[3:])
    check_no_leaks(stack)
