"""``rollart.env.barrier.TurnBarrier``: a lockstep batch advances turn by turn; a member
that leaves stops being waited for. Plain asyncio, as on an env manager's event loop."""

import asyncio

from rollart.env.barrier import TurnBarrier


async def _member(barrier: TurnBarrier, name: str, turns: int, log: list) -> None:
    try:
        for turn in range(turns):
            await barrier.wait()
            log.append((turn, name))
            await asyncio.sleep(0.001 * (ord(name[0]) % 3))  # members take unequal turns
    finally:
        barrier.leave()


def test_no_member_starts_a_turn_before_every_live_one_arrived():
    log: list = []

    async def main():
        barrier = TurnBarrier(3)
        await asyncio.gather(*(_member(barrier, n, 4, log) for n in "abc"))

    asyncio.run(main())
    assert len(log) == 12
    assert [t for t, _ in log] == sorted(t for t, _ in log)  # turns never interleave


def test_a_member_that_leaves_is_not_waited_for():
    log: list = []

    async def main():
        barrier = TurnBarrier(3)
        await asyncio.wait_for(asyncio.gather(
            _member(barrier, "short", 1, log), _member(barrier, "long", 3, log),
            _member(barrier, "mid", 2, log)), timeout=5)

    asyncio.run(main())
    assert sorted(log) == sorted([(0, "short"), (0, "long"), (0, "mid"), (1, "long"),
                                  (1, "mid"), (2, "long")])
    assert [t for t, _ in log] == sorted(t for t, _ in log)


def test_the_last_arrival_opens_the_turn_and_leave_opens_it_for_the_rest():
    async def main():
        barrier = TurnBarrier(2)
        first = asyncio.ensure_future(barrier.wait())
        await asyncio.sleep(0)
        assert not first.done() and barrier.arrived == 1
        barrier.leave()  # the other member finished: nobody else to wait for
        await asyncio.wait_for(first, 1)
        assert (barrier.parties, barrier.arrived) == (1, 0)
        await asyncio.wait_for(barrier.wait(), 1)  # alone now: never waits

    asyncio.run(main())


def test_the_runner_path_still_exports_it():
    from rollart.env import trajectory

    assert trajectory.TurnBarrier is TurnBarrier
