"""``Coalescer``: items handed in while a call is out go together in the next call; each
caller gets its own item's result or error; a cancelled caller's item is still sent."""

import asyncio

import pytest

from rollart.runtime.coalesce import Coalescer


class Remote:
    """A ``send`` that records each call and holds it until released."""

    def __init__(self):
        self.calls: list[list] = []
        self.release = asyncio.Event()
        self.fail_call: Exception | None = None

    async def send(self, items):
        self.calls.append(list(items))
        await self.release.wait()
        if self.fail_call is not None:
            err, self.fail_call = self.fail_call, None
            raise err
        return [ValueError(f"bad item {x}") if x < 0 else x * 10 for x in items]


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def _one_call_out(**options):
    """A ``Coalescer`` over a held ``Remote`` whose first call (item 1) is out."""
    r = Remote()
    c = Coalescer(r.send, **options)
    first = asyncio.ensure_future(c(1))
    await _settle()
    return r, c, first


def test_items_handed_in_while_a_call_is_out_go_in_the_next_one():
    async def main():
        r, c, first = await _one_call_out()
        assert r.calls == [[1]]  # sent at once, alone
        rest = [asyncio.ensure_future(c(x)) for x in (2, 3, 4)]
        await _settle()
        assert r.calls == [[1]] and len(c) == 3  # waiting for the call that is out
        r.release.set()
        assert await first == 10
        assert await asyncio.gather(*rest) == [20, 30, 40]
        assert r.calls == [[1], [2, 3, 4]] and (c.calls, c.items) == (2, 4)

    asyncio.run(main())


def test_a_bad_item_fails_its_own_caller_only():
    async def main():
        r = Remote()
        r.release.set()
        c = Coalescer(r.send)
        got = await asyncio.gather(c(1), c(-1), c(2), return_exceptions=True)
        assert got[0] == 10 and got[2] == 20
        assert isinstance(got[1], ValueError) and "bad item -1" in str(got[1])
        assert r.calls == [[1, -1, 2]]

    asyncio.run(main())


def test_a_failed_call_fails_its_callers_and_the_next_call_goes_out():
    async def main():
        r = Remote()
        r.fail_call = ConnectionError("buffer lost")
        c = Coalescer(r.send)
        a, b = asyncio.ensure_future(c(1)), asyncio.ensure_future(c(2))
        await _settle()
        late = asyncio.ensure_future(c(3))  # waits for the next call
        await _settle()
        r.release.set()
        got = await asyncio.gather(a, b, return_exceptions=True)
        assert all(isinstance(g, ConnectionError) for g in got)
        assert await late == 30
        assert r.calls == [[1, 2], [3]]

    asyncio.run(main())


def test_a_cancelled_caller_s_item_is_still_sent():
    async def main():
        r, c, out = await _one_call_out()
        gone, kept = asyncio.ensure_future(c(2)), asyncio.ensure_future(c(3))
        await _settle()
        gone.cancel()
        r.release.set()
        assert await out == 10 and await kept == 30
        assert gone.cancelled()
        assert r.calls == [[1], [2, 3]]  # handed in: sent, as a call on the wire would be

    asyncio.run(main())


def test_max_items_splits_a_pile_and_a_wrong_reply_is_an_error():
    async def main():
        r = Remote()
        r.release.set()
        c = Coalescer(r.send, max_items=2)
        assert await asyncio.gather(*(c(x) for x in range(5))) == [0, 10, 20, 30, 40]
        assert r.calls == [[0, 1], [2, 3], [4]]

        async def short(items):
            return items[:-1]

        c2 = Coalescer(short)
        with pytest.raises(RuntimeError, match="2 results for 3 items"):
            await asyncio.gather(c2(1), c2(2), c2(3))

    asyncio.run(main())
    with pytest.raises(ValueError, match="max_items"):
        Coalescer(Remote().send, max_items=0)


def test_an_item_that_may_linger_waits_for_company_or_its_time():
    async def main():
        r = Remote()
        r.release.set()
        c = Coalescer(r.send, linger=60.0)
        a = asyncio.ensure_future(c(1, urgent=False))
        b = asyncio.ensure_future(c(2, urgent=False))
        await _settle()
        assert r.calls == [] and len(c) == 2  # waiting for company, not for 60 s
        assert await c(3) == 30  # an urgent item takes them along
        assert (await a, await b) == (10, 20) and r.calls == [[1, 2, 3]]

        c = Coalescer(r.send, linger=0.05)
        assert await asyncio.gather(c(4, urgent=False), c(5, urgent=False)) == [40, 50]
        assert r.calls[-1] == [4, 5]  # their time was up: sent together, unprompted

        c = Coalescer(r.send, max_items=2, linger=60.0)
        assert await asyncio.gather(c(6, urgent=False), c(7, urgent=False)) == [60, 70]
        assert r.calls[-1] == [6, 7]  # a full batch goes at once

    asyncio.run(main())
    with pytest.raises(ValueError, match="linger"):
        Coalescer(Remote().send, linger=-1)


def test_an_item_lingering_while_a_call_is_out_goes_when_its_time_is_up():
    async def main():
        r, c, first = await _one_call_out(linger=0.05)
        late = asyncio.ensure_future(c(2, urgent=False))
        await asyncio.sleep(0.2)  # its time is up while the first call is still out
        assert r.calls == [[1]]
        r.release.set()
        assert (await first, await late) == (10, 20)
        assert r.calls == [[1], [2]]

    asyncio.run(main())
