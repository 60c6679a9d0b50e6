"""The round loop: admit → draft → verify → commit, for a continuously changing batch.

Requests join (`generate`, gateway/requests_lifecycle.py) and leave (finish, cancel) between
rounds. Faults (DESIGN.md §4): a drafter that is down or lost a sequence turns into empty trees
(plain target decoding, the same output) until it answers again; a verifier that lost a
sequence (restart) gets it re-prefilled from the gateway's own tokens. A session's turn
(gateway/sessions.py) is a request whose KV stays in both services when it leaves: it is put
away (`SessionStore.end_turn`) instead of released. The Scheduler's other round kinds and its
handling of a verifier's failed round are mixins in their own modules (each declares what it
uses of the Scheduler): a round's plan, run and measures as the gates see them
(gateway/round_gates.py), pipelined groups (gateway/groups.py), draft-ahead
(gateway/draft_ahead.py), verifier faults (gateway/faults.py), the Draft calls and the
drafter's faults (gateway/drafting.py), requests leaving and their KV released, and features
restarted (gateway/retiring.py), requests arriving and the Scheduler's start and shutdown
(gateway/requests_lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from gateway.adaptive import build_ladder
from gateway.clients import DrafterClient, VerifierClient
from gateway.decode_steps import QUIET_SECONDS, DecodeSteps, is_plain
from gateway.draft_ahead import (
    AHEAD_MISSES,
    DEFAULT_AHEAD_GUESSES,
    DEFAULT_AHEAD_MAX_BATCH,
    DEFAULT_AHEAD_MISS,
    MAX_AHEAD_GUESSES,
    AheadRounds,
)
from gateway.drafting import Drafting
from gateway.faults import DEFAULT_VERIFIER_WAIT_S, VerifierFaults
from gateway.gate import OverlapGate, SpeculationGate
from gateway.groups import GroupRounds, Round
from gateway.health import Health
from gateway.requests_lifecycle import RequestsLifecycle
from gateway.round_gates import RoundGates
from gateway.sequence import Committed, Sequence
from gateway.sessions import DEFAULT_SESSION_TTL_S, SessionStore
from specsplit import metrics, telemetry
from specsplit.errors import Code, ServiceError
from specsplit.messages import (
    MAX_DECODE_STEPS,
    MAX_LOOKUP,
    SpecParams,
    VerifyInput,
    VerifyOutput,
)
from specsplit.tree import DraftTree

log = logging.getLogger(__name__)
T = TypeVar("T")

OVERLAP_MODES = ("serial", "groups", "gated", "ahead", "both")


class Scheduler(Drafting, GroupRounds, AheadRounds, VerifierFaults, RoundGates, RequestsLifecycle):
    def __init__(
        self,
        drafter: DrafterClient,
        verifier: VerifierClient,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: tuple[int, ...],
        default_spec: SpecParams,
        max_batch_size: int = 64,
        model_name: str = "",
        hidden_state_layers: tuple[int, ...] = (),
        adaptive_spec: bool = False,
        adaptive_rungs: tuple[SpecParams, ...] | None = None,
        verifier_wait_s: float = DEFAULT_VERIFIER_WAIT_S,
        max_waiting: int | None = None,
        overlap: str = "serial",
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_context: int | None = None,
        speculation_gate: bool = False,
        ahead_guesses: int = DEFAULT_AHEAD_GUESSES,
        ahead_max_batch: int = DEFAULT_AHEAD_MAX_BATCH,
        decode_steps: int = 1,
        adaptive_decode_steps: bool = False,
        decode_steps_quiet_s: float = QUIET_SECONDS,
        decode_lookup: int = 0,
        decode_lookup_max_batch: int = 2,
        prefill_chunk: int = 0,
        prefill_rounds_one_step: bool = True,
        early_verify: bool = False,
        ahead_miss: str = DEFAULT_AHEAD_MISS,
        verify_ahead: bool = True,
    ) -> None:
        """adaptive_spec: requests without their own spec move along a ladder of draft shapes
        (`adaptive_rungs`, None = gateway.adaptive's default, plus `default_spec`, the rung they
        start on); off = every round uses `default_spec`. verifier_wait_s: how long running
        requests wait for a verifier that went away (restarting, reloading) before they end
        with UNAVAILABLE. max_waiting: requests that may wait for a place in the batch, more are
        refused (RESOURCE_EXHAUSTED); None = no bound (in-process stacks; the gateway service
        passes --max-waiting, default DEFAULT_MAX_WAITING). overlap: "serial" (draft, then
        verify, for the whole batch) or "groups" (two groups take turns: while one is verified,
        the other is drafted; DESIGN.md §3) or "gated" (speculating rounds as groups, draft-ahead
        or serial rounds, whichever commits more tokens per second, measured per batch size by
        the overlap gate, gateway/gate.py) or "ahead" (draft-ahead: while a round is verified
        the drafter drafts the next round's trees for its likely outcomes, `ahead_guesses`
        bonus tokens per accept length; a round whose outcome was guessed sends no Draft
        before its Verify) or "both" (draft-ahead while at most `ahead_max_batch` sequences
        run, where groups cannot hide drafting, groups above). session_ttl_s: idle sessions'
        default lifetime; max_context: the model's, checked against a session's whole
        conversation (None: only the verifier checks it). speculation_gate: requests without
        their own spec draft only while speculating commits more tokens per second than plain
        rounds, measured per batch size (gateway/gate.py); off = they always draft.
        decode_steps: a plain round (no tree, no target features) decodes up to this many
        tokens in one Verify (VerifyInput.decode_steps); adaptive_decode_steps: serial plain
        rounds grow from it, per batch size, while the verifier's device idles between rounds,
        once no request arrived for `decode_steps_quiet_s` (gateway/decode_steps.py);
        decode_lookup: each further decode step of a plain round verifies a chain of up to this
        many tokens the verifier drafts by prompt lookup (VerifyInput.lookup; 0: plain steps),
        in rounds of at most decode_lookup_max_batch sequences;
        prefill_chunk: a run of tokens the verifier lacks (a prompt, a sequence it takes again)
        longer than this goes in chunks of this many, a round each beside the other sequences'
        rounds (Sequence.prefilling; 0: in one round);
        prefill_rounds_one_step: a round that starts a sequence (its prefill) decodes one step
        for every sequence in it, so the new one's first token streams after that step, not
        after the others' further steps; not while requests wait for a place in the batch.
        early_verify: groups send the other group's Verify as soon as its trees are drafted,
        while this group's is in flight (the verifier runs
        the two back to back: for a drafter and a verifier on two GPUs; on one GPU shared by
        both it measured slower, bench/RESULTS.md); off = each group's Verify goes out in its
        own round. With "gated"
        and `early_verify` the overlap gate measures groups with the early Verify
        ("groups-early") and without it ("groups"): through the services on two H100s it ran
        1.25x / 1.38x groups at batch 8 / 32 with an 8B-shaped target; with SmolLM2 and its
        head 0.65x / 0.73x in one run and 1.10x / 1.02x on SmolLM2-shaped random weights in the
        next (bench/RESULTS.md). ahead_miss: in a
        draft-ahead round, a sequence whose outcome was not guessed is drafted first ("draft"),
        or verified with no tree at once ("plain": a plain decode step while its next round's
        trees are drafted ahead, so that the round holds only the Verify on its path).
        verify_ahead: in a draft-ahead round, the trees
        drafted ahead go to the verifier as a hint (VerifierClient.hint) as soon as they come,
        so that it launches each sequence's next round as this one commits, before the gateway
        asks for it (the answer's trip through the gateway and the next request's off the
        verifier's path); off = only the gateway sends them, in the next Verify. With "gated"
        the overlap gate also measures draft-ahead without the hint ("ahead-unhinted"): where
        the drafter is the slower one, hints come too late to pay for their work (on two H100s
        with an 8B-shaped target, 0.85x-0.99x of draft-ahead without them at batch 32, but
        1.02x-1.11x at batch 1 / 8 in most runs, bench/RESULTS.md)."""
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap {overlap!r}: one of {OVERLAP_MODES}")
        if max_batch_size < 1:  # no request would ever be admitted
            raise ValueError(f"max_batch_size = {max_batch_size}: want 1 or more")
        if not 0 <= ahead_guesses <= MAX_AHEAD_GUESSES:
            raise ValueError(f"ahead_guesses = {ahead_guesses}: want 0 to {MAX_AHEAD_GUESSES}")
        if ahead_miss not in AHEAD_MISSES:
            raise ValueError(f"ahead_miss {ahead_miss!r}: one of {AHEAD_MISSES}")
        if ahead_max_batch < 0:
            raise ValueError(f"ahead_max_batch = {ahead_max_batch}: want 0 or more")
        if not 1 <= decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps = {decode_steps}: want 1 to {MAX_DECODE_STEPS}")
        if not 0 <= decode_lookup <= MAX_LOOKUP:
            raise ValueError(f"decode_lookup = {decode_lookup}: want 0 to {MAX_LOOKUP}")
        self.drafter = drafter
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.default_spec = default_spec
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.model_name = model_name  # gen_ai.request.model on request spans
        self._init_drafting(hidden_state_layers)  # gateway/drafting.py
        self.adaptive_ladder = build_ladder(default_spec, adaptive_rungs) if adaptive_spec else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.verifier_wait_s = verifier_wait_s
        self._verifier_down_since: float | None = None  # on `clock`
        self._verifier_health: Health | None = None  # last logged while waiting for it
        self.clock = time.monotonic  # of the verifier wait (a test's fake clock advances it)
        self.draining = False  # shutting down: the APIs refuse new requests
        self.num_rounds = 0
        self.overlap = overlap
        self._init_groups()  # overlap "groups" (gateway/groups.py)
        self._admission_held = False  # a preemption freed pages for the running ones only
        # committed rounds whose chunks are not streamed yet, in order (_stream)
        self._unstreamed: list[tuple[Sequence, Committed]] = []
        self.num_preemptions = 0
        self.sessions = SessionStore(self, tokenizer, ttl_s=session_ttl_s, max_context=max_context)
        self._expiry: asyncio.Task[None] | None = None
        speculates = default_spec.num_steps > 0 or adaptive_spec
        self.gate = SpeculationGate() if speculation_gate and speculates else None
        gated_modes: tuple[str, ...] = ("groups", "ahead", "ahead-unhinted", "serial")
        if not verify_ahead:
            gated_modes = ("groups", "ahead", "serial")  # "ahead" sends no hints already
        if early_verify:  # the gate measures groups with the early Verify and without it
            gated_modes = ("groups-early", *gated_modes)
        self.overlap_gate = OverlapGate(gated_modes) if overlap == "gated" else None
        self.num_tokens_committed = 0
        self.num_feature_restarts = 0  # sequences whose features were caught up on resuming
        self.ahead_guesses = ahead_guesses
        self.ahead_max_batch = ahead_max_batch
        self.ahead_miss = ahead_miss
        self.verify_ahead = verify_ahead
        self._hints: set[asyncio.Future[None]] = set()  # hints on their way (`_hint`)
        self.decode_steps = decode_steps
        self.decode_lookup = decode_lookup
        self.decode_lookup_max_batch = decode_lookup_max_batch
        self.steps_policy = (
            DecodeSteps(decode_steps, quiet_seconds=decode_steps_quiet_s)
            if adaptive_decode_steps
            else None
        )
        self._plain_round: tuple[int, int] | None = None  # (batch size, steps) of a plain round
        self.prefill_rounds_one_step = prefill_rounds_one_step
        self.prefill_chunk = prefill_chunk
        self.early_verify = early_verify
        self.num_ahead_hits = 0  # draft-ahead: rounds whose tree was drafted ahead
        self.num_ahead_misses = 0  # and rounds that had trees drafted ahead, none for the outcome

    # -- the loop --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._retire()
                self._admit()
                metrics.observe_queue(len(self.running), len(self.waiting))
                if not self.running:
                    self._stream()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                plan = await self._plan_round()
                await self._run_round(plan.mode)
                self._observe_round(plan)
            except ServiceError as e:
                await self._fail_round(e)
            except Exception:  # a bug must fail the requests, never stall them silently
                log.exception("round failed")
                error = ServiceError(Code.INTERNAL, "internal error in the gateway's round")
                for seq in self.running:
                    self._fail(seq, error)

    def _admit(self) -> None:
        if self._admission_held and self.running:
            return  # after a preemption: until a running sequence finishes
        self._admission_held = False
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            if not seq.cancelled:
                self.running.append(seq)

    async def step(self, batch: list[Sequence]) -> None:
        """One round for the batch: draft → verify → commit. The last round's chunks stream
        once this round's first RPC is on its way (`_sent_then_stream`)."""
        with telemetry.round_span([seq.span for seq in batch]):  # carried to both services
            trees = await self._sent_then_stream(self._draft(batch))
            outputs = await self._sent_then_stream(
                self.verifier.verify(self._verify_inputs(batch, trees))
            )
        self._commit(batch, trees, outputs)

    def _verify_inputs(self, batch: list[Sequence], trees: list[DraftTree]) -> list[VerifyInput]:
        policy = self.steps_policy
        steps = self.decode_steps if policy is None else policy.steps(len(batch))
        if (
            self.prefill_rounds_one_step
            and any(seq.starts for seq in batch)
            and not any(not seq.cancelled for seq in self.waiting)
        ):
            # the new sequences' first tokens: after this step, not the others' last (a long
            # prompt's chunk rounds draw none: the others keep their steps there). Not while
            # requests wait for a place: the batch is full, each finished request's place goes
            # to a newcomer so that nearly every round starts one, and one-step rounds would
            # cut the rate that frees the places they wait for
            steps = 1
        lookup = self.decode_lookup if len(batch) <= self.decode_lookup_max_batch else 0
        inputs = [
            seq.verify_input(tree, steps, lookup) for seq, tree in zip(batch, trees, strict=True)
        ]
        if policy is not None and all(is_plain(item) for item in inputs):  # what it learns from
            metrics.observe_decode_steps(steps)
            self._plain_round = (len(batch), max(item.decode_steps for item in inputs))
        return inputs

    async def _sent_then_stream(self, call: Awaitable[T]) -> T:
        """Await `call`; once it waits for an answer (its RPC on the way: not a call that
        needed none), stream the committed rounds meanwhile. Detokenizing, stop strings'
        bookkeeping, metrics and the clients' writes so stay off the path between the
        verifier's answer and the next round's RPC (the overlap issue's critical path)."""
        task = asyncio.ensure_future(call)
        if not self._unstreamed:
            return await task
        await asyncio.sleep(0)  # the call runs until it waits: its request is sent
        if not task.done():
            try:
                self._stream()
            except BaseException:
                task.cancel()
                raise
        return await task

    def _commit(
        self, batch: list[Sequence], trees: list[DraftTree], outputs: list[VerifyOutput]
    ) -> None:
        """Append each verified round to its sequence (tokens, KV lengths, stop rules: what the
        next round needs); its chunk waits in _unstreamed for `_stream`."""
        self.num_rounds += 1
        self._verifier_down_since = None
        for seq, tree, out in zip(batch, trees, outputs, strict=True):
            # a long prompt's chunk (what verify_input sent: nothing changed the sequence since):
            # nothing to append or stream
            if seq.prefilling:
                seq.commit_chunk(out)
                continue
            self._unstreamed.append((seq, seq.commit(out)))
            seq.adapt(tree, out)
            self.num_tokens_committed += len(out.new_tokens)

    def _commit_and_stream(self, pending: Round) -> None:
        """Groups commit a round while the other group's Verify is in flight (or must commit it
        before it is verified again): its chunks stream at once."""
        self._commit(*pending)
        self._stream()

    def _stream(self, seqs: list[Sequence] | None = None) -> None:
        """Make and stream the committed rounds' chunks (of `seqs` only, if given): text,
        metrics, each client's queue."""
        if seqs is None:
            now, self._unstreamed = self._unstreamed, []
        else:
            ids = set(map(id, seqs))
            now = [item for item in self._unstreamed if id(item[0]) in ids]
            self._unstreamed = [item for item in self._unstreamed if id(item[0]) not in ids]
        made = [(seq, committed.out, seq.chunk(committed)) for seq, committed in now]
        metrics.observe_commits(made)
        for seq, _, chunk in made:
            seq.outbox.put_nowait(chunk)
