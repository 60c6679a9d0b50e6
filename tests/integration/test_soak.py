"""The load and soak test (bench/soak.py) in its CI form: 64 concurrent streams with random
cancellations and bad requests, and the drafter "killed" once half of them are under way,
through the gateway's real gRPC servicer on loopback over the in-process engines (a tiny random
Llama, draft == target). The drafter's death is simulated as a process's: every call fails
UNAVAILABLE, its KV is gone, and it comes back empty. Afterwards no KV page is used, every
completed stream equals the target alone, and the gateway still serves. The mixed form gives
the prompts logit rules, guides and seeded sampling (bench/soak.py `FLAVOURS`): every greedy one
equal to the target alone under the same options, no rules' slot or sequence left anywhere."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.soak import FLAVOURS, flavoured, make_plan, references, soak
from gateway.request import ModelInfo
from gateway.servicer import GatewayServicer
from inprocess.clients import LocalDrafterClient
from specsplit.errors import Code, ServiceError
from specsplit.messages import DraftInput, DraftOutput, SpecParams
from specsplit.v1 import gateway_pb2
from tests.support import TINY_VOCAB, check_no_leaks, gateway_stub, make_stack, save_tiny_llama

NUM_STREAMS = 64
MAX_NEW_TOKENS = 48
DRAFTER_DOWN_S = 0.5
SPREAD_S = 2.5  # the streams' starts


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("soak") / "target", seed=17)


class _KillableDrafter:
    """The in-process drafter, killed as a process is: while dead every call is UNAVAILABLE,
    its sequences' KV is gone (freed with the process), and it comes back empty."""

    def __init__(self, inner: LocalDrafterClient) -> None:
        self.inner = inner
        self.dead = False
        self.kills = 0
        self.drafts_after_restart = 0

    async def kill(self, down_s: float) -> None:
        self.dead = True
        self.kills += 1
        engine = self.inner.drafter
        await self.inner._call(lambda _: engine.release(list(engine.seqs)), [])  # its thread
        await asyncio.sleep(down_s)
        self.dead = False

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        if self.dead:
            raise ServiceError(Code.UNAVAILABLE, "drafter: UNAVAILABLE: connection refused")
        outputs = await self.inner.draft(inputs)
        self.drafts_after_restart += self.kills > 0
        return outputs

    async def release(self, seq_ids: list[str]) -> None:
        if self.dead:
            raise ServiceError(Code.UNAVAILABLE, "drafter: UNAVAILABLE: connection refused")
        await self.inner.release(seq_ids)


def _prompts() -> list[gateway_pb2.GenerateRequest]:
    return [
        gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[(31 * i + 7 * j) % 500 + 3 for j in range(4 + i)]),
            max_new_tokens=MAX_NEW_TOKENS,
        )
        for i in range(8)
    ]


@pytest.mark.parametrize("mix", [False, True], ids=["plain", "mixed"])
def test_soak_64_streams_cancellations_bad_requests_and_a_drafter_kill(
    target_dir: Path, smollm2_tokenizer, one_torch_thread: None, mix: bool
) -> None:
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SpecParams(3, 1, 3), num_pages=1024)
    assert isinstance(stack.scheduler.drafter, LocalDrafterClient)
    drafter = _KillableDrafter(stack.scheduler.drafter)
    stack.scheduler.drafter = drafter
    model = ModelInfo(smollm2_tokenizer, TINY_VOCAB, 512, eos_token_ids=(2,))
    servicer = GatewayServicer(model, stack.scheduler)
    prompts, flavours = _prompts(), None
    if mix:
        prompts, flavours = flavoured(prompts)
    seed = 4 if mix else 3  # (seed 4's plan runs every prompt to its end at least once)
    plan = make_plan(NUM_STREAMS, len(prompts), MAX_NEW_TOKENS, seed=seed, spread_s=SPREAD_S)

    async def pages_used() -> dict[str, int]:
        return {
            "drafter": stack.drafter.num_pages_used,
            "verifier": stack.verifier.num_pages_used,
        }

    async def main() -> None:
        async with gateway_stub(stack, servicer) as stub:
            expected = await references(stub, prompts)
            report = await soak(
                stub,
                prompts,
                expected,
                plan,
                kill_drafter=lambda: drafter.kill(DRAFTER_DOWN_S),
                pages_used=pages_used,
                timeout_s=60,
                settle_s=5,
                flavours=flavours,
            )
        print(report.table())
        assert report.failures() == []
        kinds = [p.kind for p in plan]
        assert report.completed == kinds.count("complete") + report.ended_before_cancel
        assert report.cancelled + report.ended_before_cancel == kinds.count("cancel")
        assert sum(report.refused.values()) == kinds.count("bad") > 0
        assert report.cancelled > 0 and drafter.kills == 1
        assert drafter.drafts_after_restart > 0  # the gateway drafts with it again
        assert report.drafter_killed_after_s is not None
        if mix:  # (every flavour ran to its end at least once)
            assert set(report.by_flavour) == set(FLAVOURS), report.by_flavour

    asyncio.run(main())
    check_no_leaks(stack)
