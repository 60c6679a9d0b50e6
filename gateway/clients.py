"""What the scheduler needs from the drafter and the verifier, and in-process implementations.

The gRPC implementations live in gateway/grpc_clients.py; the in-process ones run the real
engines on one worker thread each (tests and single-process use), checking the engines'
invariants after every call when asked to.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from drafter.engine import DrafterEngine
from specsplit.messages import DraftInput, DraftOutput, VerifyInput, VerifyOutput
from verifier.engine import VerifierEngine


class DrafterClient(Protocol):
    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]: ...

    async def release(self, seq_ids: list[str]) -> None: ...


class VerifierClient(Protocol):
    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]: ...

    async def release(self, seq_ids: list[str]) -> None: ...


class LocalDrafterClient:
    def __init__(self, engine: DrafterEngine, check_integrity: bool = False) -> None:
        self.engine = engine
        self.check = check_integrity
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="drafter")

    async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        out = await asyncio.get_running_loop().run_in_executor(
            self._executor, self.engine.draft, inputs
        )
        if self.check:
            self.engine.check_integrity()
        return out

    async def release(self, seq_ids: list[str]) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self._executor, self.engine.release, seq_ids
        )


class LocalVerifierClient:
    def __init__(self, engine: VerifierEngine, check_integrity: bool = False) -> None:
        self.engine = engine
        self.check = check_integrity
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="verifier")

    async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        out = await asyncio.get_running_loop().run_in_executor(
            self._executor, self.engine.verify, inputs
        )
        if self.check:
            self.engine.check_integrity()
        return out

    async def release(self, seq_ids: list[str]) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self._executor, self.engine.release, seq_ids
        )
