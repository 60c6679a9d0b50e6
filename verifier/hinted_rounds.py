"""The verifier's rounds run on the gateway's hints (`HintedRounds`, a mixin of VerifierEngine
over `RunAhead`, declaring what else it uses of the engine): the round a hint names, launched
once its round finished (`hint_next`, `launch_parked`, `_launch_next`) or chained on the device
behind the round in flight (`_chain`, verifier/chain.py). The next round takes such a round as it
takes a decode step run ahead (`RunAhead._take_ahead`), or drops it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from specsplit.errors import ServiceError
from specsplit.messages import NextTrees, VerifyInput, VerifyOutput
from specsplit.model.transfer import on_device
from specsplit.step import page_tables
from specsplit.tree import DraftTree
from verifier.chain import chain_inputs, chainable, joined_results
from verifier.chain_gate import ChainGate
from verifier.hints import HintBook
from verifier.rounds import Launched, VerifyRound, committed_as, rules_after
from verifier.run_ahead import RunAhead

log = logging.getLogger(__name__)


class HintedRounds(RunAhead):
    # the engine's, which these rounds use
    hints: HintBook
    launch_on_hint: bool
    chain_rounds: bool
    chain_gate: ChainGate
    chain_max_batch: int
    chain_min_guess_rate: float
    _held: dict[str, int]
    _finished_ns: int
    _validate: Callable[[list[VerifyInput]], None]

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

    @torch.inference_mode()
    def _launch_next(
        self, inputs: list[VerifyInput], outputs: list[VerifyOutput]
    ) -> Launched | None:
        """The rounds the gateway hinted for the sequences of a round just finished (its
        `inputs`, `outputs`), launched before they are asked for: each sequence whose hint
        names this round (`NextTrees.base`), greedy, gets its bonus token as its pending token
        and the tree drafted ahead for its outcome (accepted drafts + bonus), or none when the
        hint runs misses plain; the same hidden-state layers as this round, its rules reading the
        outcome. While the answer
        goes to the gateway and the gateway sends that round, the device runs it (the round
        trip off the verifier's path); `_take_ahead` keeps it for the next round's items that
        are exactly it (it changes no output), and drops it otherwise. None when no sequence
        qualifies or the rounds are refused (checks, context, free pages). Reads the inputs'
        ids only: the outputs' may have been renamed since (the service's scopes)."""
        items, seqs = [], []
        for item, out in zip(inputs, outputs, strict=True):
            seq = self.seqs.get(item.seq_id)
            # (a guide's masks for the outcome's round are the gateway's to make)
            if seq is None or not item.sampling.greedy or (item.rules and not item.rules.carried):
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
                    logprobs=item.logprobs,
                    rules=rules_after(item, out),
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
