"""One actor call for many items: those that pile up while the previous call is out,
and those that may wait a moment.

A Dask actor call costs the caller about a third of a millisecond of its event loop's CPU
(building the message, pickling, the comm's write, the reply), and the actor's worker as
much again, whatever the payload. An env manager that sent each finished trajectory to
the sample buffer in a call of its own paid that per trajectory. ``Coalescer(send)``
gathers items into calls of ``send(items)``:

* an *urgent* item (the default) goes out at once: on the next turn of the loop (so
  items handed in within one turn go together), or, while a call is out, in the next
  call as soon as that one returns;
* an item handed in with ``urgent=False`` may wait up to ``linger`` seconds for company:
  it goes with the next urgent item or full batch, or when its time is up.

An env manager hands in a group's last member as urgent (the trainer waits for complete
groups) and the others with a short linger, so a group's members mostly travel
together; ``SampleBuffer.put_many`` books them.

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
    """``await c(item)`` is ``send([item, ...])``'s result for ``item``, sent with the
    other items handed in while the previous ``send`` was out (at most ``max_items`` a
    call); ``await c(item, urgent=False)`` may also wait up to ``linger`` seconds.

    >>> async def main():
    ...     async def send(items):
    ...         return [x * 10 for x in items]
    ...     c = Coalescer(send, linger=0.5)
    ...     got = await asyncio.gather(c(1, urgent=False), c(2, urgent=False), c(3))
    ...     return got, c.calls
    >>> asyncio.run(main())
    ([10, 20, 30], 1)
    """

    def __init__(self, send: Callable[[list], Awaitable[list]], max_items: int = 256,
                 linger: float = 0.0):
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, not {max_items}")
        if linger < 0:
            raise ValueError(f"linger must be >= 0 seconds, not {linger}")
        self._send, self.max_items, self.linger = send, max_items, float(linger)
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._urgent = False  # an item pending must go with the next call
        self._sending: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.calls = 0  # send calls made
        self.items = 0  # items they carried

    async def __call__(self, item, urgent: bool = True):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((item, fut))
        if urgent or self.linger == 0 or len(self._pending) >= self.max_items:
            self._urgent = True
            self._kick()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger, self._time_up)
        return await fut

    def __len__(self) -> int:
        """Items handed in and not yet sent."""
        return len(self._pending)

    async def flush(self) -> None:
        """Send every item handed in now, without its linger, and return once no call is
        out (an owner closing: what was handed in reaches ``send`` before it goes).

        >>> async def main():
        ...     sent = []
        ...     async def send(items):
        ...         sent.extend(items)
        ...         return items
        ...     c = Coalescer(send, linger=60.0)
        ...     waiting = asyncio.ensure_future(c(1, urgent=False))
        ...     await asyncio.sleep(0)
        ...     waiting.cancel()  # its caller went away: the item is still sent
        ...     await c.flush()
        ...     return sent, len(c)
        >>> asyncio.run(main())
        ([1], 0)
        """
        while self._pending or (self._sending is not None and not self._sending.done()):
            if self._pending:
                self._urgent = True
                self._kick()
            sending = self._sending
            if sending is not None:
                await asyncio.gather(sending, return_exceptions=True)

    def _time_up(self) -> None:
        self._timer = None
        self._urgent = True
        self._kick()

    def _kick(self) -> None:
        """Start sending unless a call is out (it sends what is due when it returns)."""
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while self._pending and self._urgent:
            batch = self._pending[:self.max_items]
            del self._pending[:self.max_items]
            if not self._pending:  # all sent: nothing is due until the next item
                self._urgent = False
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            await self._call(batch)  # meanwhile urgent items and time-outs set _urgent

    async def _call(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
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
            return
        for (_, fut), res in zip(batch, results):
            if fut.done():  # its caller was cancelled
                continue
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)
