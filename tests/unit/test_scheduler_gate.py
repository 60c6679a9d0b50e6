"""The speculation gate in the scheduler (gateway/gate.py): with drafts that do not pay (a slow
drafter whose drafts the target rejects) the gateway decodes plain rounds, probing speculation
now and then; with drafts that pay it keeps speculating. Either way the output is the target's
own greedy output, in serial rounds and pipelined groups, with a draft model and an EAGLE-3
head (whose target features keep flowing through plain rounds), and no KV is left."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.clients import DrafterClient
from gateway.gate import OverlapGate, SpeculationGate
from gateway.request import GenerationRequest
from gateway.round_gates import NEW_SHARE
from gateway.sequence import Sequence
from inprocess.stack import LocalStack
from specsplit.errors import Code, ServiceError
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    SpecParams,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)
from specsplit.metrics import GATE_ROUND_KINDS
from specsplit.sampling import SamplingParams
from tests.eagle_random import save_target_and_drafters
from tests.support import (
    Conversation,
    PassThroughVerifier,
    generate_all,
    generated_ids,
    make_stack,
)

MAX_NEW_TOKENS = 24
BATCH = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_target_and_drafters(tmp_path_factory.mktemp("gate"))


def _requests(seed: int, max_new_tokens: int = MAX_NEW_TOKENS) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [
        GenerationRequest(
            torch.randint(3, 500, (4 + 3 * i,), generator=gen).tolist(),
            max_new_tokens,
            ignore_eos=True,
        )
        for i in range(BATCH)
    ]


class _SlowDrafter:
    """A drafter client that takes `delay` seconds more per Draft, counting them."""

    def __init__(self, inner: DrafterClient, delay: float) -> None:
        self.inner, self.delay, self.calls = inner, delay, 0

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)


class _Watched(PassThroughVerifier):
    """Records the hidden-state layers each Verify asks for, per sequence."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.layers: list[tuple[int, ...]] = []
        self.truncations = 0

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        self.layers += [item.hidden_state_layers for item in inputs]
        return await self.inner.verify(inputs)

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        self.truncations += len(items)
        return await self.inner.truncate(items)


class _SlowVerifier(PassThroughVerifier):
    """A verify that takes `delay` seconds more (default 50 ms, as a large target's on a GPU;
    a few ms keep the tiny target's rounds as slow as a 2-core CPU's were before the C layer
    made them ~1 ms: the tests' timings were chosen against those)."""

    def __init__(self, inner: object, delay: float = 0.05) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.delay = delay

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        await asyncio.sleep(self.delay)
        return await self.inner.verify(inputs)


def _stack(
    models: dict[str, Path], tokenizer: object, drafter: str, spec: SpecParams, overlap: str
) -> LocalStack:
    """float32 services over the target and `drafter` ("model" or "eagle3")."""
    return make_stack(
        models["target"],
        drafter,
        tokenizer,
        spec,
        draft_dir=models[drafter],
        dtype=torch.float32,
        overlap=overlap,
    )


def _gated_rounds() -> dict[str, float]:
    """specsplit_gate_<kind>_round_seconds counts so far (the registry is the process's)."""
    from prometheus_client import REGISTRY

    return {
        kind: REGISTRY.get_sample_value(f"specsplit_gate_{kind}_round_seconds_count") or 0.0
        for kind in GATE_ROUND_KINDS
    }


def _target_only(
    models: dict[str, Path], tokenizer: object, seed: int, max_new_tokens: int = MAX_NEW_TOKENS
) -> list[list[int]]:
    stack = make_stack(models["target"], "ngram", tokenizer, SpecParams(0, 1, 0))
    return [generated_ids(c) for c in generate_all(stack, _requests(seed, max_new_tokens))]


