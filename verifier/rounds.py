"""A verify round's pieces on the verifier: a sequence's state (VerifierSeq), a round queued on
the device (Launched: what finishing it needs; VerifyRound: what `VerifierEngine.launch` hands
the caller for `finish`), and the rounds the verifier runs before they are asked for (a decode
step run ahead, a round on the gateway's hint): how they are built (`decode_step`), which round a
hint names (`round_base`) and whether a round asked for is the one run ahead (`is_step`); and
what makes a round's inputs valid (`validate_round`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specsplit.errors import check_seq_ids, invalid
from specsplit.kv_cache import SeqKV
from specsplit.logit_rules import LogitRules
from specsplit.lookup import TokenHistory
from specsplit.messages import (
    MAX_DECODE_STEPS,
    MAX_LOOKUP,
    MAX_TOP_LOGPROBS,
    NO_LOGPROBS,
    NextTrees,
    VerifyInput,
    VerifyOutput,
)
from specsplit.model.transfer import to_device
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from verifier.rule_rows import RuleSlot

UNKNOWN_TOKEN = -1  # a decode step run ahead: its input token while only the device has it


@dataclass
class VerifierSeq:
    seq_id: str
    kv: SeqKV
    generator: torch.Generator | None = None  # created on the first sampled round
    # its next round's logit rules as its last round leaves them (verifier/kept_rules.py)
    rules: LogitRules | None = None
    # its bias, output counts and prompt kept on the device (verifier/rule_rows.py)
    rule_slot: RuleSlot | None = None
    # its tokens as committed, for the prompt lookup of rounds that ask (VerifyInput.lookup)
    history: TokenHistory = field(default_factory=TokenHistory)


@dataclass
class LogprobSlot:
    """Where an asking input's share of RoundLogprobs.values lies."""

    position: int  # the input's position among the round's (a part's: among the part's)
    index: int  # its place among the asking inputs (its bonus token's entry)
    first_node: int  # its tree's first node among the asking inputs' nodes
    first_row: int  # its root's row among the asking inputs' rows (each n + 1)
    asks: int  # the alternatives it asks for (VerifyInput.logprobs)


@dataclass
class RoundLogprobs:
    """A round's log-probabilities, queued (verifier/round_logprobs.py): `values` (on the host
    once the round's results are) holds, flat, the asking inputs' tree nodes' log-probabilities
    (`num_nodes`), then each one's bonus token's (`num_queries` in all), then per asking row its
    top `width` log-probabilities and their token ids ([rows, 2 * width])."""

    values: torch.Tensor  # float32
    slots: list[LogprobSlot]  # the asking inputs'
    num_nodes: int
    num_queries: int
    width: int  # the most alternatives any of them asks for

    def part(self, keep: list[int]) -> RoundLogprobs | None:
        """For the round's inputs at `keep` alone, in that order (`Launched.part`); None where
        none of them asks."""
        by_position = {slot.position: slot for slot in self.slots}
        slots = [
            dataclasses.replace(by_position[old], position=new)
            for new, old in enumerate(keep)
            if old in by_position
        ]
        return dataclasses.replace(self, slots=slots) if slots else None


