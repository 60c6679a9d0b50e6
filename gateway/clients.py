"""What the scheduler needs from the drafter and the verifier.

The gRPC implementations live in gateway/grpc_clients.py; the in-process ones, over the real
engines, in inprocess/clients.py (tests, benches, train-drafter): the gateway never loads a
torch engine.
"""

from __future__ import annotations

from typing import Protocol

from gateway.health import Health
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    NextTrees,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)


class DrafterClient(Protocol):
    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]: ...

    async def release(self, seq_ids: list[str]) -> None: ...

    async def truncate(self, items: list[Truncation]) -> list[Truncated]: ...


class VerifierClient(Protocol):
    @property
    def last_engine_seconds(self) -> float:
        """The verifier's engine time of the last verify round."""
        ...

    @property
    def last_device_seconds(self) -> float:
        """The verifier's device time of the last verify round (VerifyResponse.device_ns; 0:
        not measured)."""
        ...

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]: ...

    async def hint(self, hints: list[NextTrees]) -> None:
        """Draft-ahead's trees for the outcomes of rounds in flight (VerifierEngine.hint_next):
        the verifier may launch each sequence's next round before it is asked for."""
        ...

    async def release(self, seq_ids: list[str]) -> None: ...

    async def truncate(self, items: list[Truncation]) -> list[Truncated]: ...

    async def health(self) -> Health: ...
