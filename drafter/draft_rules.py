"""The drafter's logit rules: a request's bias and penalties (`DraftRules`, sent with a Draft when
they change) bent into its drafts' logits, so that the drafts follow the distribution the
verifier accepts from (it bends the target's logits by the same rules; specsplit/logit_rules.py).
Unbent, a repetition penalty of 1.3 cut the shipped EAGLE head's tokens a round from 1.81 to 1.25
(bench/RESULTS.md): the head kept proposing the tokens the penalty pushed down.

`RuleTables` keeps each sequence's rows on the device over the columns the drafter's forwards
score (an EAGLE head's draft vocabulary, or the target's): its bias (the stop tokens -inf while
min_tokens holds them back), its output's counts and its prompt's tokens (for a repetition
penalty), and per slot (repetition, presence, frequency). The output is counted from the tokens
the drafter holds (the gateway's), only what changed since the last round: those count changes
cross to the device with the round's first expansion that bends (in its metadata's one copy,
`RuleRun`) and its run counts them in before its first step, inside its graph; a call that runs
none counts them in at its end (`flush`).
`bend` applies them in `bend_row`'s order (bias, repetition, presence and frequency) over a
step's rows, each row reading its sequence's slot (one Triton launch on a GPU,
specsplit/kernels/draft_bend.py): the device expansion runs it in its CUDA graphs
(drafter/expansion_steps.py), the rows' slots crossing with the run's metadata. Drafts need
not be exact: a tree's own nodes are not counted in below them, min_tokens is judged at the
root, min_p is not applied.

A guide's masks are the gateway's (its automaton's state after each drafted token is not known
here), but each Draft of a guided sequence carries the tokens it allows at the root
(`DraftJob.root_allowed`): the `root` row (-inf where not allowed) bends the root's logits
alone, so the first drafts keep to the guide (regex 1.31 -> 1.55 tokens a round,
bench/RESULTS.md). The round's masks reach their rows in one copy and one launch
(`write_roots`).

The host expansion (the device expansion's reference) bends its rows by the verifier's reference
instead: `bend_row` of the rules `host_rules` makes from the tokens afresh (`bend_on_host`).

The tables have a fixed number of slots (a captured graph reads them where they lie); a sequence
that finds none free drafts unbent (still lossless) until one is. Slot 0 stays neutral: the rows
of the sequences without rules in a round that bends."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from drafter.types import DraftJob, DraftSeq
from specsplit.kernels.draft_bend import DraftTables, bend_drafts, write_roots
from specsplit.logit_rules import Allowed, LogitRules, Penalties, bend_row, start_context
from specsplit.messages import DraftRules

# sequences with rules a drafter bends for at once (2 x the graphs' largest batch bucket)
RULE_SLOTS = 128
NO_DELTAS = np.zeros((2, 0), dtype=np.int32)  # (shared: read-only)
NO_DELTAS.setflags(write=False)


@dataclass(eq=False)
class SeqRules:
    """A sequence's rows in a RuleTables: its `slot`, the `rules` they hold, the output tokens
    counted in (`counted`, the tokens from rules.output_start) and whether the stop tokens are
    held back (min_tokens)."""

    slot: int
    rules: DraftRules | None  # None: a guide's root masks alone
    counted: list[int] = field(default_factory=list)
    held: bool = False
    masked: bool = False  # the root row holds a guide's mask


class RuleTables:
    """[slots, columns] tables on one device (see the module's docstring): `bias` (float32),
    `counts` (float32), `prompt` (bool), `root` (float32: a guide's root mask, 0 or -inf) and
    `params` [slots, 3] (repetition, presence, frequency).
    `scored_ids`: the target id of each column (ascending), None: the target's vocabulary."""

    def __init__(
        self,
        vocab_size: int,
        scored_ids: torch.Tensor | None,
        device: torch.device,
        slots: int = RULE_SLOTS,
    ) -> None:
        columns = vocab_size if scored_ids is None else scored_ids.shape[0]
        self.col_of = np.arange(vocab_size, dtype=np.int64)  # target id -> column (-1: none)
        if scored_ids is not None:
            self.col_of[:] = -1
            self.col_of[scored_ids.cpu().numpy()] = np.arange(columns)
        self.device = device
        self.bias = torch.zeros(slots + 1, columns, device=device)
        self.counts = torch.zeros(slots + 1, columns, device=device)
        self.prompt = torch.zeros(slots + 1, columns, dtype=torch.bool, device=device)
        self.root = torch.zeros(slots + 1, columns, device=device)
        self.params = torch.tensor([[1.0, 0.0, 0.0]], device=device).repeat(slots + 1, 1)
        self.tables = DraftTables(self.bias, self.counts, self.prompt, self.root, self.params)
        # each column's target id's mask word and bit (a guide's root mask unpacked on the device)
        ids = torch.arange(vocab_size) if scored_ids is None else scored_ids.cpu()
        self.word_of = (ids // 32).to(device)
        self.bit_of = (ids % 32).to(device=device, dtype=torch.int32)
        self._free = list(range(1, slots + 1))  # a heap: the lowest free slot goes out first
        self._pending = NO_DELTAS  # count changes [2, n] not yet counted in (`deltas`)

    @property
    def nbytes(self) -> int:
        """The tables' device memory (fixed once made)."""
        return sum(t.numel() * t.element_size() for t in self.tables)

    @property
    def num_used(self) -> int:
        return len(self.params) - 1 - len(self._free)

    def take(self, jobs: list[DraftJob]) -> None:
        """Each job's `rule_slot` (0: its sequence has no rules, or no slot was free), its rows
        brought up to date with its sequence's tokens and rules, and every job's `bent`: whether
        any of them bends (the round's expansion then reads the slots). The output's count
        changes stay pending: the round's first expansion that bends counts them in on the
        device (`deltas`, `count_in`: they cross with its metadata), else `flush` does."""
        self.flush()  # (a take not followed by a run, as tests do)
        slots: list[int] = []
        tokens: list[int] = []
        deltas: list[int] = []
        for job in jobs:
            job.rule_slot = self._update(job, slots, tokens, deltas)
        if tokens:
            columns = self.col_of[np.array(tokens, dtype=np.int64)]
            scored = columns >= 0
            flat = np.array(slots, dtype=np.int64)[scored] * self.counts.shape[1]
            pairs = np.stack([flat + columns[scored], np.array(deltas)[scored]])
            self._pending = pairs.astype(np.int32)  # (none were pending: flushed above)
        self._write_roots([job for job in jobs if job.rule_slot])
        bent = any(job.rule_slot for job in jobs)
        for job in jobs:
            job.bent = bent

    def deltas(self, capacity: int) -> np.ndarray:
        """The pending count changes [2, n] int32 (flat index into `counts`, +-1) for a run that
        counts them in (`count_in`), at most `capacity` of them: where more are pending they
        are counted in here (`flush`) and none are handed out."""
        if self._pending.shape[1] > capacity:
            self.flush()
        pending, self._pending = self._pending, NO_DELTAS
        return pending

    def count_in(self, deltas: torch.Tensor) -> None:
        """A run's count changes [2, capacity] int32 on the device (`deltas`' handed out, zero
        after: slot 0's first column gains 0) added into `counts`: whole numbers, exact in any
        order; no host syncs (a graph captures it)."""
        self.counts.view(-1).index_add_(0, deltas[0].long(), deltas[1].float())

    def flush(self) -> None:
        """Count in what no run took (a round that bent no device expansion): one copy and one
        atomic kernel (index_put_'s accumulate sorts first, a dozen launches)."""
        if self._pending.shape[1]:
            pending, self._pending = self._pending, NO_DELTAS
            self.count_in(self._to_device(pending))

    def release(self, seq: DraftSeq) -> None:
        """Give the sequence's slot back (released, or its rules ended)."""
        held = seq.rule_rows
        if isinstance(held, SeqRules):
            heapq.heappush(self._free, held.slot)
        seq.rule_rows = None

    def bend(self, logits: torch.Tensor, slots: torch.Tensor, root: bool = False) -> torch.Tensor:
        """logits [R, columns] float32 bent by the rows of `slots` [R] int64 (slot 0: as they
        are), as `bend_row` orders the rules; `root`: the roots' rows, which a guide's root mask
        bends too. One Triton launch on a GPU (specsplit/kernels/draft_bend.py), torch's ops
        elsewhere; no host syncs (a graph captures either)."""
        return bend_drafts(logits, slots, self.tables, root)

    def _update(self, job: DraftJob, slots: list[int], tokens: list[int], deltas: list[int]) -> int:
        """The job's sequence's slot (0: none), its rows filled where its rules changed, else its
        output's changes since the last round listed (each token's slot, the token, its count's
        change; tokens before `job.start` are as they were counted)."""
        seq, start = job.seq, job.start
        rules = seq.rules
        held = seq.rule_rows
        if rules is None and not job.root_allowed:
            if held is not None:
                self.release(seq)
            return 0
        if not isinstance(held, SeqRules) or (held.rules is not rules and held.rules != rules):
            if held is not None:
                self.release(seq)
            if not self._free:
                return 0  # (drafts unbent until a slot is free)
            held = SeqRules(heapq.heappop(self._free), rules)
            seq.rule_rows = held
            self._fill(held, seq.tokens)
            start = 0  # (every output token counts)
        if rules is None:
            return held.slot
        counted, first, every = held.counted, rules.output_start, seq.tokens
        # the output's tokens from `start` on may differ from those counted: find where they do
        keep = max(min(start - first, len(counted)), 0)
        end = min(len(counted), len(every) - first)
        while keep < end and counted[keep] == every[first + keep]:
            keep += 1
        gone, added = counted[keep:], every[first + keep :]
        del counted[keep:]
        counted += added
        slots += [held.slot] * (len(gone) + len(added))
        tokens += gone + added
        deltas += [-1] * len(gone) + [1] * len(added)
        penalties = rules.penalties
        stops = len(counted) < penalties.min_tokens and bool(penalties.stop_ids)
        if stops != held.held:
            self._write_stops(held, stops)
        return held.slot

    def _fill(self, held: SeqRules, tokens: list[int]) -> None:
        """The slot's rows for `held.rules` before any output is counted: its bias, its prompt's
        tokens (with a repetition penalty), its params; counts and the root row zero (no rules:
        all of them neutral)."""
        slot = held.slot
        for table in (self.bias, self.counts, self.prompt, self.root):
            table[slot].zero_()
        held.masked = False
        p = Penalties() if held.rules is None else held.rules.penalties
        self.params[slot] = torch.tensor([p.repetition, p.presence, p.frequency])
        if p.bias:
            ids, values = p.bias_arrays
            self._write(self.bias, slot, ids, torch.tensor(values, dtype=torch.float32))
        if p.repetition != 1 and held.rules is not None:
            prompt = np.unique(np.array(tokens[: held.rules.output_start], dtype=np.int64))
            self._write(self.prompt, slot, prompt, torch.tensor(True))
        held.held = False

    def _write_roots(self, jobs: list[DraftJob]) -> None:
        """The jobs' slots' root rows: each job's guide mask unpacked on the device (-inf where
        a token is not allowed), or zero where it has none this round and had one; one table
        (slot, masked, the mask's words a row) in one copy, one launch on a GPU
        (specsplit/kernels/draft_bend.py's `write_roots`)."""
        rows: list[tuple[int, bytes | None]] = []  # (slot, mask words; None: cleared)
        for job in jobs:
            held = job.seq.rule_rows
            assert isinstance(held, SeqRules)
            if job.root_allowed:
                rows.append((job.rule_slot, job.root_allowed))
            elif held.masked:
                rows.append((held.slot, None))
            held.masked = bool(job.root_allowed)
        if not rows:
            return
        words = max((len(mask) // 4 for _, mask in rows if mask is not None), default=0)
        table = np.zeros((len(rows), 2 + words), dtype=np.int32)
        for r, (slot, mask) in enumerate(rows):
            table[r, 0] = slot
            if mask is not None:
                table[r, 1] = 1
                table[r, 2:] = np.frombuffer(mask, dtype="<u4").view(np.int32)
        write_roots(self.root, self._to_device(table), self.word_of, self.bit_of)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the tables' device: through pinned memory and not waited for on a GPU
        (the caching host allocator keeps the block until the copy is done)."""
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _write_stops(self, held: SeqRules, stops: bool) -> None:
        """The stop tokens' bias: -inf while min_tokens holds them back, else their own bias."""
        assert held.rules is not None
        p = held.rules.penalties
        ids = np.array(p.stop_ids, dtype=np.int64)
        own = dict(p.bias)
        values = [-np.inf if stops else own.get(int(t), 0.0) for t in ids]
        self._write(self.bias, held.slot, ids, torch.tensor(values, dtype=torch.float32))
        held.held = stops

    def _write(self, table: torch.Tensor, slot: int, ids: np.ndarray, values: torch.Tensor) -> None:
        """table[slot, the columns of `ids`] = values (ids outside the columns left out)."""
        columns = self.col_of[ids]
        scored = columns >= 0
        if not scored.any():
            return
        if values.dim():
            values = values[torch.from_numpy(scored)]
        index = torch.from_numpy(columns[scored]).to(self.device)
        table[slot].index_put_((index,), values.to(self.device, table.dtype))


def host_rules(seq: DraftSeq) -> LogitRules:
    """The rules `seq`'s drafts are bent by, as the gateway makes a round's: `start_context` of
    its prompt (the tokens before its rules' output_start), then `after` its output (through the
    root), made afresh; none (a guide's root masks alone): no rules."""
    rules = seq.rules
    if rules is None:
        return LogitRules(Penalties())
    start = rules.output_start
    context = start_context(rules.penalties, seq.tokens[:start])
    assert context is not None
    return context.after(seq.tokens[start:])


def bend_on_host(
    logits: torch.Tensor, jobs: list[DraftJob], starts: list[int], root: bool = False
) -> torch.Tensor:
    """The host expansion's rows (job i's rows from starts[i] to starts[i + 1]) bent where the
    job's sequence holds a rule slot, each by `bend_row` in float32 (the device's `bend` is
    held to it; `root`: the roots' rows, which a guide's root mask bends too); the logits
    themselves where none does."""
    if not any(job.rule_slot for job in jobs):
        return logits
    bent = logits.clone()
    for i, job in enumerate(jobs):
        if job.rule_slot:
            rules = host_rules(job.seq)
            if root and job.root_allowed:
                rules = rules.with_allowed(Allowed(job.root_allowed, (0,)))
            for row in range(starts[i], starts[i + 1]):
                bent[row] = bend_row(logits[row].float(), rules, [])
    return bent