@dataclass
class PromptRows:
    """A first round's prompt log-probabilities, queued on the device
    (round_logprobs.queue_prompt): each pending token's but the first's, at the row before it,
    and each row's `top` most likely tokens' ([rows, width] values and ids; None: width 0)."""

    chosen: torch.Tensor  # [p - 1] float32
    top: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class Launched:
    """A round queued on the device: what `_finish` needs to commit it."""

    inputs: list[VerifyInput]
    seqs: list[VerifierSeq]
    packed: torch.Tensor  # [>= B, 2 + N] on the device: accepted drafts, bonus, nodes
    hidden: torch.Tensor | None  # the hidden-state rows on the host, valid after the wait
    # a step run ahead: each sequence's generator state before it drew (None: no generator
    # yet), put back when the step is dropped
    generator_states: list[torch.Tensor | None] | None = None
    rows: list[int] | None = None  # the rows of `packed` that are `inputs`' (None: the first)
    hinted: bool = False  # a round run ahead on the gateway's hint (`_launch_next`)
    # a part of a round run ahead (`rows` set): that round's inputs, whose hidden-state rows
    # lie back to back before and between this part's
    whole_inputs: list[VerifyInput] | None = None
    # `packed` on the host: from a GPU a copy queued right after the acceptance (the step run
    # ahead queues its work behind it, and may overwrite `packed`), valid once `copied` is
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    # a round chained on the device behind the round it follows (verifier/chain.py): the hints
    # it was built from, in its inputs' order
    chain_hints: list[NextTrees] | None = None
    # on a GPU: recorded before the round's first device work (after its host building), and
    # the end (`copied`) of the last round launched before it when that one shared a sequence
    # with it: the device's idle time between the two, read once both have run
    # (VerifierEngine.on_idle)
    started: torch.cuda.Event | None = None
    idle_from: torch.cuda.Event | None = None
    # a round's own next decode step launched when its request came, behind the round's first
    # step that ran ahead before the request: the device's idle time before it is the trip
    # between rounds, not a further step's wait for the host (VerifierEngine.on_step_idle)
    on_request: bool = False
    # a decode step run ahead: the next step, launched behind it on its bonus tokens (after a
    # round's last step, as many as the trip between rounds needs: verifier/ahead_depth.py)
    follower: Launched | None = None
    # per input: the hidden-state rows of its pending tokens that led in ahead of the round
    # (verifier/lead_in.py; on the host, before the round's own), None where none did
    lead_rows: list[torch.Tensor | None] | None = None
    # the log-probabilities its inputs ask for (verifier/round_logprobs.py), None: none asks
    logprobs: RoundLogprobs | None = None
    # per input its prompt's log-probabilities on the device (round_logprobs.queue_prompt),
    # None where it asks for none; None: no input asks
    prompt_logprobs: list[PromptRows | None] | None = None

    def result_rows(self) -> list[list[int]]:
        """Every row of the results on the host, a part's whole round's (waits for their copy
        only); `inputs`' own are `rows` of them (all when None)."""
        if self.copied is not None:
            self.copied.synchronize()
        rows: list[list[int]] = (self.packed if self.host is None else self.host).tolist()
        return rows

    def device_ns(self) -> int:
        """Its device time, nanoseconds: from its first work to its results' copy (CUDA events,
        once both have run; 0 off a GPU). A part of a round run ahead counts that round whole."""
        if self.started is None or self.copied is None:
            return 0
        return round(self.started.elapsed_time(self.copied) * 1e6)

    def own_results(self, device: torch.device) -> torch.Tensor:
        """`inputs`' rows of `packed` on the device, in their order: a view, or for a part
        (`rows` set) those rows gathered (the index crosses without a wait)."""
        if self.rows is None:
            return self.packed[: len(self.inputs)]
        return self.packed.index_select(0, to_device(torch.tensor(self.rows), device))

    def part(self, keep: list[int]) -> Launched:
        """This round for its inputs at `keep` alone, in that order (a round that takes a step
        run ahead for some of its sequences): the same results, events and flags, its rows those
        inputs' (a part's part indexes the whole round's), and the steps queued behind it cut
        alike (`follower`: each is the next step of the same sequences, in the same order)."""
        states = self.generator_states
        return Launched(
            [self.inputs[k] for k in keep], [self.seqs[k] for k in keep], self.packed,
            self.hidden, None if states is None else [states[k] for k in keep],
            rows=keep if self.rows is None else [self.rows[k] for k in keep],
            hinted=self.hinted, whole_inputs=self.whole_inputs or self.inputs, host=self.host,
            copied=self.copied,
            chain_hints=None if self.chain_hints is None else [self.chain_hints[k] for k in keep],
            started=self.started, idle_from=self.idle_from, on_request=self.on_request,
            follower=None if self.follower is None else self.follower.part(keep),
            logprobs=None if self.logprobs is None else self.logprobs.part(keep),
        )  # fmt: skip

    def hidden_starts(self, whole: list[list[int]]) -> list[int] | None:
        """Each input's first hidden-state row (None: back to back from row 0): a part's rows
        sit among its whole round's (`whole`: `result_rows`), each asking sequence's pending
        and accepted rows in turn."""
        if self.rows is None or self.whole_inputs is None:
            return None
        starts, row = [], 0
        for item, result in zip(self.whole_inputs, whole, strict=False):
            starts.append(row)
            if item.hidden_state_layers:
                row += len(item.pending_tokens) + result[0]
        return [starts[i] for i in self.rows]


