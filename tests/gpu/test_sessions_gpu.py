"""On a CUDA device, float32, with the verifier's and the drafter's CUDA graphs: session turns
equal fresh requests carrying the whole conversation (the CPU suite's four turns: by length,
EOS, a stop string, length), KV accounted at every boundary, nothing left after close. In
bfloat16 a session's KV differs from one prefill by rounding (README, Sessions), so this runs in
float32. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from drafter.tree_draft import CATCH_UP_LENS
from inprocess.stack import build_local_stack
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from tests.eagle_random import save_target_and_drafters
from tests.support import Conversation, check_no_leaks
from tests.unit.test_sessions import _four_turns

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("sessions_gpu"))


@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_session_turns_equal_fresh_requests_on_the_gpu(models, smollm2_tokenizer, drafter) -> None:
    spec = SpecParams(3, 1, 3)
    stack = build_local_stack(
        str(models["target"]),
        drafter,  # "model" without a path: the target drafts for itself, every draft accepted
        smollm2_tokenizer,
        spec,
        draft_path=str(models["eagle3"]) if drafter == "eagle3" else None,
        dtype=torch.float32,
        device="cuda",
        check_integrity=True,
        graph_query_lens=(1, 4),
        draft_graph_lens=CATCH_UP_LENS,
    )
    stack.scheduler.eos_token_ids = ()

    async def run() -> None:
        await stack.scheduler.start()
        try:
            conv = Conversation(stack, SamplingParams())
            await _four_turns(conv)
            await stack.scheduler.sessions.close(conv.session.session_id)
        finally:
            await stack.scheduler.stop()

    asyncio.run(run())
    check_no_leaks(stack)
