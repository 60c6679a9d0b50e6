"""Sequence ids scoped to the client that created them (DESIGN.md §8).

The drafter and the verifier keep state per `seq_id`, chosen by the gateway. Each client gets a
random scope, and the engines see `"<scope>/<seq_id>"`: another client cannot touch, release or
pre-create its sequences, and when the client's last stream has been gone for `orphan_grace_s`
(its gateway is gone: a live gateway reopens a broken stream at its next round) every sequence
of that scope is freed. A client is known by the random token it sends (`client_key`: the
round lane's HELLO, or gRPC metadata `SCOPE_METADATA`; all its streams and lane connections
share one scope), else by its gRPC peer (the address and port of one TCP connection; on a Unix
socket every peer is "unix:", so a client there without a token shares one scope with every
other such client).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, ClassVar, Protocol, TypeVar

from specsplit.errors import ServiceError

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 5.0
SCOPE_METADATA = "specsplit-scope"  # gRPC metadata: the client's token, hex


def client_key(token_hex: str) -> str:
    """The scope key of a client that sent `token_hex` (on the lane or in gRPC metadata)."""
    return "client:" + token_hex


def grpc_scope_key(metadata: Iterable[tuple[str, Any]] | None, peer: str) -> str:
    """A gRPC call's scope key: its client's token (32 hex digits) when it sent one, else its
    peer."""
    for key, value in metadata or ():
        if key == SCOPE_METADATA and isinstance(value, str) and len(value) == 32:
            try:
                int(value, 16)
            except ValueError:
                break
            return client_key(value.lower())
    return peer


class Keyed(Protocol):
    """A round's input or output (specsplit.messages): a dataclass with a seq_id."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    seq_id: str


K = TypeVar("K", bound=Keyed)


@dataclasses.dataclass
class Scope:
    """One connection's namespace of sequence ids."""

    prefix: str  # "<random hex>/"
    num_streams: int = 0
    free_task: asyncio.Task[None] | None = None

    def inside(self, seq_id: str) -> str:
        """The engine's id of the client's `seq_id`."""
        return self.prefix + seq_id

    def enter(self, items: list[K]) -> list[K]:
        """Round inputs with engine ids, renamed in place: they were just parsed from the
        request and are the service's own (dataclasses.replace cost ~1.4 us per sequence)."""
        for item in items:
            item.seq_id = self.inside(item.seq_id)
        return items

    def leave(self, items: list[K]) -> list[K]:
        """Round outputs with the client's ids, renamed in place: the engine made them for this
        call and keeps none."""
        for item in items:
            item.seq_id = item.seq_id.removeprefix(self.prefix)
        return items

    def owns(self, engine_id: str) -> bool:
        return engine_id.startswith(self.prefix)


class ConnectionScopes:
    """Scopes by peer; `free(engine_ids)` releases sequences (on the engine's thread)."""

    def __init__(
        self,
        free: Callable[[Callable[[Iterable[str]], list[str]]], Awaitable[int]],
        orphan_grace_s: float = ORPHAN_GRACE_S,
    ) -> None:
        """free(select): release the engine's sequences whose ids `select` picks from all of
        them; returns how many it released."""
        self._free = free
        self.orphan_grace_s = orphan_grace_s
        self._scopes: dict[str, Scope] = {}

    def find(self, peer: str) -> Scope | None:
        """The peer's scope, None when it has none (it created nothing that is still held)."""
        return self._scopes.get(peer)

    @contextlib.asynccontextmanager
    async def stream(self, peer: str) -> AsyncIterator[Scope]:
        """The scope of a stream from `peer` while it lasts. A ServiceError raised inside has
        the scope's prefix taken out of its message (the client knows its ids without it)."""
        scope = self._scopes.get(peer)
        if scope is None:
            scope = self._scopes[peer] = Scope(secrets.token_hex(8) + "/")
        if scope.free_task is not None:  # the gateway came back in time
            scope.free_task.cancel()
            scope.free_task = None
        scope.num_streams += 1
        try:
            yield scope
        except ServiceError as err:
            raise ServiceError(err.code, err.message.replace(scope.prefix, "")) from None
        finally:
            scope.num_streams -= 1
            if scope.num_streams == 0:
                scope.free_task = asyncio.create_task(self._free_later(peer, scope))

    async def _free_later(self, peer: str, scope: Scope) -> None:
        await asyncio.sleep(self.orphan_grace_s)
        if self._scopes.get(peer) is scope:
            del self._scopes[peer]  # from here on, a new stream from `peer` gets a new scope
        try:
            num_freed = await self._free(lambda ids: [i for i in ids if scope.owns(i)])
        except ServiceError:  # still loading or closing: nothing of the scope's is held
            return
        if num_freed:
            log.info("freed %d sequences of a connection that went away (%s)", num_freed, peer)

    async def close(self) -> None:
        for scope in self._scopes.values():
            if scope.free_task is not None:
                scope.free_task.cancel()
