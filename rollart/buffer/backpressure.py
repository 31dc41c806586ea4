"""The ``SampleBuffer``'s slots: env managers take groups here when a slot frees.

The async pipeline hands the buffer its ``Slots`` once (``open_slots``: capacity
``max(alpha, 1) * groups_per_step`` and the run's ``GroupSequence``); each env manager then
loops on ``acquire`` (``EnvManager.take_work``), which waits until a slot is free and
returns the next group (``rollart.policy.admission.Work``). A slot frees when its group
leaves the buffer: taken by the trainer, dropped as stale, or ended with nothing to
train on. The driver never polls: it only reports an env manager it lost
(``holder_lost``: that manager's groups are handed out again for their missing
members). A buffer re-created after its worker was lost gets the slots again from the
pipeline (``open_slots``), counts its recovered complete groups as held and continues
the group sequence after the last group its ledger knows.

Mixed into ``SampleBuffer`` (``rollart.buffer.buffer``); its methods run on the buffer
worker's event loop like the rest of the buffer's.
"""

from __future__ import annotations

import asyncio
import logging

from rollart.buffer.ledger import IN_FLIGHT

logger = logging.getLogger(__name__)

ACQUIRE_WAIT = 2.0  # s: the longest an acquire waits before its manager asks again


def _group_index(group_id: str) -> int:
    try:
        return int(group_id.split("-", 1)[0][1:])
    except ValueError:
        return -1


class Backpressure:
    """Slot bookkeeping for ``SampleBuffer`` (see the module docstring)."""

    _slots = None  # rollart.policy.admission.Slots once open_slots was called
    _freed: asyncio.Event | None = None
    _dead: set | None = None  # holders reported lost: they take nothing more
    _closing = False

    def _slot_event(self) -> asyncio.Event:
        if self._freed is None:
            self._freed = asyncio.Event()
        return self._freed

    def _free(self, group_id: str) -> None:
        """``group_id`` left: its slot frees (and waiting managers wake)."""
        if self._slots is not None and self._slots.release(group_id):
            self._slot_event().set()

    def _published(self, n_groups: int) -> None:
        """An update trained on ``n_groups`` taken groups was published (the admission
        counts it: ``Slots.published``; waiting managers wake)."""
        if self._slots is not None:
            self._slots.published(n_groups)
            self._slot_event().set()

    def _in_training(self) -> int:
        """Groups trainer steps took whose update is not published yet."""
        return sum(len(t.groups) for t in self._taken.values())

    def _stale_floor(self, min_version: int) -> int | None:
        """Complete groups older than this are dropped for a trainer at ``min_version``
        (None: none are; the admission checked the bound when they started)."""
        if self._slots is None:
            return min_version
        return self._slots.admission.stale_floor(min_version)

    def _rehold(self, group_id: str) -> None:
        if self._slots is not None:
            self._slots.hold(group_id)

    def _next_unused_group(self) -> int:
        ids = [t for t in self.ledger.state] + list(self._closed) + list(self._complete)
        return max((_group_index(g) for g in ids), default=-1) + 1

    async def open_slots(self, slots) -> dict:
        """Start handing out groups under ``slots`` (a ``Slots``); a buffer that has its
        slots keeps them. The groups this buffer holds complete (restored from a
        checkpoint, or recovered) hold slots; the sequence continues after the last
        group its ledger knows. Returns ``slot_stats()``."""
        if self._slots is None:
            slots.reset(list(self._complete))
            slots.sequence.advance_to(self._next_unused_group())
            self._slots, self._dead = slots, set()
            self._slot_event().set()
        return await self.slot_stats()

    async def acquire(self, holder: str, tasks=None, wait: float = ACQUIRE_WAIT):
        """The next group for env manager ``holder`` (running the task names ``tasks``,
        or any) once a slot is free; None after ``wait`` s without one (ask again); False
        at once for a holder reported lost or a closing buffer (stop asking)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        freed = self._slot_event()
        while not self._closing and holder not in (self._dead or ()):
            if self._slots is not None:
                work = self._slots.take(holder, tasks, self._in_training())
                if work is not None:
                    self._slot_event().set()  # another manager may take the next one
                    return work
            freed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(freed.wait(), remaining)
            except TimeoutError:
                return None
        return False

    async def holder_lost(self, holder: str) -> int:
        """Env manager ``holder`` was lost: its groups' members in flight there are
        ``failed`` (orphaned) and each group is handed out again for its missing
        members. Returns how many groups went back in line."""
        if self._slots is None:
            return 0
        self._dead.add(holder)
        mine = [g for g, h in self._slots.held.items() if h == holder]
        prefixes = tuple(f"{g}-" for g in mine)
        lost = [t for t, s in self.ledger.state.items()
                if s == IN_FLIGHT and t.startswith(prefixes)] if prefixes else []
        self._orphan(lost)
        if lost:
            await self.store.wait(self._entry())
        ended = set(self._complete) | self._closed  # nothing to re-run for these
        arrived = {g: 1 << 30 if g in ended else
                   self._open[g].arrived if g in self._open else 0 for g in mine}
        again = self._slots.lost(holder, arrived)
        if again:
            logger.warning("env manager %s lost: %d groups go back in line (%d members "
                           "in flight failed)", holder, len(again), len(lost))
            self._slot_event().set()
        return len(again)

    async def end_group(self, group_id: str, error: str) -> None:
        """An env manager's ``run_group`` for ``group_id`` raised (not a trajectory's
        failure: those are counted as such): the group ends here, its slot frees."""
        self._recent_errors.append(f"group {group_id}: {error}")
        group = self._open.get(group_id)
        if group is not None:
            from rollart.types import TrajState

            async with self._condition:
                self._close_group(group)
                self._leave(group.arrow(), TrajState.DROPPED)
            self._entry_soon()
        self._free(group_id)

    async def slot_stats(self) -> dict:
        """Slots held and their capacity, and the groups in flight or buffered counted
        from the ledger and the buffer's groups (not from the slots)."""
        running = {t.rsplit("-", 1)[0] for t, s in self.ledger.state.items() if s == IN_FLIGHT}
        live = (running - self._closed) | set(self._open) | set(self._complete)
        out = {"groups_live": len(live), "groups_buffered": len(self._complete)}
        if self._slots is not None:
            out.update(self._slots.stats())
        return out

    async def slot_state(self) -> dict | None:
        """The group sequence's state (for a checkpoint), None before ``open_slots``."""
        return self._slots.sequence.state() if self._slots is not None else None

    def _stop_slots(self) -> None:
        self._closing = True
        self._slot_event().set()
