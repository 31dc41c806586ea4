"""``Handout``: the ``SampleBuffer``'s part that hands complete groups to trainer steps.

Consumes the complete groups the buffer holds (``Groups``) and the trainer's requests,
relayed by ``rollart.buffer.buffer`` (``get_table``, ``mark_trained``, ``release_taken``,
``abort_older_than``, ``close``). Produces the batches: one Arrow table in
``rollart.buffer.schema.SCHEMA`` per take, of the oldest complete groups (in completion
order, or in start order within the slots' window: ``Admission.take_limit``), after
dropping those too stale for the asking trainer (``Admission.stale_floor``). A batch taken
for a step is held in ``TakenBatches`` until its confirmation (``confirm``: ``trained``)
or, when that will never come, settled (``settle``: ``trained`` if its update was
published, else buffered again, first in line).

Owns the trainer's wait: the buffer's one asyncio condition (the actor's methods hold it
while they change groups; whoever makes groups ready calls ``wake``) and how many
trainers wait on it. Moves the rows it takes or puts back in the ``Ledger``; rows that
leave the buffer go through ``leave`` (the buffer's: ledger moves, Parquet, journal).
Frees a slot (``Admission``) for each group that leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pyarrow as pa

from rollart.buffer.backpressure import Admission
from rollart.buffer.group import Group, Groups
from rollart.buffer.ledger import Ledger
from rollart.buffer.schema import SCHEMA
from rollart.buffer.taken import TakenBatches, row_ids
from rollart.types import TrajState

logger = logging.getLogger(__name__)
BUFFERED, TAKEN = TrajState.BUFFERED.value, TrajState.TAKEN.value
#: ``leave(batches, state, step=None, durable=False)``: rows leave the buffer as ``state``
Leave = Callable[..., list[pa.RecordBatch]]


class Handout:
    """Takes, confirms and settles trainer steps' batches; the trainer's wait (module
    docstring). Its methods other than ``take`` expect the caller to hold ``condition``.
    """

    def __init__(self, ledger: Ledger, groups: Groups, taken: TakenBatches,
                 admission: Admission, leave: Leave):
        self.ledger, self.groups, self.taken = ledger, groups, taken
        self.admission, self._leave = admission, leave
        self._cond: asyncio.Condition | None = None
        self.waiters = 0  # trainers waiting in ``take`` now
        self.stale_groups = 0  # groups dropped as too stale (``drop_stale``) in its life

    @property
    def condition(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily: the buffer may be built off the loop
            self._cond = asyncio.Condition()
        return self._cond

    def wake(self) -> None:
        """Groups may be ready (or the window moved): waiting trainers look again."""
        self.condition.notify_all()

    def close(self, group: Group) -> None:
        """``group`` leaves the queue for good: its slot frees."""
        self.groups.close(group.group_id)
        self.admission.free(group.group_id)

    def drop(self, groups: list[tuple[Group, bool]]) -> None:
        """``(group, complete)`` leave as ``dropped`` (a complete one is journaled)."""
        for g, done in groups:
            self.close(g)
            self._leave(g.arrow(), TrajState.DROPPED, durable=done)

    def drop_stale(self, groups: list[tuple[Group, bool]]) -> None:
        """``drop`` groups too stale for the trainer, counted (``stale_groups``: what
        ``Rollout.max_in_flight="auto"`` shrinks on, ``rollart.policy.inflight``)."""
        self.stale_groups += len(groups)
        self.drop(groups)

    def abort_older_than(self, min_version: int) -> list[tuple[Group, bool]]:
        """Drop the groups, complete or not, older than ``min_version``; returns them."""
        stale = self.groups.older_than(min_version, open_too=True)
        self.drop_stale(stale)
        if stale:
            self.wake()  # the start-order window may have moved
        return stale

    async def take(self, n_groups: int, min_version: int, timeout: float | None,
                   step: int | None, counts: Callable[[], dict],
                   entry: Callable[[], object]) -> tuple[pa.Table, object]:
        """Wait (holding ``condition``) for ``n_groups`` complete groups of version >=
        ``min_version``, settling earlier steps' batches first; take them (``_take``).
        ``entry()`` runs before the condition is released (the buffer's journal entry):
        returns ``(table, entry())``. Raises ``TimeoutError`` (with ``counts()``) when
        ``timeout`` seconds pass."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        cond = self.condition
        async with cond:
            for s in self.taken.steps():
                self.settle(s, min_version)
            while True:
                floor = self.admission.stale_floor(min_version)  # areal: None
                if floor is not None:
                    self.drop_stale(self.groups.older_than(floor))
                if self.groups.ready(self.admission.take_limit()) >= n_groups:
                    batch = self._take(n_groups, step, min_version)
                    return batch, entry()
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"get_batch({n_groups}, min_version={min_version}) timed out after "
                        f"{timeout}s: {self.groups.ready()} complete groups ready, "
                        f"counts={counts()}"
                    )
                self.waiters += 1
                try:
                    await asyncio.wait_for(cond.wait(), remaining)
                except TimeoutError:
                    pass  # loop once more: report or (rarely) succeed
                finally:
                    self.waiters -= 1

    def _take(self, n_groups: int, step: int | None, min_version: int) -> pa.Table:
        """Hand out the ``n_groups`` oldest complete groups (first completed, or first
        started within the window: ``Rollout.take_window``): ``taken`` for ``step``
        (``trained`` at once when there is no step to confirm)."""
        groups = self.groups.oldest(n_groups, self.admission.take_limit())
        for g in groups:
            self.close(g)
        if step is None:
            out = [b for g in groups
                   for b in self._leave(g.arrow(), TrajState.TRAINED, None, durable=True)]
            return pa.Table.from_batches(out, schema=SCHEMA)
        table = self.taken.hold(step, min_version, groups).table(step)
        for traj_id in table.column("traj_id").to_pylist():
            self.ledger.move(traj_id, TAKEN, step)
        return table

    def confirm(self, step: int, take: str | None = None,
                state: TrajState = TrajState.TRAINED) -> int:
        """Step ``step``'s taken rows leave as ``state``; returns how many (0 when none
        are taken, or when ``take`` names another hand-out of ``step`` than the one taken
        now: its step was settled, and maybe re-run, meanwhile)."""
        held = self.taken.get(step)
        if held is not None and take is not None and take != held.take:
            logger.warning("step %d: a confirmation for hand-out %s refused (%s is "
                           "taken now)", step, take, held.take)
            return 0
        held = self.taken.pop(step)
        for g in held.groups if held else ():
            self._leave(g.arrow(), state, step, durable=True)
        if held and state == TrajState.TRAINED:
            self.admission.published(len(held.groups))
        return held.rows if held else 0

    def release(self, step: int, min_version: int, trained_on: int | None = None) -> dict:
        """``settle`` a lost step's batch when its replacement trainer asks; waiting
        trainers look again when its groups are back in line."""
        out = self.settle(step, min_version, trained_on)
        if out["buffered"]:
            self.wake()
        return out

    def lose_taken(self) -> None:
        """The buffer closes: batches still taken (their step neither confirmed nor
        settled) leave as ``lost_in_step``."""
        for step in self.taken.steps():
            self.confirm(step, state=TrajState.LOST_IN_STEP)

    def settle(self, step: int, min_version: int, trained_on: int | None = None) -> dict:
        """A taken batch whose confirmation will not come: ``trained`` (with its figures,
        ``TakenBatches.figures``) if a trainer at ``min_version`` shows its update was
        published, else its groups go back to the front of the queue, in order. Returns
        ``{"trained": rows, "buffered": rows, ...}``."""
        if self.taken.published(step, min_version):
            out = self.taken.figures(step, trained_on)
            return {"trained": self.confirm(step), "buffered": 0, **out}
        held = self.taken.pop(step)
        for g in reversed(held.groups):
            for traj_id in row_ids(g.arrow()):
                self.ledger.move(traj_id, BUFFERED)
            self.groups.first_in_line(g)
            self.admission.hold(g.group_id)
        return {"trained": 0, "buffered": held.rows}
