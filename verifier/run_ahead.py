"""The verifier's rounds run before they are asked for (`RunAhead`, a mixin of VerifierEngine that
declares what it uses of it): the next decode step after a round of decode steps
(`_launch_ahead`) and after a round's last step the steps behind it that the trip between
rounds needs (`_extend_ahead`, verifier/ahead_depth.py), the round the gateway's hint names once
its round finished (`hint_next`, `launch_parked`, `_launch_next`) or chained on the device
behind the round in flight (`_chain`, verifier/chain.py), and how the next round takes such a
round (`_take_ahead`), or drops it and gives back its room and draws (`_drop_ahead`,
`_undo_ahead`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from specsplit.errors import ServiceError
from specsplit.kv_cache import KVCache
from specsplit.messages import NextTrees, VerifyInput, VerifyOutput
from specsplit.model.transfer import on_device
from specsplit.step import page_tables
from specsplit.tree import DraftTree
from verifier.ahead_depth import AheadDepth
from verifier.chain import chain_inputs, chainable, joined_results
from verifier.chain_gate import ChainGate
from verifier.hints import HintBook
from verifier.rounds import (
    UNKNOWN_TOKEN,
    Launched,
    VerifierSeq,
    VerifyRound,
    committed_as,
    decode_step,
    is_step,
)

log = logging.getLogger(__name__)


class RunAhead:
    # the engine's, which these rounds use
    seqs: dict[str, VerifierSeq]
    kv: KVCache
    device: torch.device
    max_context: int
    hints: HintBook
    launch_on_hint: bool
    chain_rounds: bool
    chain_gate: ChainGate
    chain_max_batch: int
    chain_min_guess_rate: float
    decode_ahead_max_batch: int
    ahead_depth: AheadDepth
    num_ahead_used: int
    num_ahead_dropped: int
    num_next_used: int
    num_next_dropped: int
    on_decode_ahead: Callable[[str], None] | None
    on_round_ahead: Callable[[str], None] | None
    _ahead: Launched | None
    _in_flight: list[VerifyRound]
    _held: dict[str, int]
    _finished_ns: int
    _validate: Callable[[list[VerifyInput]], None]
    _reserve: Callable[[list[VerifyInput], list[VerifierSeq]], None]
    _launch: Callable[..., Launched]
    _report_gap: Callable[[str, int], None]
    _end_wait: Callable[[Iterable[str]], None]

    def hint_next(self, hints: list[NextTrees]) -> None:
        """The gateway's hints for rounds in flight (NextTrees): kept by sequence until the
        round they name finishes (`finish` launches the next round on them) or the sequence
        is released or truncated. With `launch_on_hint` a hint for the round in flight chains
        the next round on the device behind it (`_chain`; with chain_rounds, for a round of at
        most chain_max_batch sequences while the hints guess well, `_guessing`, the GPU still
        runs it, `_still_running`, and chaining pays, `chain_gate`: else it launches after the
        answer), and one for the round that finished last launches the next round here when
        none has started since; else only stores them (one dict entry each), so it may be
        called while a round runs on another thread, and a hint for a round already finished
        is never used."""
        kept = self.hints.store(hints, self.seqs)
        if self.launch_on_hint and self.chain_rounds and len(self._in_flight) == 1:
            launched = self._in_flight[0]
            if (
                len(launched.inputs) <= self.chain_max_batch
                and self._guessing()
                and self._still_running(launched)
                and self.chain_gate.pays()
            ):
                started = time.perf_counter_ns()  # (else launched after the answer)
                with on_device(self.device):
                    if self._chain(launched):
                        host_ns = time.perf_counter_ns() - started
                        self.chain_gate.chained(host_ns)
                        self._report_gap("chain", host_ns)
            return
        self._launch_finished(kept, "hint")

    def _still_running(self, launched: VerifyRound) -> bool:
        """Whether the GPU is not yet done with the round in flight. A round it is done with is
        answered first and its hinted round launched after the answer (`launch_parked`):
        chained, the chain's host work (~1.5 ms at batch 1 on an H100 host, more than a plain
        launch's) would hold the answer back and start the next round no sooner. That is the
        case where the drafter's draft-ahead call outlasts the verify (SmolLM2 and its head).
        On the CPU a round is done when launched (no device queue): it chains there (the
        tests' reference path)."""
        return self.device.type != "cuda" or not launched.ready()

    def _guessing(self) -> bool:
        """Whether the hints guess outcomes often enough to chain on them: a chained round
        whose outcome the hint missed (and does not run plain: a miss run plain is placed as
        the plain round, verifier/chain.py) is dropped after the device ran it (a whole round's
        device time lost), where a round launched after the answer runs only for an outcome
        guessed (or a miss run plain). Unknown before the first rounds: not yet, unless
        chain_min_guess_rate is 0."""
        if self.chain_min_guess_rate <= 0:
            return True
        rate = self.hints.guess_rate()
        return rate is not None and rate >= self.chain_min_guess_rate

    def launch_parked(self) -> None:
        """With launch_on_hint: the next rounds of the sequences of the round finished last
        that have their hint, once its answer went out (none if a round started since)."""
        self._launch_finished(self.hints.waiting(), "answer")

    def _launch_finished(self, seq_ids: list[str], waited: str) -> None:
        """The hinted next rounds of `seq_ids` among the round finished last, if no round has
        started since (`hints.finished`). waited: what the launch waited for since that finish,
        its gap phase: "answer" (the hints had come: the answer went out first) or "hint"
        (launched as the hints came, after the finish)."""
        if not self.hints.finished or self._ahead is not None or self._in_flight:
            return
        late = self.hints.ready(seq_ids)
        if late:  # their round finished before now, and none has started since
            started = time.perf_counter_ns()
            self._report_gap(waited, started - self._finished_ns)
            with on_device(self.device):
                self._ahead = self._launch_next([i for i, _ in late], [o for _, o in late])
            launched = [] if self._ahead is None else self._ahead.inputs
            self._report_gap("launch", time.perf_counter_ns() - started)
            self._end_wait(item.seq_id for item in launched)  # the device has work again

    def _launch_ahead(
        self, parts: list[Launched], bonus: list[torch.Tensor], capped: bool = True
    ) -> Launched | None:
        """After a round of decode steps (every sequence: no tree, no hidden states; launched
        as `parts`, one or two, whose bonus tokens on the device are `bonus`), the same
        sequences' next decode step, launched before the round is waited for: the round the
        gateway sends next when it goes on decoding them all (each bonus token its one pending
        token, the same sampling). A decode round's commit is known before its tokens are (its
        pending tokens, no drafts): the step is built on the KV lengths that commit makes, and
        each bonus token goes to it device to device (`_finish_round` writes them into its inputs
        once known). On a GPU it runs back to back with the round while the host commits,
        answers and the gateway works; `_take_ahead` keeps it only for the next round's items
        that are exactly that step, so it changes no output (a sampled step draws from each
        sequence's generator, whose state `_undo_ahead` puts back where it is not taken).
        None when this round does not qualify or the next step would not fit (context, free
        pages). `capped`: none for more than decode_ahead_max_batch sequences (the next round
        is the gateway's, which may be another; not when it is the round's own further step,
        which always takes it)."""
        done_inputs = [item for part in parts for item in part.inputs]
        done_seqs = [seq for part in parts for seq in part.seqs]
        if capped and len(done_inputs) > self.decode_ahead_max_batch:
            return None
        for item in done_inputs:
            if item.tree or item.hidden_state_layers:
                return None
        # as the round's commit leaves them (the round's items' lengths: a step run ahead's
        # are past its sequences' committed lengths until the rounds before it commit)
        committed = [item.kv_committed_len + len(item.pending_tokens) for item in done_inputs]
        if any(length + 1 > self.max_context for length in committed):
            return None
        inputs = [
            decode_step(item.seq_id, length, UNKNOWN_TOKEN, item.sampling)
            for item, length in zip(done_inputs, committed, strict=True)
        ]
        tokens = bonus[0] if len(bonus) == 1 else torch.cat(bonus)
        states = [None if seq.generator is None else seq.generator.get_state() for seq in done_seqs]
        with committed_as(done_seqs, committed):  # as the round's commit leaves them
            try:
                self._reserve(inputs, done_seqs)
            except ServiceError:  # no free pages for it: nothing runs ahead
                return None
            try:
                launched = self._launch(inputs, done_seqs, tokens)
            except Exception:  # the round itself goes on: its answer must still go out
                log.exception("a decode step run ahead failed to launch")
                self._undo_ahead(Launched(inputs, done_seqs, torch.empty(0), None, states))
                return None
        launched.generator_states = states
        return launched

    def extend_ahead(self) -> bool:
        """Once a round's answer went out (the service's `PipelinedRounds`): queue one more
        decode step behind the one run ahead if fewer than `ahead_depth` are
        (`_extend_ahead`), while the answer travels and the gateway works. One a call, so that
        a request arriving meanwhile waits for one launch at most (the caller calls again on
        its event loop's next turn). Whether another is wanted. Nothing to do at depth 1 (the
        default)."""
        ahead = self._ahead
        if ahead is None or ahead.hinted or self._in_flight or self.ahead_depth.fixed == 1:
            return False
        with torch.inference_mode(), on_device(self.device):
            return self._extend_ahead(ahead, self.ahead_depth.depth(len(ahead.inputs)))

    def _extend_ahead(self, ahead: Launched, depth: int) -> bool:
        """One decode step behind the last of `ahead` (the next round's first, run ahead) and
        those queued behind it if fewer than `depth` are, launched on the one before's bonus
        tokens on the device (`Launched.follower`): the next round takes them in turn, as its
        first step and its own further steps (or, a round of one step, as the step after it).
        The one before keeps its results in a copy of its own (the steps replay one CUDA graph,
        whose output each overwrites): a round that takes it but not the steps behind reads
        them there. Whether more are wanted."""
        last, queued = ahead, 1
        while last.follower is not None:
            last, queued = last.follower, queued + 1
        if queued >= depth:
            return False
        last.packed = last.packed.clone()
        follower = self._launch_ahead([last], [self._bonus_tokens(last)])
        last.follower = follower
        return follower is not None and queued + 1 < depth

    def _drop_followers(self, ahead: Launched) -> None:
        """Drop the steps queued behind `ahead` (its followers), which itself stays: wait for
        them (as `_drop_ahead`), then give their room back down to `ahead`'s step (the
        committed length + 1) and their draws back (the last launched first)."""
        follower, ahead.follower = ahead.follower, None
        if follower is not None:
            self._drop(follower, room=1)

    @torch.inference_mode()
    def _launch_next(
        self, inputs: list[VerifyInput], outputs: list[VerifyOutput]
    ) -> Launched | None:
        """The rounds the gateway hinted for the sequences of a round just finished (its
        `inputs`, `outputs`), launched before they are asked for: each sequence whose hint
        names this round (`NextTrees.base`), greedy, gets its bonus token as its pending token
        and the tree drafted ahead for its outcome (accepted drafts + bonus), or none when the
        hint runs misses plain; the same hidden-state layers as this round. While the answer
        goes to the gateway and the gateway sends that round, the device runs it (the round
        trip off the verifier's path); `_take_ahead` keeps it for the next round's items that
        are exactly it (it changes no output), and drops it otherwise. None when no sequence
        qualifies or the rounds are refused (checks, context, free pages). Reads the inputs'
        ids only: the outputs' may have been renamed since (the service's scopes)."""
        items, seqs = [], []
        for item, out in zip(inputs, outputs, strict=True):
            seq = self.seqs.get(item.seq_id)
            if seq is None or not item.sampling.greedy:
                self.hints.next.pop(item.seq_id, None)
                continue
            # with launch_on_hint a round with no hint yet waits for it (before the next round)
            tree = self.hints.next_tree(item, out, park=self.launch_on_hint)
            if tree is None:
                continue
            items.append(
                VerifyInput(
                    item.seq_id,
                    False,
                    out.kv_committed_len,
                    [out.bonus_token],
                    tree,
                    item.sampling,
                    item.hidden_state_layers,
                )
            )
            seqs.append(seq)
        if not items:
            return None
        states = [None if seq.generator is None else seq.generator.get_state() for seq in seqs]
        try:
            self._validate(items)  # a hint's trees come from the network: checked as a round's
            self._reserve(items, seqs)
        except ServiceError:
            self.hints.not_ahead([item.seq_id for item in items], "refused")
            return None
        try:
            launched = self._launch(items, seqs)
        except Exception:  # the round just finished is answered all the same
            log.exception("a round run ahead on the gateway's hint failed to launch")
            self._undo_ahead(Launched(items, seqs, torch.empty(0), None, states))
            return None
        launched.generator_states = states
        launched.hinted = True
        return launched

    @torch.inference_mode()
    def _chain(self, launched: VerifyRound) -> bool:
        """The hinted next round of the round in flight (`launched`), chained on the device
        behind it (verifier/chain.py) when every sequence of it has a hint for it whose trees
        share one shape (all the sequences' of one size) and nothing else is queued behind it:
        its room reserved for the round's tree accepted to its deepest node, built for that
        outcome and placed on the outcomes that came by two kernels that run between the two
        rounds (specsplit/kernels/place_chain.py). Whether it was."""
        if self._ahead is not None or launched.ahead is not None or launched.chained is not None:
            return False
        rounds = [item for part in launched.parts for item in part.inputs]  # as results come
        hints = [self.hints.next.get(item.seq_id) for item in rounds]
        trees = [chainable(item, hint) for item, hint in zip(rounds, hints, strict=True)]
        if any(tree is None for tree in trees) or len({len(t or ()) for t in trees}) != 1:
            return False
        chain_hints = [hint for hint in hints if hint is not None]
        seqs = [seq for part in launched.parts for seq in part.seqs]
        if any(self.seqs.get(seq.seq_id) is not seq for seq in seqs):
            return False
        # the reference: each sequence's round after its tree's deepest path accepted, the room
        # of any outcome that can come (the hint's longest may be shorter: the gateway leaves
        # out outcomes that would finish the sequence, and a miss is placed by what r accepted)
        items = []
        for item, hint, tree in zip(rounds, chain_hints, trees, strict=True):
            committed = hint.base + max(item.tree.depths(), default=0)
            pending = [hint.trees[0].tokens[-1]]  # (a token in the vocabulary: placed over)
            items.append(
                VerifyInput(item.seq_id, False, committed, pending, tree or DraftTree(),
                            item.sampling, item.hidden_state_layers)
            )  # fmt: skip
        pages = [len(seq.kv.page_table) for seq in seqs]  # the round in flight's room
        states = [None if seq.generator is None else seq.generator.get_state() for seq in seqs]
        chained = None
        try:  # at the lengths that outcome leaves
            with committed_as(seqs, [item.kv_committed_len for item in items]):
                self._validate(items)  # a hint's trees come from the network
                self._reserve(items, seqs)
                table = page_tables([seq.kv for seq in seqs])  # the forward's block table's
                packed = joined_results(launched.parts, self.device)
                chain = chain_inputs(packed, rounds, chain_hints, table, self.kv.page_size)
                chained = self._launch(items, seqs, chain=chain)
        except ServiceError:  # refused: the hint is tried again once the round finishes
            pass
        except Exception:  # the round in flight is answered all the same
            log.exception("a round chained on the gateway's hint failed to launch")
        if chained is None:  # the room it reserved, if any, goes back
            for seq, num_pages in zip(seqs, pages, strict=True):
                self.kv.trim(seq.kv, num_pages * self.kv.page_size)
            return False
        for item, seq in zip(items, seqs, strict=True):
            self._held[item.seq_id] = len(seq.kv.page_table) * self.kv.page_size
        chained.generator_states = states
        chained.hinted = True
        chained.chain_hints = chain_hints
        launched.chained = chained
        return True

    def _bonus_tokens(self, done: Launched) -> torch.Tensor:
        """`done`'s bonus tokens on the device, its inputs' order: a view of its results, or
        for a step taken in part its rows (the index crosses without a wait)."""
        return done.own_results(self.device)[:, 1]

    def _take_ahead(self, inputs: list[VerifyInput]) -> tuple[Launched | None, list[int]]:
        """The decode step launched ahead, for the items of `inputs` (validated) that are that
        step for their sequence: its bonus token and nothing else, the same sampling, no hidden
        states. Returns it (cut to those sequences, in the round's order) and their positions
        in `inputs`; the round's other items (a sequence joining the batch, most often) are
        launched beside it. Sequences of the step the round does not take it for (finished and
        released, or sent another round) get their room and draws back. A round that takes
        none of it drops it: (None, [])."""
        ahead = self._ahead
        if ahead is None:
            return None, []
        index = {item.seq_id: j for j, item in enumerate(ahead.inputs)}
        positions: list[int] = []
        keep: list[int] = []
        for i, item in enumerate(inputs):
            j = index.get(item.seq_id)
            if j is not None and is_step(item, ahead.inputs[j]):
                positions.append(i)
                keep.append(j)
        if not keep:
            self._drop_ahead()
            return None, []
        self._ahead = None
        whole = keep == list(range(len(ahead.inputs)))
        if not whole:  # the steps behind it are for its sequences in its order, not the round's
            self._drop_followers(ahead)
        if len(keep) < len(ahead.inputs):  # (most rounds take the whole step)
            self._undo_ahead(ahead, kept=set(keep))
        self._count_ahead(ahead, "used")
        if whole:
            return ahead, positions
        states = ahead.generator_states or [None] * len(ahead.seqs)
        taken = Launched(
            [ahead.inputs[k] for k in keep], [ahead.seqs[k] for k in keep], ahead.packed,
            ahead.hidden, [states[k] for k in keep], rows=keep, host=ahead.host,
            copied=ahead.copied, hinted=ahead.hinted, whole_inputs=ahead.inputs,
            chain_hints=None if ahead.chain_hints is None else [ahead.chain_hints[k] for k in keep],
        )  # fmt: skip
        return taken, positions

    def _drop_ahead(self) -> None:
        """Forget the decode step run ahead: wait for it (its inputs' host buffers are reused
        by the next launch), then give each of its sequences its room and draws back."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._drop(ahead)

    def _drop(self, step: Launched, room: int = 0) -> None:
        """Count `step` dropped, wait for the device, then undo it and the steps behind it
        (`_undo_ahead`, down to the committed length + `room`)."""
        self._count_ahead(step, "dropped")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._undo_ahead(step, room=room)

    def _count_ahead(self, ahead: Launched, outcome: str) -> None:
        """A round run ahead was taken ("used") or not ("dropped"): a decode step's counts, or
        a hinted round's (`_launch_next`)."""
        if ahead.hinted:
            self.num_next_used += outcome == "used"
            self.num_next_dropped += outcome == "dropped"
            report = self.on_round_ahead
        else:
            self.num_ahead_used += outcome == "used"
            self.num_ahead_dropped += outcome == "dropped"
            report = self.on_decode_ahead
        if report is not None:
            report(outcome)

    def _undo_ahead(self, ahead: Launched, kept: set[int] | None = None, room: int = 0) -> None:
        """Each live sequence's share of a step run ahead not taken (all but the indices
        `kept`), and of the steps queued behind it (`Launched.follower`, undone first, the last
        launched first): free the room they reserved past the committed length + `room` and
        put back the generator state the step drew from. Their K/V writes sit past the
        sequence's committed length, where its next round writes again (stream-ordered on a
        GPU, also into pages freed meanwhile: later steps write after them). A released
        sequence has nothing left to undo."""
        if ahead.follower is not None:
            follower, ahead.follower = ahead.follower, None
            self._count_ahead(follower, "dropped")
            self._undo_ahead(follower, room=room)
        states = ahead.generator_states or [None] * len(ahead.seqs)
        for k, (seq, state) in enumerate(zip(ahead.seqs, states, strict=True)):
            if (kept is not None and k in kept) or self.seqs.get(seq.seq_id) is not seq:
                continue
            self.kv.trim(seq.kv, seq.kv.kv_committed_len + room)
            if state is None:
                seq.generator = None  # the step made it: the next sampled round makes its own
            elif seq.generator is not None:
                seq.generator.set_state(state)