@contextmanager
def committed_as(seqs: list[VerifierSeq], lengths: list[int]) -> Iterator[None]:
    """Each sequence's kv_committed_len as `lengths` inside the block, as it was after: a round
    built on a commit not made yet (the round in flight's, or the outcome guessed for it)."""
    before = [seq.kv.kv_committed_len for seq in seqs]
    for seq, length in zip(seqs, lengths, strict=True):
        seq.kv.kv_committed_len = length
    try:
        yield
    finally:
        for seq, length in zip(seqs, before, strict=True):
            seq.kv.kv_committed_len = length


@dataclass(eq=False)
class VerifyRound:
    """A round `VerifierEngine.launch` queued on the device, for `finish`."""

    inputs: list[VerifyInput]
    order: list[int]  # the position in `inputs` of each result, as `parts` give them
    parts: list[Launched]  # a decode step run ahead taken, and the round's own launch
    ahead: Launched | None  # the next decode step, launched behind this round
    # the next round on the gateway's hint, chained on the device behind this one (`_chain`)
    chained: Launched | None = None
    # once finished: its device time, nanoseconds (its parts' and further decode steps'; 0 off
    # a GPU)
    device_ns: int = 0
    # the sequences whose first step verifies a chain of prompt lookup (VerifyInput.lookup):
    # its accepted drafts go back with the further steps' tokens (the gateway sent no tree)
    looked_up: frozenset[str] = frozenset()

    def ready(self) -> bool:
        """Whether the device is done with the round's results (finish will not wait)."""
        return all(part.copied is None or part.copied.query() for part in self.parts)

    def wait(self) -> None:
        """Until the device is done with the round's results."""
        for part in self.parts:
            if part.copied is not None:
                part.copied.synchronize()


def decode_step(
    seq_id: str,
    kv_committed_len: int,
    token: int,
    sampling: SamplingParams,
    steps: int = 1,
    logprobs: int = NO_LOGPROBS,
    rules: LogitRules | None = None,
    lookup: int = 0,
) -> VerifyInput:
    """A sequence's decode step: its one pending token, no tree, no hidden states; `steps`:
    its decode_steps (a round's further step: the steps left of that round, itself included);
    `logprobs`: as the round's (VerifyInput.logprobs); `rules`: the step's (its output so far
    through `token`); `lookup`: as the round's (VerifyInput.lookup)."""
    return VerifyInput(
        seq_id, False, kv_committed_len, [token], DraftTree(), sampling, decode_steps=steps,
        logprobs=logprobs, rules=rules, lookup=lookup,
    )  # fmt: skip


def rules_after(item: VerifyInput, out: VerifyOutput) -> LogitRules | None:
    """The rules of the round after `item`'s (its further decode step, a hinted round): its
    rules, reading what `out` appended."""
    return None if item.rules is None else item.rules.after(out.new_tokens)


def one_tree_shape(inputs: list[VerifyInput]) -> bool:
    """Whether every item has one pending token and a tree, all of one shape (the same
    parents): its forward batch is `same_tree_batch`'s."""
    parents = inputs[0].tree.parents
    return bool(parents) and all(
        len(item.pending_tokens) == 1 and item.tree.parents == parents for item in inputs
    )


def round_base(out: VerifyOutput) -> int:
    """The round `out` answers, as a hint names it (NextTrees.base): its sequence's length
    before the round's accepted tokens (committed tokens + its pending ones)."""
    return out.kv_committed_len - len(out.accepted_tokens)


