"""Backpressure as plain objects: which group runs next, and how many may run at once.

``GroupSequence`` draws the run's groups (task by ``Graph.task_weights``, episode seed) from
one RNG seeded by ``Graph.seed``: the same sequence for a seed however rollout is timed,
continued from a checkpoint by ``state``/``load_state`` and, after the buffer's worker
was lost, by ``advance_to`` (draws replayed from the seed up to the next unused group).

``Slots`` hands groups out under an admission policy and keeps who holds which. A slot
is held from the moment an env manager takes a group until the group leaves the buffer
(taken by the trainer, dropped as stale, or ended with every member failed); a group
whose env manager was lost keeps its slot and is handed out again for its missing
members. The policies (plain objects, called by the buffer and by ``rollart.sim``):

* ``Capacity`` (``async``): at most ``capacity`` groups (``slot_capacity``) are in
  flight or buffered at once; with ``Rollout.max_in_flight="auto"`` the capacity is
  re-decided each trainer step (``rollart.policy.inflight``) and applied by
  ``Slots.resize``.
* ``StartBound`` (``areal``, AReaL's rule): the staleness bound is checked only when a
  group starts: it may start only while the groups started (trained, in training,
  buffered, in flight) number fewer than ``(version + alpha + 1) * groups_per_step``,
  ``version`` counted in updates published since the slots opened. Nothing is dropped
  or aborted afterwards (``stale_floor`` is None): a group that took long is trained
  however stale it became.

Neither object does I/O: the ``SampleBuffer`` actor holds one of each and waits on its
condition for a free slot (``rollart.buffer.backpressure``); the lockstep modes draw
from a ``GroupSequence`` in the driver (``rollart.control.modes``); tests call them directly.

>>> from rollart.env.tasks import get_task
>>> seq = GroupSequence([get_task("gridnav")], None, seed=0, group_size=4)
>>> slots = Slots(2, seq)
>>> a, b = slots.take("m0"), slots.take("m1")
>>> (a.group_id, b.group_id, slots.take("m0"))
('g000000', 'g000001', None)
>>> slots.release("g000000"), slots.take("m1").group_id
(True, 'g000002')

AReaL's rule counts a batch the trainer took until its update is published:

>>> bound = StartBound(alpha=0, groups_per_step=1)
>>> bound.room(held=0, started=1, version=0), bound.room(held=0, started=1, version=1)
(0, 1)
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """A group for an env manager to run (``EnvManager.run_group``'s arguments)."""

    task: object
    seed: int
    group_id: str
    size: int
    need: int  # members still to deliver (< size for a group restarted elsewhere)
    first_index: int = 0  # member ids start here (past a lost manager's ids)


class GroupSequence:
    """The run's groups in order: ``(task, seed, group_id, size)`` from one seeded RNG."""

    def __init__(self, tasks, weights, seed: int, group_size: int):
        self.tasks, self.seed, self.group_size = list(tasks), int(seed), int(group_size)
        self.weights = list(weights or [1.0] * len(self.tasks))
        self.rng = random.Random(self.seed)
        self.n_groups = 0
        self._peeked: tuple | None = None
        self.stopped: set[str] = set()  # task names never drawn again (``stop``)

    def _draw(self) -> tuple:
        weights = [0.0 if _name(t) in self.stopped else w
                   for t, w in zip(self.tasks, self.weights)]
        task = self.rng.choices(self.tasks, weights=weights)[0]
        return task, self.rng.randrange(1_000_000)

    @property
    def exhausted(self) -> bool:
        """Every task with a weight was stopped: there is nothing left to draw."""
        return not any(w > 0 and _name(t) not in self.stopped
                       for t, w in zip(self.tasks, self.weights))

    def stop(self, task_name: str) -> None:
        """Draw no more groups of ``task_name`` (it failed every trajectory for
        ``Rollout.failing_task_steps``: ``rollart.policy.quarantine``); a group of it
        already peeked is drawn again.

        >>> from rollart.env.tasks import get_task
        >>> seq = GroupSequence([get_task("gridnav"), get_task("guess")], None, 0, 2)
        >>> seq.stop("guess"); {seq.next()[0].name for _ in range(20)}, seq.exhausted
        ({'gridnav'}, False)
        """
        self.stopped.add(task_name)
        if self._peeked is not None and _name(self._peeked[0]) == task_name:
            self._peeked = None

    def peek(self) -> tuple:
        """The next group without using it up."""
        if self._peeked is None:
            task, seed = self._draw()
            self._peeked = (task, seed, f"g{self.n_groups:06d}", self.group_size)
        return self._peeked

    def next(self) -> tuple:
        out, self._peeked = self.peek(), None
        self.n_groups += 1
        return out

    def state(self) -> dict:
        """What a checkpoint keeps to continue the sequence."""
        stopped = sorted(self.stopped)
        if self._peeked is not None:  # a peeked draw is not used yet: replay to before it
            return {"n_groups": self.n_groups, "rng": None, "stopped": stopped}
        return {"n_groups": self.n_groups, "rng": self.rng.getstate(), "stopped": stopped}

    def load_state(self, state: dict) -> None:
        self.stopped = set(state.get("stopped") or ())
        if state.get("rng") is None:
            self.rng, self.n_groups = random.Random(self.seed), 0
            self.advance_to(int(state["n_groups"]))
        else:
            self.n_groups, self._peeked = int(state["n_groups"]), None
            self.rng.setstate(_tupled(state["rng"]))

    def advance_to(self, n_groups: int) -> None:
        """Continue after group ``n_groups - 1`` (draws replayed from the seed when the
        RNG state is not at hand: a recovered buffer knows only the groups launched)."""
        while self.n_groups < n_groups:
            self.next()


@dataclass(frozen=True)
class Capacity:
    """The async mode's admission: at most ``capacity`` groups hold a slot at once;
    ``drop_stale`` False (``GRPO.stale_groups="rescore"``): a complete group is never
    dropped for staleness, the trainer re-scores its old tokens instead."""

    capacity: int
    drop_stale: bool = True

    def room(self, held: int, started: int, version: int) -> int:
        """Groups that may start now, with ``held`` slots held (``started``: those plus
        the groups trained or in training; ``version``: updates published since the
        slots opened; neither counts here: a group taken by the trainer frees its slot)."""
        return self.capacity - held

    def resized(self, capacity: int) -> Capacity:
        """The same admission under a new limit (``Slots.resize``)."""
        return Capacity(int(capacity), self.drop_stale)

    def stale_floor(self, min_version: int) -> int | None:
        """Complete groups older than this are dropped when the trainer asks for a batch
        at ``min_version``: the trainer's bound, as it asks (None: none dropped)."""
        return min_version if self.drop_stale else None


@dataclass(frozen=True)
class StartBound:
    """AReaL's admission: a group starts only if it can be trained within ``alpha``
    versions of the version it starts on (groups started ≤ ``(version + alpha + 1) *
    groups_per_step``); once started it is never dropped for staleness (``areal``).

    With ``drop_stale`` (``async`` under ``Rollout.max_in_flight="auto"``) the same
    start bound decides when a group may start, and the trainer still drops complete
    groups older than its bound (``stale_floor``): a limit grown past one step's worth
    then starts no group that would be too stale by the time its turn to be taken
    comes (a fixed ``Capacity`` above ``alpha`` steps' worth does: the groups left over
    from one take wait for the take after next, two versions on), so what it drops is
    only what ran long or started on a worker still loading an update."""

    alpha: int
    groups_per_step: int
    limit: int | None = None  # at most this many held at once too (Rollout.max_in_flight)
    drop_stale: bool = False  # async's rule after the start: drop what went too stale

    @property
    def capacity(self) -> int:
        """Groups started per trainer version window: ``(alpha + 1)`` steps' worth."""
        return (self.alpha + 1) * self.groups_per_step

    def room(self, held: int, started: int, version: int) -> int:
        """Groups that may start now: the bound less the groups started (trained, in
        training, buffered or in flight: ``started``) at trainer ``version`` (counted
        from the slots' opening); no more than ``limit`` held at once when it is set."""
        room = (version + self.alpha + 1) * self.groups_per_step - started
        return room if self.limit is None else min(room, self.limit - held)

    def resized(self, capacity: int) -> StartBound:
        """The same bound with ``limit`` groups held at once (``Slots.resize``)."""
        return StartBound(self.alpha, self.groups_per_step, int(capacity), self.drop_stale)

    def stale_floor(self, min_version: int) -> int | None:
        """None: nothing is dropped, the bound was checked when each group started;
        with ``drop_stale``, the trainer's bound as it asks (as ``Capacity``)."""
        return min_version if self.drop_stale else None


def auto_admission(algo, limit: int) -> StartBound:
    """``async``'s admission under ``Rollout.max_in_flight="auto"``: ``limit`` groups at
    once within AReaL's start bound, stale groups still dropped (``StartBound``'s
    ``drop_stale``, unless ``GRPO.stale_groups="rescore"`` keeps them for the trainer to
    re-score); the runtime's pipeline and the simulator both build it here."""
    return StartBound(algo.alpha, algo.groups_per_step, int(limit),
                      drop_stale=algo.stale_groups == "drop")


class Slots:
    """Hands out groups under ``admission`` (default ``Capacity(capacity)``); who holds
    which, what to re-run, and the trainer's progress the admission counts."""

    def __init__(self, capacity: int, sequence: GroupSequence, admission=None,
                 take_window: int | None = None):
        if capacity < 1:
            raise ValueError(f"Slots(capacity={capacity}): at least one group must be "
                             "allowed to run; raise GRPO.groups_per_step")
        self.capacity, self.sequence = int(capacity), sequence
        self.admission = admission if admission is not None else Capacity(self.capacity)
        self.held: dict[str, str | None] = {}  # group id -> holder (env manager key)
        self.groups: dict[str, tuple] = {}  # group id -> (task, seed, size, restarts)
        self.retry: deque[Work] = deque()  # groups of lost holders, first in line
        self.version = 0  # updates published since the slots opened (``published``)
        self.trained = 0  # groups in those updates
        # start order (Rollout.take_window, in groups): ``take_limit``; None: completion order
        self.take_window = None if take_window is None else max(1, int(take_window))

    def room(self, training: int = 0) -> int:
        """Groups the admission lets start now; ``training``: groups a trainer step took
        whose update is not published yet."""
        started = self.trained + training + len(self.held)
        return self.admission.room(len(self.held), started, self.version)

    @property
    def free(self) -> int:
        return max(0, self.room())

    def take_limit(self) -> int | None:
        """The trainer takes complete groups in the order they started, and only those
        numbered below this: past the ``take_window`` oldest groups holding a slot
        (running, or complete and not taken), or past every group started when fewer
        hold one. So a long group is overtaken by at most ``take_window - 1`` groups
        started after it: the trainer waits for it rather than train on the short ones
        that finish first. Groups that ended with nothing or were dropped hold no slot
        and take no room in the window (counted from the oldest number instead, a group
        that failed inside it left the trainer one group short of a batch for good).
        None: no window (completion order)."""
        if self.take_window is None:
            return None
        if len(self.held) < self.take_window:
            return self.sequence.n_groups
        # the take_window-th oldest: no sort of every held group (thousands at scale)
        return heapq.nsmallest(self.take_window, map(group_number, self.held))[-1] + 1

    def resize(self, capacity: int) -> None:
        """The limit changes at a trainer step's boundary (``Rollout.max_in_flight=
        "auto"``: ``rollart.policy.inflight``). Growing lets groups start at once;
        shrinking stops none that runs: new groups wait until fewer than ``capacity``
        hold a slot.

        >>> from rollart.env.tasks import get_task
        >>> slots = Slots(2, GroupSequence([get_task("gridnav")], None, 0, 2))
        >>> _ = slots.take("m"), slots.take("m"); slots.resize(1)
        >>> slots.take("m"), len(slots.held), slots.release("g000000"), slots.take("m")
        (None, 2, True, None)
        >>> slots.resize(3); slots.take("m").group_id
        'g000002'
        """
        if capacity < 1:
            raise ValueError(f"Slots.resize({capacity}): at least one group must be "
                             "allowed to run")
        self.capacity = int(capacity)
        self.admission = self.admission.resized(self.capacity)

    def published(self, n_groups: int) -> None:
        """An update trained on ``n_groups`` groups was published."""
        self.version += 1
        self.trained += int(n_groups)

    def take(self, holder: str, tasks=None, training: int = 0) -> Work | None:
        """The next group for ``holder`` (which runs the task names ``tasks``, or any),
        or None while the admission lets none start (``room``) or the next group is
        another pool's."""
        def mine(task) -> bool:
            return tasks is None or task.name in tasks

        for work in self.retry:  # a restart already holds its slot
            if mine(work.task):
                self.retry.remove(work)
                self.held[work.group_id] = holder
                return work
        if self.room(training) <= 0 or self.sequence.exhausted or \
                not mine(self.sequence.peek()[0]):
            return None
        task, seed, gid, size = self.sequence.next()
        self.held[gid] = holder
        self.groups[gid] = (task, seed, size, 0)
        return Work(task, seed, gid, size, size)

    def release(self, group_id: str) -> bool:
        """``group_id`` left the buffer (or ended with nothing to train on): its slot frees."""
        self.groups.pop(group_id, None)
        self.retry = deque(w for w in self.retry if w.group_id != group_id)
        return self.held.pop(group_id, False) is not False

    def hold(self, group_id: str) -> None:
        """A group back in the buffer (a lost trainer step's batch) holds a slot again."""
        self.held.setdefault(group_id, None)

    def lost(self, holder: str, arrived: dict[str, int]) -> list[Work]:
        """``holder`` was lost: each group it ran (``arrived``: members already in the
        buffer) goes back in line for its missing members, under new member ids."""
        out = []
        for gid in [g for g, h in self.held.items() if h == holder and g in self.groups]:
            task, seed, size, restarts = self.groups[gid]
            need = size - arrived.get(gid, 0)
            if need <= 0:
                continue
            self.groups[gid] = (task, seed, size, restarts + 1)
            self.held[gid] = None
            out.append(Work(task, seed, gid, size, need, first_index=1000 * (restarts + 1)))
        self.retry.extend(out)
        return out

    def reset(self, buffered: list[str]) -> None:
        """After a buffer recovery: only the recovered complete groups hold slots (the
        groups that were running were closed and their members counted lost)."""
        self.held = {g: None for g in buffered}
        self.groups = {g: v for g, v in self.groups.items() if g in self.held}
        self.retry.clear()
        self.version = self.trained = 0

    def stats(self) -> dict:
        return {"slots_capacity": self.capacity, "slots_held": len(self.held),
                "slots_retry": len(self.retry), "groups_drawn": self.sequence.n_groups,
                "slots_version": self.version, "slots_trained": self.trained,
                "slots_take_window": self.take_window}


def _name(task) -> str:
    """A task's name (a sequence may draw names, as the simulator's does)."""
    return getattr(task, "name", task)


def _tupled(x):
    """JSON lists back to the tuples ``random.Random.setstate`` wants."""
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


def group_number(group_id: str) -> int:
    """The start number of a group (``g000042`` -> 42), also of a member's trajectory id
    (``g000042-3``); -1 for an id not made by ``GroupSequence``.

    >>> group_number("g000042-3"), group_number("x")
    (42, -1)
    """
    try:
        return int(group_id.split("-", 1)[0][1:])
    except ValueError:
        return -1


def take_order(group_ids, limit: int | None = None) -> list[str]:
    """The complete groups ``group_ids`` (in the order they completed) in the order the
    trainer takes them: as given without a window (``limit`` None); else those numbered
    below ``limit`` (``Slots.take_limit``), first started first. The buffer and the
    simulator take by this.

    >>> done = ["g000003", "g000001", "g000002"]
    >>> take_order(done), take_order(done, 3)
    (['g000003', 'g000001', 'g000002'], ['g000001', 'g000002'])
    """
    if limit is None:
        return list(group_ids)
    return sorted((g for g in group_ids if group_number(g) < limit), key=group_number)


def take_window_groups(algo, take_window: float | None) -> int | None:
    """``Rollout.take_window`` (steps' worth of groups) in groups, rounded up; None (and
    ``math.inf``): none, completion order.

    >>> from rollart.config.graph import GRPO
    >>> take_window_groups(GRPO(groups_per_step=4), 1.5), take_window_groups(GRPO(), math.inf)
    (6, None)
    """
    if take_window is None or math.isinf(take_window):
        return None
    return max(math.ceil(take_window * algo.groups_per_step), int(algo.groups_per_step))


def take_window_for(graph, mode: str | None = None) -> int | None:
    """The take window of a run, in groups: ``Rollout.take_window``'s (``math.inf``:
    None, completion order); when unset and the graph's ``max_in_flight`` is ``"auto"``
    (async's default), one step's worth (start order keeps long episodes from starving
    as the limit grows); else None (completion order). ``mode``: the mode it runs under
    when not the graph's own (the simulator's ``SimConfig.mode``).

    >>> from rollart.config.graph import GRPO, Graph, Rollout
    >>> algo = GRPO(groups_per_step=4)
    >>> fixed = Graph("g", algo=algo, rollout=Rollout(max_in_flight=1))
    >>> take_window_for(fixed), take_window_for(Graph("g", algo=algo))
    (None, 4)
    >>> take_window_for(Graph("g", algo=algo, rollout=Rollout(take_window=math.inf)))
    """
    window = graph.rollout.take_window
    if window is None and in_flight_for(graph.rollout, mode or graph.mode) == AUTO:
        window = 1.0
    return take_window_groups(graph.algo, window)


#: ``Rollout.max_in_flight`` that adapts the limit each step (``rollart.policy.inflight``)
AUTO = "auto"


def in_flight_for(rollout, mode: str) -> float | str | None:
    """``rollout.max_in_flight`` under ``mode`` (``Graph.max_in_flight``): a set one is
    kept; unset, ``"auto"`` in async and None (the mode's own bound) elsewhere.

    >>> from rollart.config.graph import Rollout
    >>> in_flight_for(Rollout(), "async"), in_flight_for(Rollout(), "areal")
    ('auto', None)
    """
    limit = rollout.max_in_flight
    return AUTO if limit is None and mode == "async" else limit


def stale_members_for(rollout, mode: str, engine: str) -> str:
    """``rollout.stale_members`` under ``mode`` on ``engine`` (``Graph.stale_members``):
    a set one is kept; unset, ``"rescore"`` in async on the torch engine (the one that
    can re-score: ``rollart.env.rescore``), else ``"abort"``."""
    if rollout.stale_members is not None:
        return rollout.stale_members
    return "rescore" if mode == "async" and engine == "torch" else "abort"


def slot_capacity(algo, max_in_flight: float | str | None = None) -> int:
    """Groups in flight or buffered at once in async mode: ``max_in_flight`` steps' worth
    (``Rollout.max_in_flight``, rounded up) when given, else ``max(alpha, 1)`` steps'
    worth; with ``"auto"`` the limit it starts at (``InflightLimit.for_algo``: the
    same ``max(alpha, 1)`` steps' worth, at least one step's and at most ``alpha + 1``).

    >>> from rollart.config.graph import GRPO
    >>> slot_capacity(GRPO(groups_per_step=4, alpha=1)), slot_capacity(GRPO(groups_per_step=4), 2.5)
    (4, 10)

    Not ``alpha + 1``: with two steps' worth of slots for ``alpha = 1`` the default
    graph's gridnav held-out gain fell from ≥ 0.1 to 0.055 / 0.078 (two runs); with
    ``max(alpha, 1)`` steps' worth the same run gained 0.61 (gridnav), 0.21 (guess), 0.60
    (boxpush). The likely mechanism (inferred, not traced): with more groups in flight
    than a step takes, the trainer takes those that complete first, so groups of long
    episodes (the failing ones, run to the turn limit) lose the race, go stale and are
    dropped, and the trained sample is biased toward short episodes.
    """
    if max_in_flight == AUTO:
        from rollart.policy.inflight import InflightLimit

        return InflightLimit.for_algo(algo).limit
    if max_in_flight is not None:
        return max(math.ceil(max_in_flight * algo.groups_per_step), 1)
    return max(algo.alpha, 1) * algo.groups_per_step