@pytest.mark.parametrize("overlap", ["serial", "groups"])
@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_speculation_that_loses_is_held_back_and_probed(
    models, smollm2_tokenizer, drafter: str, overlap: str
) -> None:
    # (60 tokens and a 60 ms drafter: the gate's choice and its probe come well inside the run,
    # its rates apart, even on a loaded 2-core machine; 40 and 30 ms failed there once)
    expected = _target_only(models, smollm2_tokenizer, seed=1, max_new_tokens=60)
    stack = _stack(models, smollm2_tokenizer, drafter, SpecParams(3, 1, 3), overlap)
    # probed after 12 rounds even where speculation could not win at its best (the slow
    # drafter's rounds may commit fewer tokens a second than plain ones with every draft taken)
    gate = stack.scheduler.gate = SpeculationGate(
        window=2, probe_every=12, probe_budget=1.0, hopeless_backoff=1
    )
    before = _gated_rounds()
    slow = _SlowDrafter(stack.scheduler.drafter, delay=0.06)
    stack.scheduler.drafter = slow
    # plain rounds of ~5 ms: the first probe waits out the speculating window's ~0.13 s inside
    # the run (~1 ms rounds ended the run first)
    paced = _SlowVerifier(stack.scheduler.verifier, delay=0.004)
    watched = stack.scheduler.verifier = _Watched(paced)
    out = generate_all(stack, _requests(seed=1, max_new_tokens=60))  # no KV left after
    assert [generated_ids(chunks) for chunks in out] == expected
    # (what the gate saw, for a failure's message: its switches, rates, the rounds drafted)
    seen = (gate.num_switches, gate.rates(BATCH), slow.calls, stack.scheduler.num_rounds)
    if drafter == "eagle3":
        # plain rounds asked for no target features; resuming took the tokens past the last
        # features back on the verifier (verified again with them), and the head drafted on
        assert () in watched.layers and any(watched.layers)
        assert stack.scheduler.num_feature_restarts > 0, seen
        assert watched.truncations == stack.scheduler.num_feature_restarts
    else:
        assert not any(watched.layers) and stack.scheduler.num_feature_restarts == 0
    # explored both, chose plain rounds, probed speculation again and went back
    assert gate.num_switches >= 3, seen
    spec_rate, plain_rate = gate.rates(BATCH)
    assert spec_rate is not None and plain_rate is not None and spec_rate < plain_rate
    # the speculating rounds' best: each sequence's chain of 3 and bonus token
    ceiling = gate.ceiling(BATCH, "speculating")
    assert ceiling is not None and spec_rate < ceiling <= 4 * spec_rate
    assert slow.calls < stack.scheduler.num_rounds / 2  # most rounds drafted nothing
    # the rounds by kind, as the gateway's histograms count them (bench/overlap.py reads them)
    rounds = {kind: n - before[kind] for kind, n in _gated_rounds().items()}
    assert rounds["plain"] > rounds["speculating"] > 0
    assert (rounds["resuming"] > 0) == (drafter == "eagle3")  # only features need catching up


