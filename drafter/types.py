"""What the drafter engine and its proposers share: a sequence as the drafter holds it, one
draft call's job for it, and the Proposer protocol every drafting method implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specsplit.messages import AheadTree, DraftRules, SpecParams
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree


@dataclass
class DraftSeq:
    seq_id: str
    tokens: list[int] = field(default_factory=list)  # the gateway's committed tokens, as told
    state: object = None  # the proposer's per-sequence state (e.g. draft KV)
    refused: str | None = None  # the last draft shape refused for it (logged once)
    # the logit rules its drafts are bent by (drafter/draft_rules.py; None: none), and its rows
    # in the proposer's RuleTables (a SeqRules, None: none)
    rules: DraftRules | None = None
    rule_rows: object = None


@dataclass
class DraftJob:
    seq: DraftSeq
    spec: SpecParams
    sampling: SamplingParams
    start: int = 0  # where this call's new tokens begin in seq.tokens
    target_hidden_states: torch.Tensor | None = None  # [rows, features] for tokens[start:]
    # draft-ahead (ahead_guesses > 0): the chain being verified for the root; the job drafts the
    # next round's trees for its outcomes instead of a tree for the root
    verifying: DraftTree | None = None
    ahead_guesses: int = 0
    # a greedy chain drafted this many steps on the device (the round's longest chain), then
    # cut to spec.num_steps; 0: its own (TreeProposer._share_chain_length)
    expand_steps: int = 0
    # its sequence's slot in the proposer's RuleTables (0: unbent), and whether the call bends
    # any job's logits (its expansion then reads the slots: drafter/draft_rules.py)
    rule_slot: int = 0
    bent: bool = False
    # with a guide: the tokens it allows at the root, as mask words (the first drafts keep to
    # them; drafter/draft_rules.py); b"": none
    root_allowed: bytes = b""

    @property
    def scratch_len(self) -> int:
        """Entries past the root the job writes in its sequence's own pages: the candidates
        of its tree (of the longer chain it rides), or the nodes of the chain being verified
        (draft-ahead)."""
        if self.ahead_guesses:
            return len(self.verifying or ())
        return max(self.spec.max_draft_tokens, self.expand_steps)


class Proposer(Protocol):
    vocab_size: int
    max_context: int
    device: torch.device  # where it drafts (the CPU for prompt lookup)

    def new_state(self, seq: DraftSeq) -> object: ...

    def truncate(self, seq: DraftSeq, length: int) -> None:
        """Forget everything past the first `length` tokens."""

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        """Draft one tree per job rooted at the job's last token; returns them in order."""
        ...

    def propose_ahead(self, jobs: list[DraftJob]) -> list[list[AheadTree]]:
        """Draft-ahead: per job, the next round's trees for the guessed outcomes of
        `job.verifying` (none where the proposer cannot guess)."""
        ...

    def kv_committed_len(self, seq: DraftSeq) -> int: ...

    def release(self, seq: DraftSeq) -> None: ...

    @property
    def num_pages_used(self) -> int: ...

    @property
    def num_pages_free(self) -> int: ...

    def check_integrity(self) -> None: ...

    def warm_up_kernels(self) -> None:
        """On a GPU, build the kernels a step may pick (attention variants), not on first use."""

    def capture_cuda_graphs(self, catch_up_lens: tuple[int, ...], max_batch_size: int) -> None:
        """On a GPU, capture the draft steps as CUDA graphs (drafter/tree_draft.py); a no-op
        where there is no model or no GPU."""
