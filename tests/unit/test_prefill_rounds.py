"""--prefill-rounds-one-step: a round that starts a sequence (its prefill) asks every sequence in
it for one decode step, so the new sequence's first token streams after that step, not after
the others' further steps (the default); off, the others take their --decode-steps. Through
the in-process stack a request that arrives while another decodes gets the target's own tokens
either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from specsplit import cli, up
from specsplit.messages import SpecParams
from specsplit.tree import DraftTree
from tests.support import (
    check_no_leaks,
    make_stack,
    mixed_requests,
    record_verifies,
    save_tiny_llama,
    second_mid_stream,
    target_only_ids,
)

TARGET_ONLY = SpecParams(0, 1, 0)


@pytest.mark.parametrize(("on", "want"), [(True, [1, 1]), (False, [4, 1])])
def test_a_round_with_a_prefill_asks_the_others_for_one_step_when_on(
    smollm2_tokenizer: object, on: bool, want: list[int]
) -> None:
    scheduler = Scheduler(
        None, None, smollm2_tokenizer, (), TARGET_ONLY,  # type: ignore[arg-type]
        decode_steps=4, prefill_rounds_one_step=on,
    )  # fmt: skip
    running = scheduler._new_sequence(GenerationRequest([5, 6, 7], 32))
    running.verifier_begun = True  # decoding: its prompt is in the verifier's KV
    new = scheduler._new_sequence(GenerationRequest([8, 9], 32))
    inputs = scheduler._verify_inputs([running, new], [DraftTree(), DraftTree()])
    assert [item.decode_steps for item in inputs] == want
    assert [item.begin for item in inputs] == [False, True]
    # while requests wait for a place (a full batch) the round keeps its steps: there nearly
    # every round starts a request, and one-step rounds would slow the batch that frees places
    waiting = scheduler._new_sequence(GenerationRequest([3, 4], 32))
    scheduler.waiting.append(waiting)
    steps = [i.decode_steps for i in scheduler._verify_inputs([running, new], [DraftTree()] * 2)]
    assert steps == [4, 1]
    waiting.cancelled = True  # a cancelled one does not wait
    steps = [i.decode_steps for i in scheduler._verify_inputs([running, new], [DraftTree()] * 2)]
    assert steps == want
    # a round with no prefill keeps its steps
    new.verifier_begun = True
    steps = [i.decode_steps for i in scheduler._verify_inputs([running, new], [DraftTree()] * 2)]
    assert steps == [4, 4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("prefill_rounds") / "target", seed=37)


@pytest.mark.parametrize("on", [True, False], ids=["one-step", "full-rounds"])
def test_a_request_arriving_mid_stream_gets_the_targets_tokens(
    target_dir: Path, smollm2_tokenizer: object, on: bool
) -> None:
    """Request B is sent once A has streamed a chunk (A decodes rounds of 4 steps): the round
    that prefills B asks A for one step when on, four when off; both streams are the target
    alone's, and no KV is left."""
    first, second = mixed_requests(2, seed=11, max_new_tokens=40, spec=TARGET_ONLY)
    expected = target_only_ids(target_dir, smollm2_tokenizer, [first, second])
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, TARGET_ONLY, decode_steps=4)
    scheduler = stack.scheduler
    scheduler.prefill_rounds_one_step = on
    rounds = record_verifies(scheduler)
    assert second_mid_stream(scheduler, first, second) == expected
    check_no_leaks(stack)
    (admission,) = [r for r in rounds if any(i.begin for i in r) and not all(i.begin for i in r)]
    a_item = next(i for i in admission if not i.begin)
    assert a_item.decode_steps == (1 if on else 4)


@pytest.mark.parametrize(
    ("argv", "on"),
    [([], True), (["--no-prefill-rounds-one-step"], False), (["--prefill-rounds-one-step"], True)],
)
def test_up_passes_the_switch_to_the_gateway(argv: list[str], on: bool) -> None:
    gateway = up.child_commands(cli.parse_args(["up", *argv]))["gateway"]
    assert cli.parse_args(gateway[3:]).prefill_rounds_one_step is on
