"""A small pool of reusable connections (a client's lane connections, its gRPC round
streams): each lent to one task at a time, so that a client carries several requests in flight
at once, one per connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


Item = TypeVar("Item", bound=Closable)


class Pool(Generic[Item]):
    """Up to `cap` reusable items (a client's lane connections or gRPC round streams), each
    lent to one task at a time: `take` lends the one given back last, makes a new one while
    all are lent and fewer than `cap` exist, else waits until one is given back (`give`)."""

    def __init__(self, make: Callable[[], Item], cap: int) -> None:
        assert cap >= 1, cap
        self.cap = cap
        self.items: list[Item] = []  # every item made, lent or idle
        self._make = make
        self._idle: list[Item] = []
        self._free = asyncio.Semaphore(cap)  # how many more may be lent now

    async def take(self) -> Item:
        await self._free.acquire()
        if self._idle:
            return self._idle.pop()
        item = self._make()
        self.items.append(item)
        return item

    def give(self, item: Item) -> None:
        self._idle.append(item)
        self._free.release()

    @contextlib.asynccontextmanager
    async def lent(self) -> AsyncIterator[Item]:
        """An item for the block (`take`), given back after it, however it ends."""
        item = await self.take()
        try:
            yield item
        finally:
            self.give(item)

    def close(self) -> None:
        """Close every item (a lent one's request sees its connection end); an item reopens
        on its next use."""
        for item in self.items:
            item.close()
