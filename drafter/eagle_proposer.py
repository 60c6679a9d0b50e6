"""EAGLE proposer (EAGLE-3 and EAGLE-1/2 heads): the head's one-layer paged KV and the target's
features, per sequence.

Alignment (both layouts). With tokens x_0..x_{L-1} (x_{L-1} the root) and h_i the target's
features at position i ([feature_width]: the outputs of the head's aux layers side by side, as the
verifier returns them; EAGLE-1/2: the last hidden state after the target's final norm):

    head entry i (RoPE position i, KV storage i) reads  embed(x_{i+1})  and  head.fuse(h_i)
                                                  and predicts x_{i+2}.

The verifier has features for tokens[0 : L - 1] (every token but the root), so entries
0..L-2 exist; entry L-2 reads the root and predicts the first draft token. A tree node at depth d
sits at position L - 2 + d (storage L - 1 + node) and reads embed(its token) and, instead of a
target feature, the head's own layer output at its parent ([H], not fused again).

DraftInput.target_hidden_states rows are the features of new_tokens[0], new_tokens[1], ... (fewer
rows than new tokens: at least the root has none yet). Without features up to x_{L-2} there is
nothing to draft from (the first round, before the verifier's prefill): the tree is empty.

The target's features live in one pool beside the head's KV, a row per KV slot: h_i at the slot
of storage i in the sequence's pages (the pages cover every feature kept, entries or not). A
round appends every sequence's new rows in one scatter and gathers its catch-up's rows in one
index (no per-sequence buffers, copies or concatenation), and the pool's memory is counted with
the KV's when it is sized from the GPU's free memory. A Draft or a draft-ahead call whose
catch-up runs in the device expansion's own run (a graph's replay on a GPU) hands it the round's
new rows instead: they cross with its inputs and it scatters them before the catch-up reads them
(drafter/expansion_inputs.py `PoolRows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.eagle import Eagle3Head, load_eagle3
from drafter.expansion_inputs import PoolRows
from drafter.host_expansion import Expansion
from drafter.tree_draft import DraftKVState, TreeProposer
from drafter.types import DraftJob, DraftSeq
from specsplit.errors import invalid
from specsplit.kv_cache import KVCache, pool_num_pages
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.transfer import HostRows, to_device
from specsplit.step import SeqStep, causal_step


@dataclass
class EagleSeqState(DraftKVState):
    # kv.kv_committed_len = head entries computed (<= len(tokens) - 1); the target's features of
    # tokens[0 : num_features] sit in the proposer's pool at the slots of storage 0..
    # num_features - 1 (the sequence's pages hold them: trimmed to `kept_len`, not below)
    num_features: int = 0

    @property
    def kept_len(self) -> int:
        """Storage the sequence's pages must keep: its entries and its features."""
        return max(self.kv.kv_committed_len, self.num_features)


