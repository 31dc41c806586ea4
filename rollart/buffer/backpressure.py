"""``Admission``: the ``SampleBuffer``'s slots, where env managers take groups when one frees.

The async pipeline hands the buffer its ``Slots`` once (``open_slots``: capacity
``max(alpha, 1) * groups_per_step`` and the run's ``GroupSequence``), and with
``Rollout.max_in_flight="auto"`` a new capacity between steps (``resize_slots``); each
env manager then loops on ``acquire`` (``EnvManager.take_work``), which waits until a
slot is free and returns the next group (``rollart.policy.admission.Work``). A slot
frees when its group leaves the buffer: taken by the trainer, dropped as stale, or
ended with nothing to train on. The driver never polls: it only reports an env manager it lost
(``holder_lost``: that manager's groups are handed out again for their missing
members). A buffer re-created after its worker was lost gets the slots again from the
pipeline (``open_slots``), counts its recovered complete groups as held and continues
the group sequence after the last group its ledger knows.

``Admission`` holds the ``Slots``, the event that wakes waiting managers, the holders
reported lost and whether the buffer is closing; it owns the managers' wait
(``acquire``). The ``SampleBuffer`` (``rollart.buffer.buffer``) and its ``Handout``
(``rollart.buffer.handout``) tell it when groups leave or updates are published and
supply what it needs to know about groups.
Its methods run on the buffer worker's event loop. ``stats()`` adds to the slots' own
figures ``slots_held_s``, the groups holding a slot (in flight or buffered) integrated over
time since the slots opened (group-seconds), and ``slots_open_s``, that time: their ratio
is the mean number of groups in flight or buffered (``benchmarks/pipeline.py``'s budgets).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from rollart.policy.admission import group_number

ACQUIRE_WAIT = 2.0  # s: the longest an acquire waits before its manager asks again


def next_group(ids: Iterable[str]) -> int:
    """The group number after the last one named in ``ids`` (group or trajectory ids).

    >>> next_group(["g000004-1", "g000002", "x"])
    5
    """
    return max((group_number(g) for g in ids), default=-1) + 1


class Admission:
    """Slot bookkeeping and the managers' wait (module docstring)."""

    def __init__(self):
        self._slots = None  # rollart.policy.admission.Slots once opened
        self._freed: asyncio.Event | None = None
        self._dead: set[str] = set()  # holders reported lost: they take nothing more
        self._closing = False
        self._held_s, self._counted, self._opened = 0.0, 0.0, None  # stats(): group-seconds

    def _count(self) -> None:
        """Add the groups holding a slot since the last count, times the seconds since
        (called before every change to the slots held, and by ``stats``)."""
        now = time.monotonic()
        if self._slots is not None:
            self._held_s += len(self._slots.held) * (now - self._counted)
        self._counted = now

    @property
    def is_open(self) -> bool:
        return self._slots is not None

    def _event(self) -> asyncio.Event:
        if self._freed is None:  # created lazily: the buffer may be built off the loop
            self._freed = asyncio.Event()
        return self._freed

    def open(self, slots, held: list[str], next_index: int) -> None:
        """Start handing out groups under ``slots`` (kept if already open): the groups
        ``held`` hold slots, the sequence continues at group ``next_index``."""
        if self._slots is None:
            slots.reset(held)
            slots.sequence.advance_to(next_index)
            self._count()
            self._slots, self._opened = slots, self._counted
            self._event().set()

    def resize(self, capacity: int) -> None:
        """The slots' limit changes (``Slots.resize``: running groups keep theirs);
        waiting managers wake to take the room a larger limit gives. Before ``open``
        nothing to do: the pipeline opens the slots under its current limit."""
        if self._slots is not None:
            self._slots.resize(capacity)
            self._event().set()

    def free(self, group_id: str) -> None:
        """``group_id`` left: its slot frees (and waiting managers wake)."""
        self._count()
        if self._slots is not None and self._slots.release(group_id):
            self._event().set()

    def published(self, n_groups: int) -> None:
        """An update trained on ``n_groups`` taken groups was published (the admission
        counts it: ``Slots.published``; waiting managers wake)."""
        if self._slots is not None:
            self._slots.published(n_groups)
            self._event().set()

    def hold(self, group_id: str) -> None:
        """``group_id`` is back in the buffer (its step was lost): it holds a slot."""
        if self._slots is not None:
            self._count()
            self._slots.hold(group_id)

    def take_limit(self) -> int | None:
        """Complete groups numbered below this may be taken (start order within the
        window, ``Slots.take_limit``); None: any, in completion order."""
        return self._slots.take_limit() if self._slots is not None else None

    def stale_floor(self, min_version: int) -> int | None:
        """Complete groups older than this are dropped for a trainer at ``min_version``
        (None: none are; the admission checked the bound when they started)."""
        if self._slots is None:
            return min_version
        return self._slots.admission.stale_floor(min_version)

    async def acquire(self, holder: str, tasks, wait: float,
                      in_training: Callable[[], int]):
        """The next group for ``holder`` once a slot is free (``in_training()``: groups
        taken whose update is not published); None after ``wait`` s, False for a lost
        holder or a closing buffer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        freed = self._event()
        while not self._closing and holder not in self._dead:
            if self._slots is not None:
                self._count()
                work = self._slots.take(holder, tasks, in_training())
                if work is not None:
                    freed.set()  # another manager may take the next one
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

    def retire(self, holder: str) -> None:
        """``holder`` leaves (its pool shrinks): it takes nothing more, and keeps the
        groups it runs until they finish (or it is reported lost after all)."""
        self._dead.add(holder)
        self._event().set()  # its waiting acquire answers False now

    def lose(self, holder: str) -> list[str] | None:
        """``holder`` was lost: it takes nothing more. Returns the groups it held (None
        before the slots are open)."""
        if self._slots is None:
            return None
        self._dead.add(holder)
        return [g for g, h in self._slots.held.items() if h == holder]

    def hand_out_again(self, holder: str, arrived: dict[str, int]) -> int:
        """The lost ``holder``'s groups go back in line for their missing members
        (``arrived``: members each already has); returns how many went."""
        again = self._slots.lost(holder, arrived)
        if again:
            self._event().set()
        return len(again)

    def stats(self) -> dict:
        if self._slots is None:
            return {}
        self._count()
        return {**self._slots.stats(), "slots_held_s": self._held_s,
                "slots_open_s": self._counted - self._opened}

    def state(self) -> dict | None:
        """The group sequence's state (for a checkpoint), None before ``open``."""
        return self._slots.sequence.state() if self._slots is not None else None

    def stop_task(self, task_name: str) -> None:
        """Hand out no more groups of ``task_name`` (``GroupSequence.stop``)."""
        if self._slots is not None:
            self._slots.sequence.stop(task_name)
            self._event().set()  # a manager waiting on a peeked group of it draws again

    def stop(self) -> None:
        """The buffer closes: waiting managers stop asking."""
        self._closing = True
        self._event().set()