def test_speculation_that_pays_keeps_running(models, smollm2_tokenizer) -> None:
    """The target drafts for itself (every draft accepted) and verifies slowly: 4 tokens a
    round against 1, the gate keeps speculating after exploring plain rounds."""
    expected = _target_only(models, smollm2_tokenizer, seed=2)
    stack = make_stack(models["target"], "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    gate = stack.scheduler.gate = SpeculationGate(window=2, probe_every=50)
    stack.scheduler.verifier = _SlowVerifier(stack.scheduler.verifier)
    out = generate_all(stack, _requests(seed=2))
    assert [generated_ids(chunks) for chunks in out] == expected
    assert gate.speculate(BATCH) and gate.num_switches == 2  # to plain to explore, and back
    spec_rate, plain_rate = gate.rates(BATCH)
    assert spec_rate is not None and plain_rate is not None and spec_rate > plain_rate
    assert all(c[-1].stats is not None and c[-1].stats.num_accepted_drafts > 0 for c in out)


def test_requests_with_their_own_spec_are_not_gated(models, smollm2_tokenizer) -> None:
    """A request that names its spec drafts every round, whatever the gate measured; rounds
    with such a request are not measured."""
    stack = make_stack(models["target"], "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    gate = stack.scheduler.gate = SpeculationGate(window=1, probe_every=50)
    requests = _requests(seed=3)
    for request in requests:
        request.spec = SpecParams(2, 1, 2)
    out = generate_all(stack, requests)
    assert all(c[-1].stats is not None and c[-1].stats.num_accepted_drafts > 0 for c in out)
    assert gate.rates(BATCH) == (None, None) and gate.num_switches == 0


def test_the_gates_measure_rounds_with_few_new_sequences(models, smollm2_tokenizer) -> None:
    """Under steady arrivals at a full batch every round holds a sequence in its first two
    rounds (its prefill, the drafter's catch-up): such rounds are measured while at most one
    sequence in NEW_SHARE is new, else a gate would never measure (nor choose) there."""
    stack = make_stack(models["target"], "model", smollm2_tokenizer, SpecParams(3, 1, 3))
    scheduler = stack.scheduler

    def batch(size: int, new: int, own_spec: int = 0) -> list[Sequence]:
        seqs = []
        for i in range(size):
            seq = scheduler._new_sequence(GenerationRequest([5, 6, 7], 4))
            seq.rounds_since_prefill = 0 if i < new else 2
            if i >= size - own_spec:
                seq.request.spec = SpecParams(2, 1, 2)
            seqs.append(seq)
        return seqs

    assert scheduler._gated(batch(4, new=0)) and scheduler._steady(batch(4, new=0))
    assert not scheduler._gated(batch(NEW_SHARE - 1, new=1))  # a small batch: none new
    assert scheduler._gated(batch(NEW_SHARE, new=1))
    assert not scheduler._gated(batch(NEW_SHARE, new=2))
    assert scheduler._gated(batch(64, new=64 // NEW_SHARE))
    assert not scheduler._gated(batch(64, new=64 // NEW_SHARE + 1))
    assert not scheduler._steady(batch(64, new=64 // NEW_SHARE + 1))  # the overlap gate's too
    assert not scheduler._gated(batch(64, new=0, own_spec=1))  # the gate's to hold back: none


class _FlippingGate(SpeculationGate):
    """Plain rounds and speculating rounds in turn, two of each, whatever is measured: every
    switch a gate can make, many times over."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def speculate(self, batch_size: int) -> bool:
        self.calls += 1
        return self.calls % 4 >= 2

    def observe(self, *args: object, **kwargs: object) -> None:
        pass  # what rounds measure changes nothing here


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_session_turns_across_held_rounds_equal_fresh_requests(
    models, smollm2_tokenizer, overlap: str
) -> None:
    """A session's turn that ends after plain rounds (no target features for its last tokens)
    and the next turn that speculates again: the features' gap goes with the session, and the
    turns equal fresh requests of the whole conversation (EAGLE-3 head)."""
    stack = _stack(models, smollm2_tokenizer, "eagle3", SpecParams(2, 1, 2), overlap)
    stack.scheduler.gate = _FlippingGate()
    conv = Conversation(stack, SamplingParams())

    async def turns() -> None:
        await stack.scheduler.start()
        try:
            for i in range(4):
                await conv.turn(_requests(seed=10 + i)[0].prompt_ids, 5 + 2 * i)
        finally:
            await stack.scheduler.stop()

    asyncio.run(turns())
    assert stack.scheduler.num_feature_restarts > 0


@pytest.mark.parametrize("overlap", ["serial", "groups"])
@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_every_switch_keeps_the_target_output(
    models, smollm2_tokenizer, drafter: str, overlap: str
) -> None:
    """Two plain rounds, two speculating, and so on, for a batch of three: the target's own
    greedy output and no KV left, whichever round a switch falls on."""
    expected = _target_only(models, smollm2_tokenizer, seed=4)
    stack = _stack(models, smollm2_tokenizer, drafter, SpecParams(3, 2, 6), overlap)
    stack.scheduler.gate = _FlippingGate()
    out = generate_all(stack, _requests(seed=4))
    assert [generated_ids(chunks) for chunks in out] == expected


class _NoTruncate(PassThroughVerifier):
    """A verifier whose Truncate fails (UNAVAILABLE)."""

    async def truncate(self, items: list[Truncation]) -> list[Truncated]:
        raise ServiceError(Code.UNAVAILABLE, "truncate failed")


def test_a_failed_truncate_starts_the_sequences_over(models, smollm2_tokenizer) -> None:
    """Resuming speculation, a verifier that cannot take the tokens back: both services start
    the sequences over (a re-prefill with the features); the output is the target's."""
    expected = _target_only(models, smollm2_tokenizer, seed=5)
    stack = _stack(models, smollm2_tokenizer, "eagle3", SpecParams(2, 1, 2), "serial")
    stack.scheduler.gate = _FlippingGate()
    stack.scheduler.verifier = _NoTruncate(stack.scheduler.verifier)
    out = generate_all(stack, _requests(seed=5))
    assert [generated_ids(chunks) for chunks in out] == expected
    assert stack.scheduler.num_feature_restarts > 0


class _LoadingDrafter(_SlowDrafter):
    """A drafter still loading its model for its first `loading` Drafts (UNAVAILABLE); with
    `release_fails`, every Release fails UNAVAILABLE too (after the real one: no leak)."""

    def __init__(self, inner: DrafterClient, loading: int, release_fails: bool = False) -> None:
        super().__init__(inner, delay=0.0)
        self.loading, self.release_fails = loading, release_fails

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        self.calls += 1
        if self.calls <= self.loading:
            raise ServiceError(Code.UNAVAILABLE, "drafter is still loading its model")
        return await self.inner.draft(inputs)

    async def release(self, seq_ids: list[str]) -> None:
        await self.inner.release(seq_ids)  # the stack's leak check reads the real drafter
        if self.release_fails:
            raise ServiceError(Code.UNAVAILABLE, "drafter is still loading its model")


class _RecordingGate(SpeculationGate):
    """Records each observed round: (speculated, measured, the drafter down at its end, the
    overlap gate settled at its batch size: None without one)."""

    def __init__(self, scheduler: object) -> None:
        super().__init__(window=2, probe_every=1000)
        self.scheduler = scheduler
        self.seen: list[tuple[bool, bool, bool, bool | None]] = []

    def observe(self, *args: Any) -> None:
        """The scheduler's call: (batch_size, speculated, tokens, seconds, measured, most)."""
        resting = self.scheduler._drafter_resting()  # type: ignore[attr-defined]
        overlap = self.scheduler.overlap_gate  # type: ignore[attr-defined]
        settled = None if overlap is None else overlap.settled(args[0])
        self.seen.append((args[1], args[4], resting, settled))
        super().observe(*args)


def test_rounds_without_the_drafter_are_not_measured_as_speculating(
    models, smollm2_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafter still loading when the first requests come (UNAVAILABLE): those rounds decode
    without drafts, as fast as plain ones. Counted as speculating they made it look 3x faster
    than plain rounds on two H200s; the gate does not measure them."""
    from gateway import drafting as drafting_module

    monkeypatch.setattr(drafting_module, "DRAFTER_RETRY_S", 0.05)
    expected = _target_only(models, smollm2_tokenizer, seed=6, max_new_tokens=40)
    stack = _stack(models, smollm2_tokenizer, "model", SpecParams(3, 1, 3), "serial")
    stack.scheduler.drafter = _LoadingDrafter(stack.scheduler.drafter, loading=2)
    # rounds of a few ms: the drafter's retries (50 ms apart) come inside the run
    stack.scheduler.verifier = _SlowVerifier(stack.scheduler.verifier, delay=0.004)
    gate = stack.scheduler.gate = _RecordingGate(stack.scheduler)
    out = generate_all(stack, _requests(seed=6, max_new_tokens=40))
    assert [generated_ids(chunks) for chunks in out] == expected
    assert any(spec and resting for spec, _, resting, _ in gate.seen)  # rounds without drafts
    assert not any(spec and measured and resting for spec, measured, resting, _ in gate.seen)
    assert any(spec and measured for spec, measured, _, _ in gate.seen)  # then measured again


def test_a_drafter_still_loading_is_told_once_not_warned_each_retry(
    models, smollm2_tokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`up` serves once the verifier is warm; a drafter still warming up (on a GPU its graphs
    take longer) answers UNAVAILABLE to each retry: one INFO line, no WARNING a retry (a run on
    an H100 logged seven); the output is the target's."""
    from gateway import drafting as drafting_module

    monkeypatch.setattr(drafting_module, "DRAFTER_RETRY_S", 0.0)
    expected = _target_only(models, smollm2_tokenizer, seed=6, max_new_tokens=20)
    stack = _stack(models, smollm2_tokenizer, "model", SpecParams(3, 1, 3), "serial")
    drafter = stack.scheduler.drafter = _LoadingDrafter(stack.scheduler.drafter, loading=4)
    with caplog.at_level(logging.INFO, logger="gateway.drafting"):
        out = generate_all(stack, _requests(seed=6, max_new_tokens=20))
    assert [generated_ids(chunks) for chunks in out] == expected
    assert drafter.calls > 4  # it answered after its loading ones
    records = [r for r in caplog.records if r.name == "gateway.drafting"]
    assert not [r for r in records if r.levelno >= logging.WARNING]
    assert sum("still loading" in r.getMessage() for r in records) == 1


def test_speculation_is_measured_in_the_overlap_gates_chosen_kind(
    models, smollm2_tokenizer
) -> None:
    """With --overlap gated, speculating rounds of a kind the overlap gate explores are not
    speculation's speed: the speculation gate measures only those of the chosen kind, so its
    window has every round's best and a draft that cannot pay is known hopeless at once (two
    H200s: measured while the overlap gate explored, the best was unknown, and larger batches
    probed early and paid a 0.14-0.19 s resume)."""
    expected = _target_only(models, smollm2_tokenizer, seed=7, max_new_tokens=60)
    stack = _stack(models, smollm2_tokenizer, "model", SpecParams(3, 1, 3), "gated")
    scheduler = stack.scheduler
    scheduler.overlap_gate = OverlapGate(("groups", "ahead", "serial"), window=2)
    gate = scheduler.gate = _RecordingGate(scheduler)
    # 250 ms a Draft: speculation's ceiling ~45 tokens/s against plain rounds' 250-420 here; at
    # 80 ms (a ceiling of ~125) a CI run's window of two plain rounds once read 111
    scheduler.drafter = _SlowDrafter(scheduler.drafter, delay=0.25)
    out = generate_all(stack, _requests(seed=7, max_new_tokens=60))
    assert [generated_ids(chunks) for chunks in out] == expected
    assert any(spec and not settled for spec, _, _, settled in gate.seen)  # overlap explored
    assert all(settled for spec, measured, _, settled in gate.seen if spec and measured)
    assert not gate.speculate(BATCH)  # plain rounds chosen
    ceiling, plain = gate.ceiling(BATCH, "speculating"), gate.rate(BATCH, "plain rounds")
    assert ceiling is not None and plain is not None and ceiling < plain
    assert gate._bucket(BATCH).hopeless


@pytest.mark.parametrize("down", [True, False], ids=["drafter-down", "drafter-up"])
def test_a_release_on_a_drafter_known_down_is_not_warned(
    models, smollm2_tokenizer, monkeypatch: pytest.MonkeyPatch, caplog, down: bool
) -> None:
    """Requests that finish while the drafter loads: their Release to it fails as expected and
    is not warned (two H200s: a warning per retired request during the drafter's start-up). A
    Release that fails on a drafter that answers Drafts is still warned."""
    from gateway import drafting as drafting_module

    monkeypatch.setattr(drafting_module, "DRAFTER_RETRY_S", 60.0)
    stack = _stack(models, smollm2_tokenizer, "model", SpecParams(3, 1, 3), "serial")
    loading = 10**9 if down else 0  # every Draft fails, or none
    stack.scheduler.drafter = _LoadingDrafter(stack.scheduler.drafter, loading, release_fails=True)
    with caplog.at_level("WARNING", logger="gateway.retiring"):
        out = generate_all(stack, _requests(seed=8))
    assert all(generated_ids(chunks) for chunks in out)
    warned = [r for r in caplog.records if "release failed" in r.getMessage()]
    assert bool(warned) == (not down)