def is_step(item: VerifyInput, guess: VerifyInput) -> bool:
    """Whether a round's `item` is the round run ahead as `guess` (a decode step, or a hinted
    round: the same tree, no draft probabilities, the same hidden-state layers)."""
    return (
        not item.begin
        and item.seq_id == guess.seq_id
        and item.kv_committed_len == guess.kv_committed_len
        and item.pending_tokens == guess.pending_tokens
        and item.tree.tokens == guess.tree.tokens
        and item.tree.parents == guess.tree.parents
        and item.tree.draft_probs is None
        and item.hidden_state_layers == guess.hidden_state_layers
        and item.sampling == guess.sampling
        and item.logprobs == guess.logprobs
        and item.rules == guess.rules
    )


def validate_round(
    inputs: list[VerifyInput],
    seqs: dict[str, VerifierSeq],
    num_layers: int,
    vocab_size: int,
    max_context: int,
) -> None:
    """INVALID_ARGUMENT unless every item of a round can run on the verifier's sequences
    `seqs` (known ids, the committed lengths they have, one set of hidden-state layers, tokens
    in the vocabulary, trees and sampling well formed, within the context)."""
    check_seq_ids(inputs, seqs, "verifier")
    if len({item.hidden_state_layers for item in inputs} - {()}) > 1:
        raise invalid(
            "hidden_state_layers must be the same for every sequence of a round that asks"
            " for hidden states"
        )
    for item in inputs:
        # layer i < num_layers: decoder layer i's output; num_layers: after the final norm
        bad_layers = [x for x in item.hidden_state_layers if not 0 <= x <= num_layers]
        if bad_layers:
            raise invalid(
                f"hidden_state_layers {bad_layers} outside [0, {num_layers}] "
                f"({num_layers} = the last hidden state, after the final norm)"
            )
        committed = 0 if item.begin else seqs[item.seq_id].kv.kv_committed_len
        if item.kv_committed_len != committed:
            raise invalid(
                f"kv_committed_len = {item.kv_committed_len} for {item.seq_id!r}, "
                f"the verifier has {committed}"
            )
        if not item.pending_tokens:
            raise invalid(f"pending_tokens empty for {item.seq_id!r}")
        if not 1 <= item.decode_steps <= MAX_DECODE_STEPS:
            raise invalid(
                f"decode_steps = {item.decode_steps} for {item.seq_id!r}: want 1 to "
                f"{MAX_DECODE_STEPS}"
            )
        if item.decode_steps > 1 and (
            item.tree or item.hidden_state_layers or (item.rules and not item.rules.carried)
        ):
            raise invalid(
                f"{item.seq_id!r}: decode_steps > 1 asks for no tree, no hidden states and no "
                "guide (its masks are the gateway's)"
            )
        if not 0 <= item.lookup <= MAX_LOOKUP:
            raise invalid(f"lookup = {item.lookup} for {item.seq_id!r}: want 0 to {MAX_LOOKUP}")
        bad = [t for t in item.pending_tokens if not 0 <= t < vocab_size]
        if bad:
            raise invalid(f"pending_tokens {bad[:4]} outside the vocabulary [0, {vocab_size})")
        for name, asked in (("logprobs", item.logprobs), ("prompt_logprobs", item.prompt_logprobs)):
            if not NO_LOGPROBS <= asked <= min(MAX_TOP_LOGPROBS, vocab_size):
                raise invalid(
                    f"{name} = {asked} for {item.seq_id!r}: want {NO_LOGPROBS} (none) to "
                    f"{min(MAX_TOP_LOGPROBS, vocab_size)}"
                )
        if item.prompt_logprobs != NO_LOGPROBS and not item.begin:
            raise invalid(f"{item.seq_id!r}: prompt_logprobs only in a sequence's first round")
        try:
            item.tree.validate(vocab_size)
            item.sampling.validate()
            if item.rules is not None:
                item.rules.validate(vocab_size, len(item.tree) + 1)
        except ValueError as e:
            raise invalid(f"{item.seq_id!r}: {e}") from e
        depth = max(item.tree.depths(), default=0)
        if committed + len(item.pending_tokens) + depth > max_context:
            raise invalid(
                f"{item.seq_id!r}: kv_committed_len + pending_tokens + tree depth exceeds "
                f"the context ({max_context})"
            )
