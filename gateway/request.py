"""What a client asks for and what it gets back, as the scheduler sees it (no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    spec: SpecParams | None = None  # None = the gateway's default
    ignore_eos: bool = False


@dataclass
class SpecStats:
    rounds: int = 0
    num_accepted_drafts: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_accepted_tokens(self) -> float:
        return self.num_accepted_tokens / self.rounds if self.rounds else 0.0


@dataclass
class Chunk:
    """One streamed piece of a generation; the last one has finish_reason set."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None, "stop" or "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats | None = None
    elapsed_ns: int = 0