class Eagle3Proposer(TreeProposer):
    def __init__(self, head: Eagle3Head, kv: KVCache) -> None:
        self.head = head
        self.kv = kv
        self.vocab_size = head.config.vocab_size
        self.max_context = head.config.max_position_embeddings
        self.hidden_state_layers = head.config.aux_layers
        self.feature_width = head.config.feature_width
        self.device = head.device
        self.num_heads = head.config.num_heads
        self.graph_features = (head.config.hidden_size, head.dtype)  # fused rows per token
        ids = head.target_ids  # the draft vocabulary's target ids (None: the target's own)
        if ids is not None and bool((ids[1:] > ids[:-1]).all()):
            self.scored_ids = ids
        self.host_rows = HostRows()  # a round's target features cross in one copy
        # [num_slots, feature_width]: a row per KV slot (the scratch page's too)
        num_slots = kv.scratch_slot + kv.page_size
        self.features = torch.zeros(
            num_slots, self.feature_width, dtype=head.dtype, device=head.device
        )
        self.pool_rows = (self.feature_width, head.dtype)

    @classmethod
    def load(
        cls,
        head_path: str,
        target_path: str,
        *,
        device: str,
        dtype: torch.dtype,
        num_pages: int | None,
        page_size: int,
        kv_memory_fraction: float,
    ) -> Eagle3Proposer:
        """num_pages None: sized by `pool_num_pages` (as ModelProposer.load)."""
        head = load_eagle3(head_path, target_path, dtype, device)
        per_page = cls.bytes_per_page(head, page_size)
        num_pages = pool_num_pages(num_pages, device, per_page, kv_memory_fraction)
        return cls(head, head.make_kv_cache(num_pages, page_size))

    @staticmethod
    def bytes_per_page(head: Eagle3Head, page_size: int) -> int:
        """A page's memory: its slots' head K/V and their feature rows."""
        feature_bytes = head.config.feature_width * head.dtype.itemsize
        return (head.kv_bytes_per_token + feature_bytes) * page_size

    # -- per-sequence state ----------------------------------------------------------------

    def new_state(self, seq: DraftSeq) -> EagleSeqState:
        return EagleSeqState(self.kv.new_seq())

    def _state(self, seq: DraftSeq) -> EagleSeqState:
        state = super()._state(seq)
        assert isinstance(state, EagleSeqState)
        return state

    def truncate(self, seq: DraftSeq, length: int) -> None:
        state = self._state(seq)
        state.num_features = min(state.num_features, length)
        # entry i reads x_{i+1}: keep those with i + 1 < length
        state.kv.kv_committed_len = min(state.kv.kv_committed_len, max(length - 1, 0))
        self.kv.trim(state.kv, state.kept_len)

    def kept_len(self, seq: DraftSeq) -> int:
        return self._state(seq).kept_len

    def feature_rows(self, seq: DraftSeq, start: int, end: int) -> torch.Tensor:
        """[end - start, feature_width] the target's features of tokens[start:end] (a copy)."""
        state = self._state(seq)
        assert 0 <= start <= end <= state.num_features, (start, end, state.num_features)
        slots = to_device(
            torch.tensor(state.kv.slots_of(range(start, end)), dtype=torch.int64), self.device
        )
        return self.features.index_select(0, slots)

    # -- TreeProposer hooks ----------------------------------------------------------------

    def _forward_frontier(self, trees: list[Expansion]) -> torch.Tensor:
        steps = [self._frontier_step(t) for t in trees]
        features = torch.stack(
            [t.node_hidden[t.parents[node]] for t in trees for node in t.frontier]
        )  # [sum f, H]: each node reads its parent's output
        logits, hidden = self._forward_rows(steps, features)  # [sum f, V], [sum f, H]
        assert hidden is not None
        row = 0
        for tree in trees:
            for node in tree.frontier:
                tree.node_hidden[node] = hidden[row]
                row += 1
        return logits

    def _tree_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.target_logits(logits)

    def _step_forward(
        self, batch: ForwardBatch, aux_layers: tuple[int, ...], features: torch.Tensor | None
    ) -> ForwardOutput:
        assert features is not None, "an EAGLE step reads features"
        logits, hidden = self.head.forward(batch, self.kv, features)
        return ForwardOutput(logits=logits, hidden_states=hidden)

    # -- drafting --------------------------------------------------------------------------

    def _take_features(self, jobs: list[DraftJob]) -> PoolRows | None:
        """Each job's target features (rows for tokens[start:]) to append after those kept:
        every job's checked before any job changes, their pages reserved and their sequences'
        feature counts advanced. Returns the rows (in the pool's dtype) and their slots, which
        `_write_rows` (or a device run, `PoolRows`) writes into the pool; None: no rows."""
        given = [
            (job, rows)
            for job in jobs
            if (rows := job.target_hidden_states) is not None and rows.shape[0]
        ]
        for job, rows in given:
            state = self._state(job.seq)
            if rows.dim() != 2 or rows.shape[1] != self.feature_width:
                raise invalid(
                    f"target_hidden_states shape {tuple(rows.shape)} for {job.seq.seq_id!r}: "
                    f"want [rows, {self.feature_width}]"
                )
            if state.num_features != job.start:
                raise invalid(
                    f"target_hidden_states for {job.seq.seq_id!r} start at token {job.start}, "
                    f"the drafter has features up to {state.num_features}"
                )
        if not given:
            return None
        for job, rows in given:  # pages for the rows first: a full pool changes no sequence
            state = self._state(job.seq)
            self.kv.reserve(state.kv, job.start + rows.shape[0])
        slots = []
        for job, rows in given:
            state = self._state(job.seq)
            end = job.start + rows.shape[0]
            slots.append(state.kv.slots_of(range(job.start, end)))
            state.num_features = end
        return PoolRows([rows.to(self.head.dtype) for _, rows in given], slots)

    def _write_rows(self, rows: PoolRows) -> None:
        """The rows into the pool: host rows cross in one copy (`HostRows`)."""
        device = self.head.device
        if all(part.device.type == "cpu" for part in rows.parts):
            flat = self.host_rows.join(rows.parts, device)
        else:
            flat = torch.cat([part.to(device) for part in rows.parts])
        slots = [slot for own in rows.slots for slot in own]
        self._write_pool_rows(to_device(torch.tensor(slots, dtype=torch.int64), device), flat)

    def _write_pool_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.features.index_copy_(0, slots, rows)

    def _root_steps(self, jobs: list[DraftJob]) -> tuple[list[DraftJob], list[SeqStep]]:
        spans = []  # (job, first entry to compute, num_entries, drafts it)
        drafting = []
        # the new rows reach the pool with the forward that first reads them (`unwritten`;
        # every call writes its own before it returns)
        assert self.unwritten is None
        self.unwritten = self._take_features(jobs)
        for job in jobs:
            state = self._state(job.seq)
            tokens = job.seq.tokens
            num_entries = min(state.num_features, len(tokens) - 1)  # entries 0..n-1 possible
            draft = num_entries == len(tokens) - 1 >= 1 and job.spec.num_steps > 0
            first = state.kv.kv_committed_len
            if draft:
                first = min(first, num_entries - 1)  # recompute the root entry for its output
            self.kv.reserve(state.kv, num_entries + (job.scratch_len if draft else 0))
            if first < num_entries:
                spans.append((job, first, num_entries, draft))
            state.kv.kv_committed_len = num_entries
            if draft:
                drafting.append(job)
        starts = self._catch_up_starts([s[1] for s in spans], [s[2] for s in spans])
        steps = []
        for (job, _, end, draft), first in zip(spans, starts, strict=True):
            state = self._state(job.seq)
            q = end - first
            tokens = job.seq.tokens[first + 1 : end + 1]
            logit_rows = [q - 1] if draft else []
            steps.append(causal_step(state.kv, tokens, logit_rows, start=first))
        return drafting, steps

    def _forward_roots(self, steps: list[SeqStep]) -> tuple[torch.Tensor, torch.Tensor | None]:
        # entry i reads h_i: the rows at the catch-up's own slots, in one index
        slots = to_device(
            torch.tensor(
                [s for step in steps for s in step.seq.slots_of(step.storage)], dtype=torch.int64
            ),
            self.device,
        )
        return self._forward_rows(steps, self._fused_rows(slots))  # [D, V], [D, H]

    def _catch_up_features(self, batch: ForwardBatch) -> torch.Tensor:
        """Entry i reads h_i, the row at its own slot."""
        return self._fused_rows(batch.slot_mapping)

    def _fused_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The target's features at `slots` (device int64) through the head's fc: one fc over
        every row."""
        return self.head.fuse(self.features.index_select(0, slots))
