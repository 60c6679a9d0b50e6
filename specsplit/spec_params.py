"""A round's draft shape (`SpecParams`: depth, branching, nodes kept), as a request asks and the
gateway caps it. Imports no torch: `specsplit up` checks its default shape before it starts the
services (from specsplit/messages.py, where it was, the check cost ~1 s of imports on a 2-core
VM)."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.errors import invalid


@dataclass(frozen=True)
class SpecParams:
    num_steps: int = 0  # tree depth; 0 = no drafting
    topk: int = 1  # children per frontier node per step; 1 = chain
    num_draft_tokens: int = 0  # nodes kept

    @property
    def max_draft_tokens(self) -> int:
        """Most nodes the expansion can produce: topk first, then topk * topk per step."""
        if self.num_steps == 0:
            return 0
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    def validate(self) -> None:
        if self.num_steps < 0:
            raise invalid(f"spec.num_steps = {self.num_steps} must be >= 0")
        if self.topk < 1:
            raise invalid(f"spec.topk = {self.topk} must be >= 1")
        if self.num_steps == 0:
            if self.num_draft_tokens != 0:
                raise invalid("spec.num_draft_tokens must be 0 when spec.num_steps is 0")
            return
        if not self.num_steps <= self.num_draft_tokens <= self.max_draft_tokens:
            raise invalid(
                f"spec.num_draft_tokens = {self.num_draft_tokens} must be in "
                f"[num_steps, topk + (num_steps - 1) * topk^2] = "
                f"[{self.num_steps}, {self.max_draft_tokens}]"
            )
        if self.topk == 1 and self.num_draft_tokens != self.num_steps:
            raise invalid("spec.num_draft_tokens must equal spec.num_steps for a chain (topk 1)")

    def capped(self, max_depth: int) -> SpecParams:
        """The same shape with at most `max_depth` steps (near max_new_tokens or the context)."""
        if self.num_steps <= max_depth:
            return self
        steps = max(max_depth, 0)
        if steps == 0:
            return SpecParams(0, self.topk, 0)
        nodes = min(self.num_draft_tokens, self.topk + (steps - 1) * self.topk * self.topk)
        return SpecParams(steps, self.topk, max(nodes, steps))
