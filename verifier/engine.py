"""The verifier engine: one target forward over pending tokens + draft trees, acceptance, KV commit.

State per sequence is its SeqKV (page table + kv_committed_len) and its sampling generator.
A round is validated as a whole before anything changes, so a refused request leaves every
sequence as it was. Its mixins, each over the one before: `DeviceWaits` (verifier/device_waits.py:
how long the device waits between rounds, reported), `DeviceRounds` (verifier/device_rounds.py:
a launch's forward and acceptance queued on the device, its results read and committed),
`RunAhead` (verifier/run_ahead.py: decode steps run before they are asked for), `HintedRounds`
(verifier/hinted_rounds.py: rounds on the gateway's hints, launched after the answer or chained
behind the round in flight), `SeqMemory` (verifier/seq_memory.py: a round's checks and room,
truncation, release, the invariants) and `EngineSetup` (verifier/engine_setup.py: the engine's
state, `load` / `for_model` with the KV pool sized, `warmup`). This module is the round itself:
launch (the parts run ahead taken, the rest launched beside them, the next step run ahead),
finish, further decode steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import torch

from specsplit import metrics
from specsplit.errors import Code, ServiceError
from specsplit.messages import (
    VerifyInput,
    VerifyOutput,
)
from specsplit.model.transfer import on_device
from specsplit.tree import DraftTree
from verifier.chain import (
    resolve,
)
from verifier.engine_setup import EngineSetup
from verifier.rounds import (
    VerifyRound,
    decode_step,
    is_step,
    rules_after,
)


class VerifierEngine(EngineSetup):
    def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        return self.finish(self.launch(inputs))

    def launch(self, inputs: list[VerifyInput]) -> VerifyRound:
        """A round's first part: checked, its room reserved, its forward and acceptance queued
        on the device; nothing waits for the device. `finish` commits it. On a GPU a second
        round may launch before the first is finished (`can_launch`): the device runs it back
        to back with the first while the host finishes that one."""
        if not self.can_launch(inputs):
            raise RuntimeError("verifier: a round launched beside one it may not run beside")
        with on_device(self.device):
            launched = self._launch_round(inputs)
        self._in_flight.append(launched)
        return launched

    def finish(self, launched: VerifyRound) -> list[VerifyOutput]:
        """A launched round's results (waiting for the device), committed; a round of several
        decode steps runs its further steps here."""
        started = time.perf_counter_ns()
        try:
            with on_device(self.device):
                outputs = self._finish_round(launched)
        finally:
            self._in_flight.remove(launched)
        # the results read and committed (not a round's further decode steps, nor a launch)
        self._report_gap("finish", time.perf_counter_ns() - started)
        self.hints.round_finished(launched.inputs, outputs)
        further = any(item.decode_steps > 1 for item in launched.inputs)
        ready = started  # where the wait for the next round starts: the results' read
        if further:
            with on_device(self.device):
                launched.device_ns += self._decode_further(launched.inputs, outputs)
            ready = time.perf_counter_ns()  # the round's results are its last step's
        elif len(launched.inputs) <= self.chain_max_batch:  # a round that may have chained
            self.chain_gate.round_ran(launched.device_ns)
        for out in outputs if launched.looked_up else ():
            if out.seq_id in launched.looked_up:  # (new_tokens' order unchanged)
                self._count_lookup(0, len(out.accepted_tokens))
                out.num_lookup_accepted += len(out.accepted_tokens)
                out.decoded_tokens[:0], out.accepted_tokens = out.accepted_tokens, []
        chained = launched.chained
        if chained is not None:  # the next round is queued on the device already
            found = [item.seq_id for item in chained.inputs if item.kv_committed_len >= 0]
            self.hints.take(found)
            missed = [item.seq_id for item in chained.inputs if item.kv_committed_len < 0]
            self.hints.drop(missed, "unguessed")
        elif further or self._ahead is not None or self._in_flight:
            self.hints.drop([item.seq_id for item in launched.inputs], "busy")
        elif self.launch_on_hint:  # launched once the answer went out (`launch_parked`)
            self.hints.park(launched.inputs, outputs, self.seqs)
        elif self.hints.wants():
            with on_device(self.device):
                self._ahead = self._launch_next(launched.inputs, outputs)
        self._waiting = None
        if self._in_flight or self._ahead is not None:  # the device has the next work already
            self._report_wait(0)
        else:
            self._waiting = (ready, {item.seq_id for item in launched.inputs})
        self._finished_ns, self._results_ns = time.perf_counter_ns(), ready
        return outputs

    def can_launch(self, inputs: list[VerifyInput]) -> bool:
        """Whether `inputs` may launch now: always with no round in flight; beside rounds in
        flight only when none of them shares a sequence with it, none ran a decode step ahead
        and no round involved takes several decode steps (those commit and launch again in
        their `finish`)."""
        if not self._in_flight:
            return True
        if any(item.decode_steps > 1 for item in inputs):
            return False
        ids = {item.seq_id for item in inputs}
        return not any(
            launched.ahead is not None
            or launched.chained is not None
            or any(item.decode_steps > 1 or item.seq_id in ids for item in launched.inputs)
            for launched in self._in_flight
        )

    def in_flight(self, seq_ids: Iterable[str]) -> bool:
        """Whether a launched, unfinished round holds any of `seq_ids`."""
        ids = set(seq_ids)
        return any(item.seq_id in ids for r in self._in_flight for item in r.inputs)

    def _decode_further(self, inputs: list[VerifyInput], outputs: list[VerifyOutput]) -> int:
        """A round's further decode steps (VerifyInput.decode_steps), into its `outputs`: step s
        is a decode round of its own for the items that ask for more than s steps, each
        sequence's last token its input, exactly the round the gateway would send next (on a
        GPU the step run ahead serves it, and the next launches behind it). A step with no room
        (the context, the KV pool) ends its sequences' round where they are: each output says
        how far it got. Returns the steps' device time, nanoseconds."""
        device_ns = 0
        for step in range(1, max(item.decode_steps for item in inputs)):
            more = [
                i
                for i, item in enumerate(inputs)
                if item.decode_steps > step and outputs[i].kv_committed_len < self.max_context
            ]
            if not more:
                break
            # each with the steps left of its round (`_launch_round` runs the next ahead when
            # every sequence has one left, none with rules) and its rules read the steps' tokens
            step_inputs = [
                decode_step(
                    inputs[i].seq_id,
                    outputs[i].kv_committed_len,
                    outputs[i].bonus_token,
                    inputs[i].sampling,
                    steps=inputs[i].decode_steps - step,
                    logprobs=inputs[i].logprobs,
                    rules=rules_after(inputs[i], outputs[i]),
                    lookup=inputs[i].lookup,
                )
                for i in more
            ]
            held = self._chain_steps([item for item in step_inputs if item.lookup])
            try:
                # their lengths are the engine's, their tokens the target's, their sampling
                # the round's (validated), their context checked above: no checks again
                step_round = self._launch_round(step_inputs, validated=True, held=held)
            except ServiceError as e:  # nothing of the step happened: the round ends here
                if e.code != Code.RESOURCE_EXHAUSTED:
                    raise
                break
            self.top_up(step_round)  # (on a GPU, while the device runs the step)
            stepped = self._finish_round(step_round, further=True)
            device_ns += step_round.device_ns
            self._count_lookup(
                sum(len(item.tree) for item in step_inputs),
                sum(len(out.accepted_tokens) for out in stepped),
            )
            for i, out in zip(more, stepped, strict=True):
                outputs[i].decoded_tokens += [outputs[i].bonus_token, *out.accepted_tokens]
                outputs[i].num_lookup_accepted += len(out.accepted_tokens)
                outputs[i].bonus_token = out.bonus_token
                if out.logprobs is not None:  # (the round's asked for them too)
                    logprobs = outputs[i].logprobs
                    assert logprobs is not None
                    logprobs.extend(out.logprobs)
                outputs[i].kv_committed_len = out.kv_committed_len
        return device_ns

    def _first_lookups(
        self, inputs: list[VerifyInput]
    ) -> tuple[list[VerifyInput], frozenset[str], bool]:
        """The gateway's round with each decode step that asks for prompt lookup (a sequence's
        one pending token, no tree, no hidden states, no rules) given the chain its tokens
        suggest, as its further steps are (`_chain_steps`); those sequences; and whether the
        round holds (runs nothing ahead)."""
        if not any(item.lookup for item in inputs):
            return inputs, frozenset(), False
        steps = list(inputs)
        asking = [
            i
            for i, item in enumerate(inputs)
            if item.lookup
            and not (item.begin or item.tree or item.hidden_state_layers or item.rules)
            and len(item.pending_tokens) == 1
        ]
        for i in asking:  # (the gateway's items stay as sent)
            steps[i] = dataclasses.replace(inputs[i])
        held = self._chain_steps([steps[i] for i in asking])
        looked_up = frozenset(steps[i].seq_id for i in asking if steps[i].tree)
        self._count_lookup(sum(len(steps[i].tree) for i in asking), 0)
        return steps, looked_up, held

    def _count_lookup(self, drafted: int, accepted: int) -> None:
        self.num_lookup_drafted += drafted
        self.num_lookup_accepted += accepted
        metrics.count_lookup_tokens(drafted, accepted)

    def _chain_steps(self, steps: list[VerifyInput]) -> bool:
        """Decode steps that ask for prompt lookup (VerifyInput.lookup; a round's first or a
        further one), each given as its tree the chain its sequence's own tokens suggest after
        its pending token (at most `lookup`, within the context; none where nothing matched, or
        with logit rules, whose rows a step bends one token at a time) - but for a step the
        device already runs ahead (plain, launched before its token was known): it stays
        plain, to take that step. Returns whether such a step had a chain: the round then holds
        (runs nothing ahead), so that its next step looks up instead of running plain too.
        (A step that verifies a chain runs nothing ahead either: its next step's input is
        known once its tokens are; one that found none does, as plain steps do.)"""
        ahead = {} if self._ahead is None else {i.seq_id: i for i in self._ahead.inputs}
        held = False
        for step in steps:
            if step.rules is not None:
                continue
            room = self.max_context - step.kv_committed_len - 1
            history = self.seqs[step.seq_id].history
            last = step.pending_tokens[0]
            chain = history.chain(step.kv_committed_len, last, min(step.lookup, room))
            running = ahead.get(step.seq_id)
            if running is not None and is_step(step, running):
                held = held or bool(chain)
            else:
                step.tree = DraftTree(chain, list(range(-1, len(chain) - 1)))
        return held

    @torch.inference_mode()
    def _launch_round(
        self, inputs: list[VerifyInput], validated: bool = False, held: bool = False
    ) -> VerifyRound:
        """A round queued on the device. validated: `inputs` need no checks (a round's further
        decode steps, built here from what the engine committed). Where every one of `inputs`
        has a step left (decode_steps > 1), the next step is the round's own: it runs ahead at
        any batch size. held: run nothing ahead (`_chain_steps`)."""
        started_ns = time.perf_counter_ns()
        looked_up: frozenset[str] = frozenset()
        if not validated:
            self._validate(inputs)
            inputs, looked_up, held = self._first_lookups(inputs)
        self.hints.round_started()  # a late hint launches nothing now
        taken, positions = self._take_ahead(inputs)
        taken_at = set(positions)
        others = [i for i in range(len(inputs)) if i not in taken_at]
        # the steps queued behind the step taken (after a round's last step): this round's own
        # next step, or the next round's (with the others' beside it: `_join_ahead`)
        follower = None
        if taken is not None:
            follower, taken.follower = taken.follower, None
            # the gateway's next round of the same batch: the trip since the last round's
            # results were read (the device then ran the step taken: the commit, the answer,
            # the gateway's work and this request; with any launch behind it that it waited for)
            if self.ahead_depth.auto and not validated and not others:
                trip_ns = time.perf_counter_ns() - self._results_ns
                self.ahead_depth.observe_trip(len(inputs), trip_ns)
        parts = [] if taken is None else [taken]
        hinted = any(item.seq_id in self.hints.hinted for item in inputs)
        # a draft-ahead round without a hint (`unhinted`: the overlap gate's "ahead-unhinted")
        # verifies its misses with no tree while the drafter drafts their next trees: where it
        # guessed the outcome the next round carries one, and a step run ahead would be dropped
        # ("unasked") after holding that round behind a decode step on the device
        drafting_ahead = any(item.unhinted for item in inputs)
        # a step that verifies a chain of prompt lookup (VerifyInput.lookup) runs nothing
        # ahead: its next step's chain is known once its tokens are; nor one that took the step
        # run ahead where its sequence had a chain (`held`: its next step looks up)
        looking_up = held or any(item.tree for item in inputs if item.lookup)
        running_ahead = self.decode_ahead and not (
            self._in_flight or hinted or drafting_ahead or looking_up
        )
        # what the step taken does not cover (newcomers): the pending tokens each leads in ahead
        # of the round (by position), and the round in graph parts where one launch would find
        # no graph (more than a prefill graph holds)
        leads = dict(zip(others, self._lead_lens([inputs[i] for i in others]), strict=True))
        groups = self._graph_groups(inputs, others, leads) if others else []
        if follower is not None and (not running_ahead or len(groups) > 1):
            # not this round's steps, or the others in parts (`_join_ahead` takes them as one)
            self._drop(follower, "other work", room=1)  # (the step taken keeps its room)
            follower = None
        if taken is not None and others:  # copied on the device now: the launch beside it may
            taken.packed = taken.packed.clone()  # reuse the acceptance graph that holds them
            if follower is not None:  # (its results: the bonus tokens of the steps behind)
                follower.packed = follower.packed.clone()
        if others:  # the whole round, or what the step run ahead does not cover (a newcomer)
            others = [i for group in groups for i in group]  # the results' order
            try:
                parts += self._launch_new(
                    [[inputs[i] for i in group] for group in groups], [leads[i] for i in others]
                )
            except BaseException:
                if taken is not None:  # nothing of the round is committed: its draws go back
                    taken.follower = follower  # (and the steps behind it, undone first)
                    self._undo_ahead(taken)
                raise
        # the next decode step goes to the device before this round is waited for: the GPU
        # runs it back to back with this one while the host commits and answers (not beside
        # another round in flight: that one may finish first and set its own)
        ahead = None
        if running_ahead:
            own_next = all(item.decode_steps > 1 for item in inputs)
            if follower is not None and not others:  # launched behind the step taken
                ahead = follower  # (before the request)
            elif follower is not None:  # with the others' next step beside it, as one step
                ahead = self._join_ahead(follower, parts[-1], capped=not own_next)
            else:
                bonus = [self._bonus_tokens(part) for part in parts]
                ahead = self._launch_ahead(parts, bonus, capped=not own_next)
                if ahead is not None:  # behind a step run ahead before the request (the trip)
                    ahead.on_request = not validated and taken is not None and not others
                    if self.ahead_depth.auto and validated and taken is not None and not others:
                        # a step taken, the next launched: what a request costs after its trip
                        launch_ns = time.perf_counter_ns() - started_ns
                        self.ahead_depth.observe_launch(len(inputs), launch_ns)
        self._end_wait(item.seq_id for item in inputs)
        return VerifyRound(inputs, [*positions, *others], parts, ahead, looked_up=looked_up)

    @torch.inference_mode()
    def _finish_round(self, launched: VerifyRound, further: bool = False) -> list[VerifyOutput]:
        ahead = launched.ahead
        try:
            results = [out for part in launched.parts for out in self._finish(part, further)]
        except BaseException:  # (the room held for the chained round: `finally`, then undone)
            self._ahead = launched.chained or ahead
            self._drop_ahead("failed")
            raise
        finally:
            if self._held:  # (room held for a chained round: rarely any)
                for item in launched.inputs:
                    self._held.pop(item.seq_id, None)
        if launched.chained is not None:  # the outcomes came: the round as it will be asked
            chained = launched.chained
            assert chained.chain_hints is not None
            done = [(o.accepted_tokens, o.bonus_token, o.kv_committed_len) for o in results]
            resolve(chained.inputs, chained.chain_hints, done)
            ahead = chained
        elif ahead is not None:  # its inputs as the gateway will send them: each bonus token
            # (the round's first results: a step queued behind the step taken may cover that
            # part alone, the others' launched beside it unable to run ahead: `_join_ahead`)
            items = zip(ahead.inputs, ahead.seqs, results[: len(ahead.inputs)], strict=True)
            for item, seq, out in items:
                item.pending_tokens = [out.bonus_token]
                if item.rules is not None:  # (its output through that token: as the commit kept)
                    item.rules = seq.rules
        self._ahead = ahead
        launched.device_ns = sum(part.device_ns() for part in launched.parts)
        if len(launched.parts) == 1:  # (its order is the round's)
            return results
        by_position = dict(zip(launched.order, results, strict=True))
        return [by_position[i] for i in range(len(launched.inputs))]
