"""One actor call for the items that pile up while the previous call is out.

A Dask actor call costs the caller about a third of a millisecond of its event loop's CPU
(building the message, pickling, the comm's write, the reply), and the actor's worker as
much again, whatever the payload. An env manager that sent each finished trajectory to
the sample buffer in a call of its own paid that per trajectory. ``Coalescer(send)``
sends the first item at once (on the next turn of the loop, so items handed in within
one turn go together) and, while that call is out, gathers what arrives into the next:
no timer, no extra latency when calls are rare, fewer calls when they are not. Used by
``EnvManager`` for ``SampleBuffer.put_many``.

Each caller awaits its own item's result. ``send(items)`` returns one result per item,
in order; a result that is an exception is raised to that item's caller only, and an
error of the call itself to every caller in it. A caller cancelled while it waits does
not take its item back: once handed in, the item is sent (as a call already on the wire
would be). No state beyond the items not yet answered.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

__all__ = ["Coalescer"]


class Coalescer:
    """``await c(item)`` is ``send([item, ...])``'s result for ``item``, with the other
    items handed in while the previous ``send`` was out (at most ``max_items`` a call).

    >>> async def main():
    ...     async def send(items):
    ...         return [x * 10 for x in items]
    ...     c = Coalescer(send)
    ...     got = await asyncio.gather(*(c(i) for i in range(5)))
    ...     return got, c.calls
    >>> asyncio.run(main())
    ([0, 10, 20, 30, 40], 1)
    """

    def __init__(self, send: Callable[[list], Awaitable[list]], max_items: int = 256):
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, not {max_items}")
        self._send, self.max_items = send, max_items
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._sending: asyncio.Task | None = None
        self.calls = 0  # send calls made
        self.items = 0  # items they carried

    async def __call__(self, item):
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._drain())
        return await fut

    def __len__(self) -> int:
        """Items handed in and not yet sent."""
        return len(self._pending)

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[:self.max_items]
            del self._pending[:self.max_items]
            self.calls += 1
            self.items += len(batch)
            try:
                results = await self._send([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"send returned {len(results)} results for "
                                       f"{len(batch)} items")
            except asyncio.CancelledError:
                for _, fut in batch + self._pending:  # the loop is going away
                    fut.cancel()
                self._pending.clear()
                raise
            except Exception as e:  # noqa: BLE001 - the call failed: each caller hears it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), res in zip(batch, results):
                if fut.done():  # its caller was cancelled
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
