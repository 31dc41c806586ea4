"""``Handout`` alone (rollart.buffer.handout): takes, confirmations, settlements and the
trainer's wait, on real parts (ledger, groups, taken batches, admission) without the actor.

``leave`` is the buffer's rule without its files: rows leave restated, moved in the ledger.
"""

from __future__ import annotations

import asyncio

import pytest

from rollart.buffer.backpressure import Admission
from rollart.buffer.group import TAKE_KEY, Groups, restate
from rollart.buffer.handout import Handout
from rollart.buffer.ledger import Ledger
from rollart.buffer.taken import TakenBatches, row_ids
from rollart.types import Trajectory


class Parts:
    """A handout on fresh parts; ``left`` lists ``(traj_id, state, step)`` as rows leave."""

    def __init__(self):
        self.ledger, self.groups, self.taken = Ledger(), Groups(), TakenBatches()
        self.admission = Admission()
        self.left: list[tuple[str, str, int | None]] = []
        self.handout = Handout(self.ledger, self.groups, self.taken, self.admission, self.leave)

    def leave(self, batches, state, step=None, durable=False):
        out = [restate(b, state.value, step) for b in batches if b.num_rows]
        for traj_id in row_ids(out):
            self.ledger.move(traj_id, state.value, step)
            self.left.append((traj_id, state.value, step))
        return out

    def complete(self, gid: str, version: int = 0, size: int = 2):
        """Group ``gid`` launched, arrived and complete (buffered), as the buffer does it."""
        g = self.groups.arrive(gid, size)
        for i in range(size):
            t = Trajectory(f"{gid}-{i}", "calc", gid, i, [1], [2, 3], [1, 1], [-0.5, -0.5],
                           [version, version], reward=float(i))
            self.ledger.launch(t.traj_id)
            self.ledger.move(t.traj_id, "buffered")
            g.arrived += 1
            g.add(t)
        assert self.groups.completed(g)
        return g

    def states(self) -> dict[str, str]:
        return dict(self.ledger.state)


def take(p: Parts, n: int, min_version: int = 0, step: int | None = None,
         timeout: float | None = 1.0):
    async def main():
        return await p.handout.take(n, min_version, timeout, step, p.ledger.check, lambda: "e")
    return asyncio.run(main())


def held(p: Parts, fn, *args):
    """``fn(*args)`` holding the handout's condition, as the buffer calls it."""
    async def main():
        async with p.handout.condition:
            return fn(*args)
    return asyncio.run(main())


def test_a_take_without_a_step_is_trained_at_once_oldest_completed_first():
    p = Parts()
    p.complete("b"), p.complete("a"), p.complete("c")
    table, entry = take(p, 2)
    assert entry == "e" and table.column("traj_id").to_pylist() == ["b-0", "b-1", "a-0", "a-1"]
    assert set(table.column("state").to_pylist()) == {"trained"}
    assert p.ledger.check()["trained"] == 4 and p.groups.ready() == 1
    assert p.groups.closed == {"a", "b"} and list(p.groups.complete) == ["c"]


def test_a_taken_batch_is_confirmed_by_its_own_hand_out_only():
    p = Parts()
    p.complete("a"), p.complete("b")
    table, _ = take(p, 2, step=7)
    assert p.ledger.check()["taken"] == 4 and 7 in p.taken
    assert p.handout.confirm(7, take="another") == 0 and 7 in p.taken  # refused
    assert p.handout.confirm(7, take=table.schema.metadata[TAKE_KEY].decode()) == 4
    assert p.ledger.check()["trained"] == 4 and 7 not in p.taken
    assert {s for _, s, step in p.left if step == 7} == {"trained"}
    assert p.handout.confirm(7) == 0  # nothing taken for it any more


def test_a_lost_step_goes_back_first_in_line_unless_its_update_was_published():
    p = Parts()
    p.complete("a", version=2), p.complete("b", version=2), p.complete("c", version=2)
    take(p, 2, min_version=1, step=3)
    out = p.handout.settle(3, min_version=1)  # a trainer at the same bound: not published
    assert out == {"trained": 0, "buffered": 4}
    assert [g.group_id for g in p.groups.oldest(3)] == ["a", "b", "c"]
    assert p.ledger.check()["buffered"] == 6 and 3 not in p.taken
    take(p, 1, min_version=1, step=4)
    out = p.handout.settle(4, min_version=2)  # a newer trainer: step 4's update published
    assert (out["trained"], out["buffered"]) == (2, 0) and "batch_sha1" in out
    assert p.states()["a-0"] == "trained" and p.states()["b-0"] == "buffered"


def test_the_trainer_waits_until_woken_and_stale_groups_are_dropped_on_the_way():
    p = Parts()
    p.complete("old", version=0)

    async def main():
        waiting = asyncio.create_task(p.handout.take(1, 1, 5.0, None, p.ledger.check, dict))
        await asyncio.sleep(0.05)
        assert p.handout.waiters == 1 and not waiting.done()
        async with p.handout.condition:
            p.complete("new", version=1)
            p.handout.wake()
        table, _ = await waiting
        return table

    table = asyncio.run(main())
    assert table.column("group_id").to_pylist() == ["new", "new"]
    assert p.states()["old-0"] == "dropped" and p.handout.waiters == 0
    assert p.handout.stale_groups == 1  # what max_in_flight="auto" shrinks on


def test_a_take_that_times_out_says_what_was_ready_and_the_counts():
    p = Parts()
    p.complete("a")
    with pytest.raises(TimeoutError, match=r"timed out after 0.05s: 1 complete groups ready, "
                                           r"counts=\{'launched': 2"):
        take(p, 2, timeout=0.05)
    assert p.handout.waiters == 0 and p.groups.ready() == 1


def test_abort_drops_open_groups_too_and_close_loses_what_is_still_taken():
    p = Parts()
    p.complete("a", version=1), p.complete("b", version=1), p.complete("c", version=3)
    g = p.groups.arrive("open", 2)
    p.ledger.launch("open-0"), p.ledger.move("open-0", "buffered")
    g.arrived += 1
    g.add(Trajectory("open-0", "calc", "open", 0, [1], [2], [1], [-0.5], [0]))
    take(p, 1, min_version=1, step=5)  # "a" is taken: an abort leaves it to its step
    stale = held(p, p.handout.abort_older_than, 2)  # it wakes the trainers: under the lock
    assert sorted(g.group_id for g, _ in stale) == ["b", "open"]
    assert p.handout.stale_groups == 2
    p.handout.drop([(p.complete("ended"), True)])  # a group ended otherwise: not stale
    assert p.handout.stale_groups == 2
    assert p.states()["open-0"] == p.states()["b-0"] == "dropped" and p.groups.ended("open")
    p.handout.lose_taken()
    assert p.states()["a-0"] == "lost_in_step" and not p.taken.steps()
    assert p.ledger.check()["buffered"] == 2  # "c"
