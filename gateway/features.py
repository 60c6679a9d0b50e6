"""The target's feature rows the gateway holds for a sequence on its way to an EAGLE drafter.

The verifier returns a row per committed token (its hidden states at the drafter's layers), and
the next Draft carries the rows the drafter has not had. Once a Draft has carried them, the
drafter holds them: the gateway keeps only the rows from the drafter's start on (about one
round's), not the sequence's whole history (24 KB a token for an 8B target's EAGLE-3 head:
100 streams of 4K tokens would be ~10 GB of gateway memory). A drafter that loses a sequence
gets its rows again from a re-verify of its tokens (`Sequence.forget_drafter`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FeatureRows:
    """Rows for tokens[start : end], one chunk a round ([rows, layers * hidden] each, never
    written once appended: chunks may be views of the verifier's answer)."""

    start: int = 0  # the first token with a row held; rows before it reached the drafter
    chunks: list[torch.Tensor] = field(default_factory=list)
    num_rows: int = 0

    @property
    def end(self) -> int:
        """Leading tokens whose rows the gateway has had (held, or passed on to the drafter)."""
        return self.start + self.num_rows

    def append(self, chunk: torch.Tensor) -> None:
        """The rows of the tokens a round committed, tokens[end : end + len(chunk)]."""
        self.chunks.append(chunk)
        self.num_rows += chunk.shape[0]

    def rows_from(self, index: int) -> torch.Tensor | None:
        """Rows for tokens[index : end], joining only the chunks they span (one chunk's rows
        are a view of it); None when no chunk is held (none yet, or all let go). `index` >=
        start."""
        assert index >= self.start, (index, self.start)
        if not self.chunks:
            return None
        picked: list[torch.Tensor] = []
        end = self.end
        for chunk in reversed(self.chunks):
            if end <= index:
                break
            begin = end - chunk.shape[0]
            picked.append(chunk if index <= begin else chunk[index - begin :])
            end = begin
        if len(picked) == 1:  # mostly: the last round's rows
            return picked[0]
        return torch.cat(picked[::-1]) if picked else self.chunks[-1][:0]

    def drop_before(self, index: int) -> None:
        """The drafter holds tokens[:index] with their rows: let go of the chunks entirely before
        it (a chunk it ends inside stays whole, so that no row is copied)."""
        while self.chunks and self.start + self.chunks[0].shape[0] <= index:
            gone = self.chunks.pop(0)
            self.start += gone.shape[0]
            self.num_rows -= gone.shape[0]

    def keep(self, length: int) -> None:
        """Only tokens[:length] stay verified (truncated): the rows past it go. Below `start`
        nothing is held any more, and the rows from `length` on come with the re-verify."""
        if length <= self.start:
            self.start, self.chunks, self.num_rows = length, [], 0
            return
        kept, num_rows = [], 0
        for chunk in self.chunks:
            if self.start + num_rows >= length:
                break
            kept.append(chunk[: length - self.start - num_rows])
            num_rows += kept[-1].shape[0]
        self.chunks, self.num_rows = kept, num_rows

    def copy(self) -> FeatureRows:
        """Another holder of the same rows (a session's next turn): appends to one do not show
        in the other."""
        return FeatureRows(self.start, list(self.chunks), self.num_rows)

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunk in self.chunks)
