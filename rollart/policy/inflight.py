"""How much work ``async`` keeps in flight when ``Rollout.max_in_flight="auto"``.

``InflightLimit`` holds the limit on groups in flight or buffered (what the buffer's
``Slots`` admit, ``rollart.policy.admission``) and re-decides it once per trainer step
from that step's ``Pace``: how long the trainer waited for its batch, how full the
inference engines' batches were and how many requests queued at them, and how many
groups' worth of trajectories were dropped or aborted as too stale. ``pace_of`` makes
a ``Pace`` from the figures a run already reads after each step (the trainer's row,
the inference workers' and the buffer's ``stats``); ``rollart.sim.modes`` makes one
from its simulated workers. Called by ``rollart.control.modes.asynchronous`` (which
sends a changed limit to the buffer: ``SampleBuffer.resize_slots``) and the simulator.

The bounds: at least one trainer step's worth of groups (fewer could never fill a
batch) and at most ``alpha + 1`` steps' worth (alpha still bounds staleness; the
trainer's checks stay as they are). Under ``"auto"`` ``async`` also admits groups by
AReaL's start bound (``rollart.policy.admission.auto_admission``; why: ``StartBound``):
under a plain count of slots the limit grew, lost groups to staleness, shrank, and
averaged 1.16 steps' worth over ``pipeline.py``'s runs. Why not a fixed larger number: see
``rollart.policy.admission.slot_capacity``; with ``"auto"`` the trainer takes groups in
start order (``Rollout.take_window`` one step's worth unless set), so a larger limit
does not favour short episodes. ``areal`` with ``"auto"`` adapts its limit the same way
under its own start bound (it drops nothing, so only the trainer's wait and the engines'
queues move it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Pace:
    """What one trainer step measured (``pace_of``).

    ``waited_s`` of ``step_s``: the trainer's wait for its batch in its step;
    ``rows``: live rows per engine, averaged over the step's wall time (idle time
    counts as 0 rows); ``batch``: the rows an engine batches (``Policy.max_batch``);
    ``queued``: requests waiting per engine at the step's end beyond the rows free in
    its batch (those join at the next decode step: not a queue); ``stale_groups``: the
    groups' worth lost to staleness in the step (``pace_of``).
    """

    waited_s: float
    step_s: float
    rows: float
    batch: int
    queued: float = 0.0
    stale_groups: float = 0.0

    # The thresholds are first choices, not fitted to measurements: a trainer waiting
    # a fifth of its step loses that share of its throughput to rollout (on the laptop
    # toy a trainer whose rollout kept up waited 1-20 % of its ~0.3 s steps, so two
    # such steps in a row are asked for); an engine batching 80 % of its rows gains
    # little from more (decode time grows with the batch); one request waiting per
    # engine beyond its free rows is a queue, not a request in passing.
    #: the trainer is starved when it waited at least this share of its step
    STARVED = 0.2
    #: an engine is full at this share of its batch
    FULL = 0.8
    #: requests waiting per engine from which the engine counts as queueing
    QUEUEING = 1.0

    @property
    def starved(self) -> bool:
        return self.step_s > 0 and self.waited_s >= self.STARVED * self.step_s

    @property
    def queueing(self) -> bool:
        return self.queued >= self.QUEUEING

    @property
    def room(self) -> bool:
        """The engines had room: batches below ``FULL`` and nothing queueing."""
        return self.rows < self.FULL * self.batch and not self.queueing

    @property
    def stale(self) -> bool:
        """At least one group's worth was lost to staleness in the step."""
        return self.stale_groups >= 1.0


