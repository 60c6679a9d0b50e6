"""The verifier engine: one target forward over pending tokens + draft trees, acceptance, KV commit.

State per sequence is its SeqKV (page table + kv_committed_len) and its sampling generator.
A round is validated as a whole before anything changes, so a refused request leaves every
sequence as it was. Its mixins, each over the one before: `DeviceWaits` (verifier/device_waits.py:
how long the device waits between rounds, reported), `DeviceRounds` (verifier/device_rounds.py:
a launch's forward and acceptance queued on the device, its results read and committed),
`RunAhead` (verifier/run_ahead.py: decode steps run before they are asked for), `HintedRounds`
(verifier/hinted_rounds.py: rounds on the gateway's hints, launched after the answer or chained
behind the round in flight) and `SeqMemory` (verifier/seq_memory.py: a round's checks and room,
truncation, release, the invariants). This module is the round itself: launch (the parts run
ahead taken, the rest launched beside them, the next step run ahead), finish, further decode
steps.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable

import torch

from specsplit.cli_flags import CHAIN_MAX_BATCH, CHAIN_MIN_GUESS_RATE
from specsplit.errors import Code, ServiceError
from specsplit.kv_cache import KVCache, pool_num_pages
from specsplit.messages import (
    VerifyInput,
    VerifyOutput,
)
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.model.llama import LlamaModel, kv_cache_bytes_per_token, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.model.transfer import on_device
from verifier.accept_graphs import AcceptGraphs
from verifier.ahead_depth import AheadDepth
from verifier.chain import (
    resolve,
)
from verifier.chain_gate import ChainGate
from verifier.hints import HintBook
from verifier.rounds import (
    Launched,
    VerifierSeq,
    VerifyRound,
    decode_step,
)
from verifier.seq_memory import SeqMemory
from verifier.warmup import GRAPH_QUERY_LENS, PREFILL_QUERY_LENS, graphs_reserve_bytes, warm_up

log = logging.getLogger(__name__)


class VerifierEngine(SeqMemory):
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        max_context: int,
        vocab_size: int,
        *,
        graph_query_lens: tuple[int, ...] = (),
        prefill_query_lens: tuple[int, ...] = PREFILL_QUERY_LENS,
        max_batch_size: int = 64,
        synthetic_acceptance: tuple[float, ...] | None = None,
        decode_ahead: bool = False,
        decode_ahead_max_batch: int = 64,
    ) -> None:
        """graph_query_lens: on a GPU, capture CUDA graphs at warm-up for steps of these query
        tokens per sequence and batches up to max_batch_size; () = always eager. With them,
        prefill_query_lens: graphs of these query tokens for batches up to PREFILL_MAX_BATCH.
        synthetic_acceptance: BENCHMARKS ONLY, NOT LOSSLESS: the first child at depth d is
        accepted with probability synthetic_acceptance[d] (the last rate for deeper levels), so
        random-weight models run the whole system at a chosen accepted length; the target's
        logits are bent to that outcome (`round_accept.bend_logits`) and the round's own
        acceptance runs on them (the greedy acceptance graphs where a real greedy round would
        use them), so the bonus token is the target's argmax among the tokens not drafted
        there.
        decode_ahead: after a round of decode steps (no trees, no hidden states), launch
        the same sequences' next decode step before it is asked for (`_launch_ahead`); the next
        round takes it when it is that step, else it is dropped; rounds of more than
        decode_ahead_max_batch sequences run nothing ahead, but for a round's own further
        decode steps (VerifyInput.decode_steps), which always take it."""
        self.model = model
        self.kv = kv
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.num_layers = model.config.num_layers  # hidden_state_layers go up to this
        self.device = kv.device
        self.seqs: dict[str, VerifierSeq] = {}
        self.synthetic_acceptance = synthetic_acceptance
        self._synthetic_rng = random.Random(0)
        if synthetic_acceptance is not None:
            log.warning("SYNTHETIC ACCEPTANCE %s: output is not the target's", synthetic_acceptance)
        self.decode_ahead = decode_ahead
        self.decode_ahead_max_batch = decode_ahead_max_batch
        # decode steps run ahead after a round's last step (`--decode-ahead-depth`; 0, auto: as
        # many as cover the trip between rounds, measured)
        self.ahead_depth = AheadDepth(1)
        self._ahead: Launched | None = None  # the decode step launched before it was asked for
        self._in_flight: list[VerifyRound] = []  # launched, not finished (`launch`)
        self.num_ahead_used = 0  # decode steps run ahead that the next round was
        self.num_ahead_dropped_by: Counter[str] = Counter()  # ... and that it was not, by why
        self.on_decode_ahead: Callable[[str], None] | None = None  # "used" / "dropped" each
        self.on_decode_ahead_dropped: Callable[[str], None] | None = None  # and its reason
        # the gateway's hints for rounds in flight (`hint_next`); the rounds run ahead on them
        # that the next round was / was not, and a callback for each
        self.hints = HintBook()
        # launch_on_hint (the service sets it where its calls run on the event loop, as the
        # hints do): `finish` keeps each sequence of its round in `hints.finished`, and their
        # hinted next rounds launch once the answer went out (the caller's `launch_parked`: the
        # answer does not wait for that launch's host work; on two H100s 1.02x / 1.04x the
        # launch inside `finish` at batch 1 / 8, bench/RESULTS.md), or when a late hint comes
        # (`hint_next`), if no round has started since
        self.launch_on_hint = False
        # with launch_on_hint, chain a hinted round on the device behind the round in flight
        # (`_chain`, verifier/chain.py) instead of launching it after that round's answer
        # (`--chain-rounds`), for rounds of at most chain_max_batch sequences. Its host work
        # comes after the hint: where it ends after the round, it holds the round's answer back
        # (on two H100s, 8B target: 1.07x / 1.08x at batch 1, 0.93x at 8, 0.91x at 32)
        self.chain_rounds = False
        # `--chain-rounds auto`: only while a round's device time well exceeds a chain's host
        # work (ChainGate.auto; off: every chain the rest allows)
        self.chain_gate = ChainGate()
        self.chain_max_batch = CHAIN_MAX_BATCH
        # ... and only while the hints' guess rate (`HintBook.guess_rate`) is at least this (a
        # chained round whose outcome was not guessed is dropped after the device ran it)
        self.chain_min_guess_rate = CHAIN_MIN_GUESS_RATE
        self.num_next_used = 0
        self.num_next_dropped = 0
        self.on_round_ahead: Callable[[str], None] | None = None
        # how long the device waits between rounds of the same sequences (`on_wait`, seconds):
        # from a finish with nothing queued behind it (its start, and its sequences) to the next
        # round queued; 0 where a round or decode step run ahead followed
        self.on_wait: Callable[[float], None] | None = None
        self._waiting: tuple[int, set[str]] | None = None
        # that wait's host parts (`on_gap(phase, seconds)`, GAP_PHASES): every finish, and
        # where a hinted round followed, the time until its launch began and the launch
        self.on_gap: Callable[[str, float], None] | None = None
        # on a GPU, the device's idle time before each round's first work where the round
        # launched before it shared a sequence with it (`on_idle(seconds)`), from the two
        # rounds' CUDA event timestamps: what the device saw, whichever way the round launched
        # (after the request, on a hint, chained), where `on_wait` measures from the host
        self.on_idle: Callable[[float], None] | None = None
        # the same for a round's further decode steps alone (`on_step_idle(seconds)`): the
        # device's idle time inside a round of several steps, where the host prepares each step
        self.on_step_idle: Callable[[float], None] | None = None
        self._last_end: tuple[torch.cuda.Event, set[str]] | None = None  # (its end, its ids)
        self._finished_ns = 0  # when the last finish returned
        self._results_ns = 0  # when it read its results (its last step's): the device was done
        # storage each sequence of a round in flight keeps past its commit: the room of the
        # hinted round chained behind it (`_chain`), until that round is taken or dropped
        self._held: dict[str, int] = {}
        self.graph_query_lens = graph_query_lens
        self.prefill_query_lens = prefill_query_lens if graph_query_lens else ()
        self.graphs: CudaGraphRunner | None = None
        self.accept_graphs: AcceptGraphs | None = None  # greedy acceptance's CUDA graphs
        if graph_query_lens and self.device.type == "cuda":
            self.graphs = CudaGraphRunner.for_model(
                model,
                kv,
                max_batch_size=max_batch_size,
                max_context=max_context,
                max_query_len=max(graph_query_lens + self.prefill_query_lens),
            )
            self.accept_graphs = AcceptGraphs(
                kv,
                self.graphs.batch_sizes,
                self.graphs.batch_sizes[-1] * max(graph_query_lens),
                vocab_size,
            )

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_pages: int | None = None,
        page_size: int = 16,
        kv_memory_fraction: float = 0.8,
        graph_query_lens: tuple[int, ...] = GRAPH_QUERY_LENS,
        max_batch_size: int = 64,
        decode_ahead: bool = False,
        decode_ahead_max_batch: int = 64,
        synthetic_acceptance: tuple[float, ...] | None = None,
    ) -> VerifierEngine:
        """num_pages None: 2048 on the CPU; on a GPU, `kv_memory_fraction` of the memory free
        after loading the weights (less room kept for the CUDA graphs' logits).
        synthetic_acceptance: benchmarks only, not lossless (see __init__)."""
        model, _ = load_model(model_path, dtype=dtype, device=device)
        return cls.for_model(
            model,
            num_pages=num_pages,
            page_size=page_size,
            kv_memory_fraction=kv_memory_fraction,
            graph_query_lens=graph_query_lens,
            max_batch_size=max_batch_size,
            decode_ahead=decode_ahead,
            decode_ahead_max_batch=decode_ahead_max_batch,
            synthetic_acceptance=synthetic_acceptance,
        )

    @classmethod
    def for_model(
        cls,
        model: LlamaModel,
        *,
        num_pages: int | None = None,
        page_size: int = 16,
        kv_memory_fraction: float = 0.8,
        graph_query_lens: tuple[int, ...] = GRAPH_QUERY_LENS,
        max_batch_size: int = 64,
        decode_ahead: bool = False,
        decode_ahead_max_batch: int = 64,
        synthetic_acceptance: tuple[float, ...] | None = None,
    ) -> VerifierEngine:
        """An engine over a loaded model, its KV pool sized as `load` says, on the model's
        device and in its dtype."""
        config, dtype, device = model.config, model.dtype, model.device
        num_pages = pool_num_pages(
            num_pages,
            device,
            kv_cache_bytes_per_token(config, dtype) * page_size,
            kv_memory_fraction,
            reserve_bytes=graphs_reserve_bytes(config.vocab_size, graph_query_lens, max_batch_size),
        )
        kv = make_kv_cache(
            config, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        log.info(
            "verifier KV cache: %d pages x %d tokens (%.2f GiB)",
            num_pages,
            page_size,
            kv.data.numel() * kv.data.element_size() / 2**30,
        )
        return cls(
            model,
            kv,
            config.max_position_embeddings,
            config.vocab_size,
            graph_query_lens=graph_query_lens,
            max_batch_size=max_batch_size,
            decode_ahead=decode_ahead,
            decode_ahead_max_batch=decode_ahead_max_batch,
            synthetic_acceptance=synthetic_acceptance,
        )

    def warmup(self) -> None:
        """One prefill + one tree round on a throwaway sequence, then release it; then the CUDA
        graphs (on a GPU). Its rounds are not traffic: the decode-ahead counts start after."""
        report, self.on_decode_ahead = self.on_decode_ahead, None
        report_drop, self.on_decode_ahead_dropped = self.on_decode_ahead_dropped, None
        wait, self.on_wait = self.on_wait, None
        try:
            with on_device(self.device):
                warm_up(self)
        finally:
            self.on_decode_ahead, self.on_wait = report, wait
            self.on_decode_ahead_dropped = report_drop
            self.num_ahead_dropped_by.clear()
            self._waiting = None
            self.num_ahead_used = 0
            self.num_next_used = self.num_next_dropped = 0

    # -- the round -------------------------------------------------------------------------

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
            # every sequence has one left)
            step_inputs = [
                decode_step(
                    inputs[i].seq_id,
                    outputs[i].kv_committed_len,
                    outputs[i].bonus_token,
                    inputs[i].sampling,
                    steps=inputs[i].decode_steps - step,
                )
                for i in more
            ]
            try:
                # their lengths are the engine's, their tokens the target's, their sampling
                # the round's (validated), their context checked above: no checks again
                step_round = self._launch_round(step_inputs, validated=True)
            except ServiceError as e:  # nothing of the step happened: the round ends here
                if e.code != Code.RESOURCE_EXHAUSTED:
                    raise
                break
            self.top_up(step_round)  # (on a GPU, while the device runs the step)
            stepped = self._finish_round(step_round, further=True)
            device_ns += step_round.device_ns
            for i, out in zip(more, stepped, strict=True):
                outputs[i].decoded_tokens.append(outputs[i].bonus_token)
                outputs[i].bonus_token = out.bonus_token
                outputs[i].kv_committed_len = out.kv_committed_len
        return device_ns

    @torch.inference_mode()
    def _launch_round(self, inputs: list[VerifyInput], validated: bool = False) -> VerifyRound:
        """A round queued on the device. validated: `inputs` need no checks (a round's further
        decode steps, built here from what the engine committed). Where every one of `inputs`
        has a step left (decode_steps > 1), the next step is the round's own: it runs ahead at
        any batch size."""
        started_ns = time.perf_counter_ns()
        if not validated:
            self._validate(inputs)
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
        running_ahead = self.decode_ahead and not (self._in_flight or hinted or drafting_ahead)
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
        return VerifyRound(inputs, [*positions, *others], parts, ahead)

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
            for item, out in zip(ahead.inputs, results[: len(ahead.inputs)], strict=True):
                item.pending_tokens = [out.bonus_token]
        self._ahead = ahead
        launched.device_ns = sum(part.device_ns() for part in launched.parts)
        if len(launched.parts) == 1:  # (its order is the round's)
            return results
        by_position = dict(zip(launched.order, results, strict=True))
        return [by_position[i] for i in range(len(launched.inputs))]
