"""The drafter engine: per-sequence token bookkeeping and validation around a proposer.

The drafter keeps, per sequence, the tokens the gateway has committed (as the gateway last
told it). A Draft call says where the new tokens start: everything before `start` is kept,
the rest is dropped (it no longer matches the gateway's tokens) and the proposer truncates
its KV to match. The proposer then drafts a tree rooted at the last token.

A draft shape the drafter refuses (inconsistent, or over `TreeLimits`) is refused for that
sequence alone: it takes the sequence's new tokens and drafts it an empty tree, and the other
sequences of the round get theirs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from drafter.eagle_proposer import Eagle3Proposer
from drafter.model_proposer import ModelProposer
from drafter.ngram import NgramProposer
from drafter.tree_draft import CATCH_UP_LENS
from drafter.types import DraftJob, DraftSeq, Proposer
from specsplit.errors import Code, ServiceError, check_seq_ids, invalid
from specsplit.kv_cache import KVCacheFullError
from specsplit.logit_rules import Penalties, mask_words, pack_mask
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    DraftRules,
    SpecParams,
    Truncated,
    Truncation,
    truncate_each,
)
from specsplit.model.transfer import pinned_bytes
from specsplit.tree import DraftTree

log = logging.getLogger(__name__)
NO_DRAFTS = SpecParams(num_steps=0, topk=1, num_draft_tokens=0)


@dataclass(frozen=True)
class TreeLimits:
    """The largest draft tree the drafter builds for a sequence (above the gateway's default
    request limits: 16 steps, top-8, 64 nodes)."""

    max_num_steps: int = 32
    max_topk: int = 16
    max_num_draft_tokens: int = 256

    def refusal(self, spec: SpecParams) -> str | None:
        """Why the drafter will not draft this shape, or None."""
        try:
            spec.validate()
        except ServiceError as err:
            return err.message
        for name, value, limit in (
            ("num_steps", spec.num_steps, self.max_num_steps),
            ("topk", spec.topk, self.max_topk),
            ("num_draft_tokens", spec.num_draft_tokens, self.max_num_draft_tokens),
        ):
            if value > limit:
                return f"spec.{name} = {value} is over the drafter's limit of {limit}"
        return None


class DrafterEngine:
    def __init__(
        self,
        proposer: Proposer,
        limits: TreeLimits = TreeLimits(),
        graph_catch_up_lens: tuple[int, ...] = (),
        max_batch_size: int = 64,
    ) -> None:
        """graph_catch_up_lens: on a GPU, warmup() captures CUDA graphs of the draft steps and
        of catch-up steps of these lengths, for batches up to max_batch_size; () = eager."""
        self.proposer = proposer
        self.limits = limits
        self.graph_catch_up_lens = graph_catch_up_lens
        self.max_batch_size = max_batch_size
        self.seqs: dict[str, DraftSeq] = {}
        self._pinned_logged = False  # rows_buffer: logged once
        self._pinned_failed = False  # rows_buffer: an allocation failed, plain memory since

    @classmethod
    def load(
        cls,
        kind: str,
        model_path: str | None,
        *,
        draft_layers: int | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_pages: int | None = None,
        page_size: int = 16,
        kv_memory_fraction: float = 0.8,
        target_path: str | None = None,
        graph_catch_up_lens: tuple[int, ...] = CATCH_UP_LENS,
        max_batch_size: int = 64,
    ) -> DrafterEngine:
        """kind: "model" (a draft checkpoint), "self" (the target's first draft_layers layers),
        "eagle3" (model_path = an EAGLE-3 head, target_path = its target, for the embeddings)
        or "ngram" (prompt lookup, no weights). graph_catch_up_lens, max_batch_size: see
        __init__ (on a GPU).
        num_pages None: the KV pool is `kv_memory_fraction` of the GPU memory free after the
        weights (specsplit.kv_cache.pool_num_pages; 2048 pages on the CPU)."""
        if kind == "ngram":
            return cls(NgramProposer())
        if kind == "eagle3":
            if model_path is None or target_path is None:
                raise ValueError("drafter kind 'eagle3' needs the head path and the target path")
            return cls(
                Eagle3Proposer.load(
                    model_path,
                    target_path,
                    device=device,
                    dtype=dtype,
                    num_pages=num_pages,
                    page_size=page_size,
                    kv_memory_fraction=kv_memory_fraction,
                ),
                graph_catch_up_lens=graph_catch_up_lens,
                max_batch_size=max_batch_size,
            )
        if model_path is None:
            raise ValueError(f"drafter kind {kind!r} needs a model path")
        if kind == "self" and not draft_layers:
            raise ValueError("drafter kind 'self' needs draft_layers > 0")
        layers = draft_layers if kind == "self" else None
        return cls(
            ModelProposer.load(
                model_path,
                num_layers=layers,
                device=device,
                dtype=dtype,
                num_pages=num_pages,
                page_size=page_size,
                kv_memory_fraction=kv_memory_fraction,
            ),
            graph_catch_up_lens=graph_catch_up_lens,
            max_batch_size=max_batch_size,
        )

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the proposer reads (EAGLE-3); empty for the others."""
        return tuple(getattr(self.proposer, "hidden_state_layers", ()))

    @property
    def num_pages_used(self) -> int:
        return self.proposer.num_pages_used

    @property
    def num_pages_free(self) -> int:
        return self.proposer.num_pages_free

    def warmup(self) -> None:
        """A first draft; on a GPU then the attention kernels' variants, the CUDA graphs and a
        rehearsal (bench/drafter_warmup.py times each)."""
        self.first_draft()
        if self.proposer.device.type != "cuda":  # the CPU builds nothing: no time spent there
            return
        self.proposer.warm_up_kernels()
        self.proposer.capture_cuda_graphs(self.graph_catch_up_lens, self.max_batch_size)
        self.rehearse()

    def first_draft(self) -> None:
        """A throwaway sequence's tree, released: the eager path's first run."""
        spec = SpecParams(num_steps=2, topk=2, num_draft_tokens=3)
        self.draft([DraftInput("__warmup__", True, 0, [0, 1, 2], spec)])
        self.release(["__warmup__"])
        self.check_integrity()

    def rehearse(self) -> int:
        """A few rounds as traffic runs them (after the graphs are captured, in inference mode):
        a prefill, catch-ups of one and of several tokens, a second sequence joining, chains and
        trees, with the target's features for an EAGLE head; then a sequence under logit rules
        and a guided one (the root's allowed tokens), whose rounds replay the ruled expansion
        graphs (RULED_SHAPES, captured before). On a GPU this builds what the capture does not:
        the eager steps' compiled kernels for inference tensors, one row and many
        (torch.compile specialises both). (The rules' rounds here did not stop a penalised
        request's first rounds capturing in traffic: that took RULED_SHAPES' shorter chains,
        bench/RESULTS.md.) Returns the draft tokens proposed."""
        width = getattr(self.proposer, "feature_width", None) if self.hidden_state_layers else None
        chain, tree = SpecParams(3, 1, 3), SpecParams(2, 2, 4)
        tokens = {name: list(range(3, 23)) for name in ("a", "c", "d")}
        tokens["b"] = list(range(5, 12))
        # c: under rules from its first round; d: its root's tokens allowed (all) each round
        rules = DraftRules(Penalties(presence=0.5, repetition=1.1), len(tokens["c"]))
        allowed = pack_mask(np.ones(self.proposer.vocab_size, dtype=bool)).tobytes()
        held: dict[str, int] = {}  # tokens the drafter holds (features for EAGLE)
        num_drafted = 0
        rounds = [
            [("a", chain, 0)],
            [("a", chain, 2), ("b", tree, 0)],
            [("a", tree, 1), ("b", chain, 4)],
            [("a", chain, 1)],
            [("c", chain, 0), ("d", chain, 0)],
            [("c", chain, 2), ("d", tree, 1)],
            [("c", tree, 1)],
            [("d", chain, 3)],
        ]
        for batch in rounds:
            inputs = []
            for name, spec, num_new in batch:
                tokens[name] += [9 + i for i in range(num_new)]  # accepted drafts + bonus
                # the root (at least) goes again; EAGLE: from where its features end
                start = min(held.get(name, 0), len(tokens[name]) - 1)
                new_tokens = tokens[name][start:]
                rows = None
                if width is not None:  # features of every new token but the root
                    rows = torch.zeros(len(new_tokens) - 1, width, dtype=torch.bfloat16)
                inputs.append(
                    DraftInput(f"__warmup_{name}__", name not in held, start, new_tokens, spec,
                               target_hidden_states=rows,
                               rules=rules if name == "c" and name not in held else None,
                               root_allowed=allowed if name == "d" else b"")
                )  # fmt: skip
                held[name] = len(tokens[name]) - 1 if width is not None else len(tokens[name])
            num_drafted += sum(len(out.tree) for out in self.draft(inputs))
        self.release([f"__warmup_{name}__" for name in tokens])
        self.check_integrity()
        return num_drafted

    @torch.inference_mode()
    def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        self._validate(inputs)
        jobs = []
        for item in inputs:
            if item.begin:
                seq = DraftSeq(item.seq_id)
                seq.state = self.proposer.new_state(seq)
                self.seqs[item.seq_id] = seq
            seq = self.seqs[item.seq_id]
            if item.rules is not None:  # (rules that change no draft: none; min_p bends none)
                drafted = dataclasses.replace(item.rules.penalties, min_p=0.0)
                seq.rules = item.rules if drafted.active else None
            self.proposer.truncate(seq, item.start)
            seq.tokens[item.start :] = item.new_tokens
            room = self.proposer.max_context - len(seq.tokens)
            jobs.append(
                DraftJob(
                    seq,
                    self._spec(seq, item.spec).capped(room),
                    item.sampling,
                    item.start,
                    item.target_hidden_states,
                    self._verifying(item, room),
                    item.ahead_guesses,
                    root_allowed=item.root_allowed,
                )
            )
        normal = [job for job in jobs if not job.ahead_guesses]
        ahead = [job for job in jobs if job.ahead_guesses]
        try:
            trees = dict(zip(map(id, normal), self.proposer.propose(normal), strict=True))
            if ahead:  # after the others: its scratch (forks) is the larger
                guessed = dict(zip(map(id, ahead), self.proposer.propose_ahead(ahead), strict=True))
        except KVCacheFullError as e:
            raise ServiceError(Code.RESOURCE_EXHAUSTED, f"drafter {e}") from e
        return [
            DraftOutput(
                job.seq.seq_id,
                trees.get(id(job), DraftTree()),
                self.proposer.kv_committed_len(job.seq),
                self.hidden_state_layers,
                guessed[id(job)] if job.ahead_guesses else [],
            )
            for job in jobs
        ]

    @staticmethod
    def _verifying(item: DraftInput, room: int) -> DraftTree | None:
        """The chain to draft ahead for: None without draft-ahead, or where the outcomes'
        trees would pass the context (the chain, the bonus and the next tree's depth)."""
        if not item.ahead_guesses or len(item.verifying) + 1 + item.spec.num_steps > room:
            return None
        return item.verifying

    def _spec(self, seq: DraftSeq, spec: SpecParams) -> SpecParams:
        """The shape to draft for `seq`: `spec`, or no drafts when the drafter refuses it."""
        refusal = self.limits.refusal(spec)
        if refusal is not None and refusal != seq.refused:
            log.warning("no drafts for %s: %s", seq.seq_id, refusal)
        seq.refused = refusal
        return spec if refusal is None else NO_DRAFTS

    def _validate(self, inputs: list[DraftInput]) -> None:
        check_seq_ids(inputs, self.seqs, "drafter")
        for item in inputs:
            known = 0 if item.begin else len(self.seqs[item.seq_id].tokens)
            if not 0 <= item.start <= known:
                raise invalid(
                    f"start = {item.start} for {item.seq_id!r}: the drafter has {known} tokens"
                )
            rows = item.target_hidden_states
            if rows is not None and rows.shape[0] > len(item.new_tokens):
                raise invalid(
                    f"target_hidden_states has {rows.shape[0]} rows for {item.seq_id!r}, "
                    f"more than its {len(item.new_tokens)} new tokens"
                )
            if not item.new_tokens:
                raise invalid(f"new_tokens empty for {item.seq_id!r}: they must end with the root")
            bad = [t for t in item.new_tokens if not 0 <= t < self.proposer.vocab_size]
            if bad:
                raise invalid(f"new_tokens {bad[:4]} outside the vocabulary")
            try:
                item.sampling.validate()
                if item.rules is not None:
                    item.rules.penalties.validate(self.proposer.vocab_size)
            except ValueError as e:
                raise invalid(str(e)) from e
            if item.rules is not None and item.rules.output_start < 0:
                raise invalid(f"rules.output_start = {item.rules.output_start}: want >= 0")
            words = mask_words(self.proposer.vocab_size)
            if item.root_allowed and len(item.root_allowed) != 4 * words:
                raise invalid(
                    f"root_allowed has {len(item.root_allowed)} bytes for {item.seq_id!r}: want "
                    f"{4 * words} (a bit a token of the vocabulary)"
                )
            if not 0 <= item.ahead_guesses <= self.limits.max_topk:
                raise invalid(
                    f"ahead_guesses = {item.ahead_guesses} for {item.seq_id!r}: want 0 (no "
                    f"draft-ahead) to {self.limits.max_topk}"
                )
            if item.ahead_guesses:
                if len(item.verifying) > self.limits.max_num_steps:
                    raise invalid(
                        f"verifying has {len(item.verifying)} nodes for {item.seq_id!r}, over "
                        f"the drafter's limit of {self.limits.max_num_steps}"
                    )
                try:
                    item.verifying.validate(self.proposer.vocab_size)
                except ValueError as e:
                    raise invalid(f"verifying for {item.seq_id!r}: {e}") from e

    def truncate(self, items: list[Truncation]) -> list[Truncated]:
        """A session's turn boundary: keep at most `max_len` leading tokens of each sequence
        (and their KV), and restart the proposer's sampling generator, if it has one (the next
        turn drafts from its own seed). `num_pages` is not counted per sequence here (0)."""
        return truncate_each(items, self.seqs, self._truncate)

    def _truncate(self, seq: DraftSeq, max_len: int) -> Truncated:
        length = min(len(seq.tokens), max_len)
        self.proposer.truncate(seq, length)
        del seq.tokens[length:]
        if getattr(seq.state, "generator", None) is not None:  # tree_draft.DraftKVState
            seq.state.generator = None  # type: ignore[attr-defined]
        return Truncated(seq.seq_id, True, self.proposer.kv_committed_len(seq))

    def rows_buffer(self, num_bytes: int) -> bytearray | memoryview:
        """Host memory for `num_bytes` of a Draft's target features as they are read (the round
        lane's `rows_buffer`): page-locked on a GPU, so that they cross to the device from
        where they landed in one asynchronous copy (`HostRows.join`), not first copied into a
        page-locked buffer (~0.45 ms at batch 32 with an 8B head's rows, bench/draft_step.py
        --phases); plain memory on the CPU, and from the first page-locked allocation that
        fails on (logged: the lane must go on reading)."""
        if self.proposer.device.type != "cuda" or self._pinned_failed:
            return bytearray(num_bytes)
        try:
            buffer = pinned_bytes(num_bytes, self.proposer.device)
        except RuntimeError as err:
            self._pinned_failed = True
            log.warning("drafter: no page-locked memory for the lane's rows (%s): pageable", err)
            return bytearray(num_bytes)
        if not self._pinned_logged:
            self._pinned_logged = True
            log.info("drafter: the round lane reads feature rows into page-locked memory")
        return buffer

    def release(self, seq_ids: list[str]) -> int:
        released = 0
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.proposer.release(seq)
                released += 1
        return released

    def check_integrity(self) -> None:
        self.proposer.check_integrity()
        for seq in self.seqs.values():
            assert self.proposer.kv_committed_len(seq) <= len(seq.tokens), seq.seq_id
