"""The verifier's sequences and their KV memory (`SeqMemory`, a mixin of VerifierEngine under
`EngineSetup`, over `HintedRounds`, declaring what else it uses of the engine): a round checked
whole before anything changes (`_validate`), its room reserved whole or not at all (`_reserve`),
its new sequences created and its parts launched (`_launch_new`), a session's turn boundary
(`truncate`), release, and the invariants (`check_integrity`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from specsplit.errors import Code, ServiceError
from specsplit.kv_cache import KVPages
from specsplit.lookup import TokenHistory
from specsplit.messages import Truncated, Truncation, VerifyInput, truncate_each
from verifier.hinted_rounds import HintedRounds
from verifier.kept_rules import take_kept_rules
from verifier.lead_in import led_in
from verifier.rounds import Launched, VerifierSeq, validate_round
from verifier.rule_rows import RuleRows, drop_slot


class SeqMemory(HintedRounds, KVPages):
    # the engine's, which these use
    num_layers: int
    vocab_size: int
    in_flight: Callable[[Iterable[str]], bool]
    rule_rows: RuleRows
    lookup_min_ngram: int

    def _validate(self, inputs: list[VerifyInput]) -> None:
        take_kept_rules(inputs, self.seqs)  # (checked when kept)
        validate_round(inputs, self.seqs, self.num_layers, self.vocab_size, self.max_context)

    def _launch_new(self, groups: list[list[VerifyInput]], leads: list[int]) -> list[Launched]:
        """A round's sequences (created on their first round), their room reserved (all of
        them before any launches), launched a group each (`_graph_groups`) after the pending
        tokens each leads in (`leads`, the groups' items in order: `_lead_lens`)."""
        for item in (item for group in groups for item in group):
            if item.begin:
                history = TokenHistory(self.lookup_min_ngram)
                seq = VerifierSeq(item.seq_id, self.kv.new_seq(), history=history)
                self.seqs[item.seq_id] = seq
        seqs = [[self.seqs[item.seq_id] for item in group] for group in groups]
        items, all_seqs = [i for g in groups for i in g], [s for g in seqs for s in g]
        self._reserve(items, all_seqs)
        parts: list[Launched] = []
        try:
            led, started = None, None
            if any(leads):  # (the round's device work starts with them)
                started = self._device_mark()
                led = self._lead_in(items, all_seqs, leads)
            start = 0
            for group, group_seqs in zip(groups, seqs, strict=True):
                if parts:  # copied on the device: the launch beside it may reuse the acceptance
                    parts[-1].packed = parts[-1].packed.clone()  # graph that holds them
                end = start + len(group)
                rounds = [led_in(item, m) for item, m in zip(group, leads[start:end], strict=True)]
                parts.append(self._launch(rounds, group_seqs))
                if led is not None:
                    parts[-1].lead_rows = led[start:end]
                start = end
            if started is not None:
                parts[0].started = started
        except BaseException:  # nothing of the round is committed: nor are its lead-ins
            for seq, item in zip(all_seqs, items, strict=True):
                seq.kv.kv_committed_len = min(seq.kv.kv_committed_len, item.kv_committed_len)
            raise
        return parts

    def _reserve(self, inputs: list[VerifyInput], seqs: list[VerifierSeq]) -> None:
        """Reserve room for pending + tree of every sequence, or nothing at all."""
        kv = self.kv
        new_pages = [
            kv.num_new_pages(
                seq.kv, seq.kv.kv_committed_len + len(item.pending_tokens) + len(item.tree)
            )
            for item, seq in zip(inputs, seqs, strict=True)
        ]
        need = sum(new_pages)
        if need > kv.allocator.num_free:
            for item in inputs:
                if item.begin:
                    del self.seqs[item.seq_id]
            raise ServiceError(
                Code.RESOURCE_EXHAUSTED,
                f"verifier KV cache full: round needs {need} pages, {kv.allocator.num_free} free",
            )
        for seq, num in zip(seqs, new_pages, strict=True):
            kv.add_pages(seq.kv, num)

    def truncate(self, items: list[Truncation]) -> list[Truncated]:
        """A session's turn boundary: keep the KV of at most `max_len` leading tokens of each
        sequence (tokens past a stop point, a turn taken back), free the pages past it, and
        restart its sampling generator (the next turn draws from its own seed) and its logit
        rules (the next turn sends its own)."""
        truncated = {item.seq_id for item in items}
        if self.in_flight(truncated):
            raise RuntimeError("verifier: truncate of a sequence whose round is in flight")
        for seq_id in truncated:
            self.hints.forget(seq_id, released=False)
        if self._ahead is not None and any(s.seq_id in truncated for s in self._ahead.seqs):
            self._drop_ahead("truncated")  # their next rounds start from the new lengths
        truncated_items = truncate_each(items, self.seqs, self._truncate)
        self.rule_rows.trim()  # (their rules' slots given back)
        return truncated_items

    def _truncate(self, seq: VerifierSeq, max_len: int) -> Truncated:
        seq.kv.kv_committed_len = min(seq.kv.kv_committed_len, max_len)
        seq.history.cut(seq.kv.kv_committed_len)
        self.kv.trim(seq.kv, seq.kv.kv_committed_len)
        seq.generator = None
        seq.rules = None
        drop_slot(seq)
        return Truncated(seq.seq_id, True, seq.kv.kv_committed_len, len(seq.kv.page_table))

    def release(self, seq_ids: list[str]) -> int:
        """Free the sequences. A decode step run ahead for some of them stays: the next round
        takes it for the others (`_take_ahead`); one for none left is dropped. Not while a
        round in flight holds one of them (`in_flight`: the caller waits for its finish)."""
        if self.in_flight(seq_ids):
            raise RuntimeError("verifier: release of a sequence whose round is in flight")
        released = 0
        for seq_id in seq_ids:
            self.hints.forget(seq_id, released=True)
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.kv.release(seq.kv)
                drop_slot(seq)
                released += 1
        ahead = self._ahead
        if ahead is not None and all(self.seqs.get(s.seq_id) is not s for s in ahead.seqs):
            self._drop_ahead("released")
        self.rule_rows.trim()
        return released

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert sum(len(s.kv.page_table) for s in self.seqs.values()) == self.kv.allocator.num_used
        assert sum(s.rule_slot is not None for s in self.seqs.values()) == self.rule_rows.num_used
        for seq_id, seq in self.seqs.items():
            assert 0 <= seq.kv.kv_committed_len <= seq.kv.kv_allocated_len, seq_id