class InflightLimit:
    """The in-flight limit of ``Rollout.max_in_flight="auto"``, in groups, within
    ``[lo, hi]``; ``update`` once per trainer step, in this order:

    1. **stale** (a group's worth dropped or aborted as too stale in the step): shrink
       by ``2 * unit`` at once, and grow no higher than ``unit`` below the limit that
       went stale (``ceiling``) until ``PROBE_AFTER`` steps in a row lost nothing (a
       run of stale steps sets it once, at its first: the groups lost in the steps
       after a shrink started under the limit before it);
    2. **starved with room** (the trainer waited ≥ ``Pace.STARVED`` of its step while
       the engines' batches were below ``Pace.FULL`` and nothing queued),
       ``GROW_AFTER`` steps in a row: grow by ``unit``, up to the ceiling;
    3. **oversupplied** (the trainer did not starve while requests queued at the
       engines), ``EASE_AFTER`` steps in a row: shrink by ``unit``;
    4. else: keep it.

    A move starts the counts again (it changes what they measured); a starved step
    whose engines are full or queueing grows nothing (more work would only queue
    there). Growing by a small step after two votes and shrinking by twice that at
    once on staleness (additive increase, faster decrease) moves the limit one way
    under a steady signal, to a bound, and leaves it there; the ceiling keeps a limit
    that went stale from being retried every few steps (a saw-tooth).

    >>> lim = InflightLimit(lo=4, hi=8, start=4, unit=2)
    >>> starved = Pace(waited_s=1.0, step_s=2.0, rows=3.0, batch=64)
    >>> [lim.update(starved) for _ in range(5)]
    [4, 6, 6, 8, 8]
    >>> lim.update(Pace(0.0, 2.0, 3.0, 64, stale_groups=1.5)), lim.why
    (4, 'dropped or aborted 1.5 groups as too stale')
    >>> [lim.update(starved) for _ in range(12)]  # not 8 again before 10 clean steps
    [4, 6, 6, 6, 6, 6, 6, 6, 6, 8, 8, 8]
    >>> stale = Pace(0.0, 2.0, 3.0, 64, stale_groups=2)
    >>> [lim.update(stale) for _ in range(2)], lim.ceiling  # one episode, one ceiling
    ([4, 4], 6)
    >>> full = Pace(waited_s=1.0, step_s=2.0, rows=60.0, batch=64)  # engines full
    >>> [lim.update(full) for _ in range(3)]
    [4, 4, 4]
    """

    GROW_AFTER, EASE_AFTER, PROBE_AFTER = 2, 3, 10

    def __init__(self, lo: int, hi: int, start: int | None = None, unit: int = 1):
        if not 1 <= lo <= hi:
            raise ValueError(f"InflightLimit needs 1 <= lo <= hi, got lo={lo}, hi={hi}")
        self.lo, self.hi, self.unit = int(lo), int(hi), max(1, int(unit))
        self.limit = min(max(int(lo if start is None else start), self.lo), self.hi)
        self.ceiling = self.hi  # lowered after a limit went stale (rule 1)
        self.grow = self.ease = self.clean = 0
        self.stale = False  # the last step lost groups to staleness
        self.why = "start"

    @classmethod
    def for_algo(cls, algo) -> InflightLimit:
        """``GRPO``'s bounds: one step's worth to ``alpha + 1`` steps' worth, starting
        at the fixed default (``max(alpha, 1)`` steps' worth), moving by half a step's.

        >>> from rollart.config.graph import GRPO
        >>> lim = InflightLimit.for_algo(GRPO(groups_per_step=4, alpha=1))
        >>> lim.lo, lim.hi, lim.limit, lim.unit
        (4, 8, 4, 2)
        """
        gps = int(algo.groups_per_step)
        lo, hi = gps, (int(algo.alpha) + 1) * gps
        return cls(lo, hi, start=max(int(algo.alpha), 1) * gps, unit=math.ceil(gps / 2))

    def resume(self, limit: int) -> None:
        """Go on from ``limit`` (a checkpoint's; within the bounds), counts cleared."""
        self.limit = min(max(int(limit), self.lo), self.hi)
        self.grow = self.ease = self.clean = 0
        self.stale = False

    def update(self, pace: Pace | None) -> int:
        """The limit for the next step after a step that measured ``pace`` (None:
        nothing measured, the limit stays); ``why`` says what moved it last."""
        if pace is None:
            return self.limit
        if pace.stale:
            if not self.stale:
                self.ceiling = max(self.lo, self.limit - self.unit)
            self.stale, self.clean = True, 0
            return self._move(-2 * self.unit, f"dropped or aborted "
                              f"{pace.stale_groups:g} groups as too stale")
        self.stale, self.clean = False, self.clean + 1
        if self.clean >= self.PROBE_AFTER:
            self.ceiling = self.hi
        self.grow = self.grow + 1 if pace.starved and pace.room else 0
        self.ease = self.ease + 1 if not pace.starved and pace.queueing else 0
        if self.grow >= self.GROW_AFTER and self.limit < self.ceiling:
            return self._move(self.unit, f"the trainer waited {pace.waited_s:.2f} s of "
                              f"{pace.step_s:.2f} s with engines at {pace.rows:.1f} of "
                              f"{pace.batch} rows for {self.grow} steps", self.ceiling)
        if self.ease >= self.EASE_AFTER and self.limit > self.lo:
            return self._move(-self.unit, f"{pace.queued:.1f} requests queued per engine "
                              f"while the trainer did not wait, {self.ease} steps")
        return self.limit

    def _move(self, by: int, why: str, top: int | None = None) -> int:
        new = min(max(self.limit + by, self.lo), self.hi if top is None else top)
        self.grow = self.ease = 0
        if new != self.limit:
            self.limit, self.why = new, why
        return self.limit


