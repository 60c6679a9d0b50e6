"""Dataclasses crossing the service boundaries (protobuf stays in the servicers and clients)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from specsplit.logit_rules import LogitRules, Penalties
from specsplit.sampling import SamplingParams
from specsplit.spec_params import SpecParams
from specsplit.tree import DraftTree

MAX_DECODE_STEPS = 16  # VerifyInput.decode_steps
MAX_LOOKUP = 16  # VerifyInput.lookup
# VerifyInput.logprobs: the most alternatives a token's log-probability comes with (OpenAI's
# top_logprobs limit)
MAX_TOP_LOGPROBS = 20
NO_LOGPROBS = -1  # VerifyInput.logprobs: none asked


@dataclass(frozen=True)
class DraftRules:
    """A request's logit bias and penalties as the drafter bends its drafts' logits by them
    (`penalties`; inactive ones: none), its output starting at `output_start` in the sequence's
    tokens (the drafter counts it from the tokens it holds)."""

    penalties: Penalties
    output_start: int


@dataclass
class DraftInput:
    seq_id: str
    begin: bool  # first Draft of this sequence: create state
    start: int  # the drafter keeps tokens [0, start), then appends new_tokens
    new_tokens: list[
        int
    ]  # tokens[start:], ending with the root (the verifier's last pending token)
    spec: SpecParams
    sampling: SamplingParams = field(default_factory=SamplingParams)
    target_kv_committed_len: int = 0
    target_hidden_states: torch.Tensor | None = None  # [len(new_tokens), features] (EAGLE)
    # draft-ahead (ahead_guesses > 0): no tree for the root; trees for the outcomes of
    # `verifying`, the tree being verified for it (DraftOutput.ahead)
    verifying: DraftTree = field(default_factory=DraftTree)
    ahead_guesses: int = 0
    # the logit rules the drafter bends its drafts by from now on; None: as it keeps them (a new
    # sequence keeps none)
    rules: DraftRules | None = None
    # with a guide: the tokens it allows at the root as mask words (logit_rules.mask_words
    # little-endian uint32), which the drafter's first drafts keep to; b"": none
    root_allowed: bytes = b""


@dataclass
class AheadTree:
    """The next round's tree if the round being verified ends with `tokens` (accepted drafts
    and the bonus token, the tree's root)."""

    tokens: list[int]
    tree: DraftTree


@dataclass
class NextTrees:
    """The gateway's hint for a sequence's round in flight on the verifier (draft-ahead's trees
    for its outcomes, `VerifierEngine.hint_next`): once that round commits, the verifier
    launches the round the gateway will send next, before it is asked for: the tree drafted
    for the outcome that came (`trees`: accepted drafts + bonus -> tree), or none when no tree
    was drafted for it and `plain` (misses run plain). `base`: the round's kv_committed_len +
    its pending tokens (where its tree's nodes start), naming the round the hint is for."""

    seq_id: str
    base: int
    trees: list[AheadTree]
    plain: bool = False


@dataclass
class DraftOutput:
    seq_id: str
    tree: DraftTree
    kv_committed_len: int  # tokens the drafter's KV covers, a prefix of the gateway's tokens
    hidden_state_layers: tuple[int, ...] = ()  # target layers the drafter reads (EAGLE-3)
    ahead: list[AheadTree] = field(default_factory=list)  # draft-ahead's trees


@dataclass
class VerifyInput:
    seq_id: str
    begin: bool  # first Verify (prefill): create state
    kv_committed_len: int  # what the gateway believes the verifier has
    pending_tokens: list[int]  # tokens[kv_committed_len:]
    tree: DraftTree
    sampling: SamplingParams = field(default_factory=SamplingParams)
    hidden_state_layers: tuple[int, ...] = ()
    # the round's target steps: after the first (the pending tokens and the tree), each further
    # one decodes the next token, as a round of its own would (no tree, no hidden states)
    decode_steps: int = 1
    # each further decode step verifies a chain of up to this many tokens the verifier drafts
    # by prompt lookup from the sequence's own tokens (specsplit/lookup.py); 0: plain steps
    lookup: int = 0
    # the gateway sends no hint for this round (the overlap gate's "ahead-unhinted" rounds): the
    # verifier counts its next round's not running ahead as "off", not "late"
    unhinted: bool = False
    # each new token's log-probability under the target (its raw logits: no temperature, no
    # top-k / top-p) and this many most likely tokens' beside it; NO_LOGPROBS: none
    logprobs: int = NO_LOGPROBS
    # a first round's (begin): its pending tokens' log-probabilities, each but the first at the
    # row before it (the prompt's, vLLM's prompt_logprobs), and this many most likely tokens'
    # beside each; NO_LOGPROBS: none
    prompt_logprobs: int = NO_LOGPROBS
    # the generation's logit bias and penalties with the output so far (specsplit/logit_rules.py):
    # the verifier bends the round's rows by them before the acceptance; None: none
    rules: LogitRules | None = None


@dataclass
class TokenLogprobs:
    """The log-probabilities of a round's new tokens (VerifyOutput.new_tokens' order) under the
    target's distribution at each token's place: each token's own, then the most likely tokens
    there with theirs, best first (as many as the round asked)."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def extend(self, other: TokenLogprobs) -> None:
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def cut(self, end: int) -> TokenLogprobs:
        """The first `end` tokens'."""
        return TokenLogprobs(self.logprobs[:end], self.top_ids[:end], self.top_logprobs[:end])


@dataclass
class VerifyOutput:
    seq_id: str
    accepted_tokens: list[int]  # accepted drafts in order
    bonus_token: int
    kv_committed_len: int  # after this round
    hidden_states: torch.Tensor | None = None  # [pending + accepted, layers * hidden]
    # the round's further decode steps (VerifyInput.decode_steps): the tokens they took as
    # input, the first step's bonus token first; bonus_token is then the last step's
    decoded_tokens: list[int] = field(default_factory=list)
    # how many of decoded_tokens are prompt lookup's accepted drafts (VerifyInput.lookup): the
    # round took len(decoded_tokens) - num_lookup_accepted further steps
    num_lookup_accepted: int = 0
    logprobs: TokenLogprobs | None = None  # one entry per new token where the round asked
    # one entry per pending token but the first, where the round asked (prompt_logprobs)
    prompt_logprobs: TokenLogprobs | None = None

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.accepted_tokens)

    @property
    def num_accepted_tokens(self) -> int:
        """Of the round's first step: its accepted drafts and bonus token."""
        return len(self.accepted_tokens) + 1

    @property
    def new_tokens(self) -> list[int]:
        """Every token the round appends, in order."""
        return [*self.accepted_tokens, *self.decoded_tokens, self.bonus_token]


@dataclass
class Truncation:
    """Keep at most `max_len` leading tokens of a sequence (a session's turn boundary)."""

    seq_id: str
    max_len: int


@dataclass
class Truncated:
    seq_id: str
    found: bool  # False: the service does not hold the sequence
    kv_committed_len: int = 0  # after the truncation
    num_pages: int = 0  # KV pages the sequence holds after it


S = TypeVar("S")


def truncate_each(
    items: list[Truncation], seqs: Mapping[str, S], cut: Callable[[S, int], Truncated]
) -> list[Truncated]:
    """An engine's Truncate: `cut(seq, max_len)` for each sequence it holds, `found = False`
    for the others."""
    return [
        cut(seqs[t.seq_id], t.max_len) if t.seq_id in seqs else Truncated(t.seq_id, found=False)
        for t in items
    ]
