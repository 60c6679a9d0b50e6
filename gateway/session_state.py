"""A session's state on the gateway: the `Session` (its conversation, what each service holds of
it, who holds it now) and the `Turn` running on it. gateway/sessions.py keeps them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.sequence import Sequence


@dataclass(eq=False)
class Turn:
    """A running turn, on its Sequence (`Sequence.turn`)."""

    session: Session
    verifier_start: int  # the verifier's kv_committed_len when the turn began (rollback point)
    drafter_start: int  # the drafter's tokens when the turn began
    messages: list[dict[str, str]] | None  # chat: the conversation's messages with this turn's
    reply_parts: list[str] = field(default_factory=list)  # the text streamed to the client


@dataclass(eq=False)
class Session:
    session_id: str
    seq_id: str  # its sequence on both services
    ttl_s: float
    last_used: float  # on the store's clock
    # the last completed turn: the conversation's tokens and what each service holds of them
    state: Sequence | None = None
    # the chat so far ([] before the first turn); None once a text or token-id turn is in it
    messages: list[dict[str, str]] | None = field(default_factory=list)
    claimed: bool = False  # a turn has it, from its request to its end
    turn: Sequence | None = None  # that turn, once it runs
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # no turn nor RPC holds it
    num_kv_pages: int = 0  # verifier pages it holds between turns (the verifier's answer)
    closed: bool = False

    def __post_init__(self) -> None:
        self.ready.set()

    @property
    def tokens(self) -> list[int]:
        return [] if self.state is None else self.state.tokens

    @property
    def holds_kv(self) -> bool:
        return self.state is not None and (self.state.verifier_begun or self.state.drafter_begun)

    @property
    def busy(self) -> bool:
        """A turn is on it and still generating (finished or cancelled ones are being put
        away: the next turn waits for that)."""
        turn = self.turn
        return self.claimed and (turn is None or not (turn.finished or turn.cancelled))