def pace_of(trainer: dict, workers: list[dict], before: dict[str, dict], wall_s: float,
            buffer: dict, buffer_before: dict, *, batch: int, group_size: int) -> Pace | None:
    """A step's ``Pace`` from the figures read after it: ``trainer`` (its metrics row:
    ``trainer/wait_s``, ``trainer/step_s``), the inference workers' ``stats`` now
    (``workers``) and after the step before (``before``, by ``address``), ``wall_s``
    between those reads, the buffer's ``stats`` now and before. None when the
    trainer's figures are missing (a step recorded from the buffer after its trainer
    was lost).

    An engine's live rows per decode step are its tokens generated per decode step
    (one token a row a step); times its busy share of ``wall_s``, rows over the step.
    Its queue: requests waiting (``queued``) beyond the rows its batch has free
    (``batch - in_flight``).
    The groups lost to staleness: the buffer's groups dropped as too stale
    (``groups_stale``, complete or not) or the members aborted in flight for it
    (ledger ``aborted``) in groups, whichever is more (the two often count one loss
    from both ends; a late or failed member's ``dropped`` is not staleness).

    >>> w0 = {"address": "a", "tokens_generated": 0, "decode_steps": 0, "busy_seconds": 0.0}
    >>> w1 = {"address": "a", "tokens_generated": 800, "decode_steps": 100,
    ...       "busy_seconds": 1.0, "queued": 3, "in_flight": 2}
    >>> p = pace_of({"trainer/wait_s": 1.0, "trainer/step_s": 2.0}, [w1], {"a": w0}, 2.0,
    ...             {"groups_stale": 1, "aborted": 6}, {"groups_stale": 0, "aborted": 0},
    ...             batch=64, group_size=4)
    >>> p.rows, p.queued, p.stale_groups, p.starved, p.room
    (4.0, 0.0, 1.5, True, True)
    """
    if "trainer/wait_s" not in trainer or "trainer/step_s" not in trainer:
        return None
    rows = []
    for w in workers:
        b = before.get(w.get("address"), {})
        steps = w.get("decode_steps", 0) - b.get("decode_steps", 0)
        tokens = w.get("tokens_generated", 0) - b.get("tokens_generated", 0)
        busy = w.get("busy_seconds", 0.0) - b.get("busy_seconds", 0.0)
        share = min(1.0, busy / wall_s) if wall_s > 0 else 1.0
        rows.append(tokens / steps * share if steps > 0 else 0.0)
    def grew(key: str) -> int:  # a re-created buffer counts from 0 again
        return max(0, buffer.get(key, 0) - buffer_before.get(key, 0))

    stale = max(grew("groups_stale"), grew("aborted") / max(int(group_size), 1))
    return Pace(waited_s=float(trainer["trainer/wait_s"]),
                step_s=float(trainer["trainer/step_s"]),
                rows=sum(rows) / len(rows) if rows else 0.0, batch=int(batch),
                queued=sum(max(0, w.get("queued", 0) - max(0, batch - w.get("in_flight", 0)))
                           for w in workers) / max(len(workers), 1),
                stale_groups=float(stale))
