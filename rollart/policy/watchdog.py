"""When a run has stopped progressing: the rule, as a plain object (no I/O).

The pipeline (``rollart.control.modes.Pipeline.check_failures``) feeds a ``Watchdog`` the
buffer's counts (its ``stats()``), each inference worker's version and last load error, and every
completed trainer step; the watchdog answers with the reason the run cannot go on, or
None. Five reasons, each within a bounded time:

==================  ===================================================================
reason              when
==================  ===================================================================
failure storm       the last ``failure_streak_limit`` trajectories all failed
stuck trajectories  trajectories are in flight but none settled for ``stall`` s
all dropped         no trainer step completed for ``stall`` s while groups kept being
                    dropped as too stale (dropped counts as settled, so the check above
                    never fires: e.g. workers stuck on an old version)
starved trainer     the trainer waited for a batch for ``stall`` s while no trajectory
                    was in flight and none started (neither check above fires: nothing
                    is in flight, nothing is dropped; e.g. every slot held by complete
                    groups the trainer may not take)
worker behind       an inference worker stayed below the trainer's version - ``alpha``
                    for ``stall`` s (it cannot load the new weights)
==================  ===================================================================

The pipeline raises ``FailureStormError`` / ``StallError`` (``rollart.control.supervisor``) with
the message.
"""

from __future__ import annotations


class Watchdog:
    """Judges progress from counts and worker versions; ``stall`` 0 disables the stall
    reasons, ``streak_limit`` 0 the failure storm."""

    def __init__(self, stall: float, streak_limit: int, alpha: int, now: float):
        self.stall, self.streak_limit, self.alpha = stall, streak_limit, alpha
        self.version: int | None = None  # the trainer's, after its latest step
        self._settled = (-1, now)  # (settled trajectories, since when)
        self._stepped: tuple[float, int | None] = (now, None)  # (last step, dropped then)
        self._behind: dict[str, float] = {}  # worker address -> below the bound since
        self._starved = (-1, now)  # (launched, since when the trainer waits on nothing)

    @classmethod
    def for_graph(cls, graph, now: float) -> Watchdog:
        """The bounds a ``Graph`` sets: ``Rollout.stall_timeout`` (default: twice the
        longest a trajectory may take, at least 300 s) and ``failure_streak_limit``
        (default: four steps' worth of trajectories)."""
        r, algo = graph.rollout, graph.algo
        streak = r.failure_streak_limit
        if streak is None:
            streak = 4 * algo.group_size * algo.groups_per_step
        stall = r.stall_timeout
        if stall is None:
            longest = r.trajectory_timeout or (
                r.env_step_timeout * max(t.max_turns for t in graph.tasks) + r.reward_timeout)
            stall = max(300.0, 2.0 * longest)
        return cls(float(stall), streak, algo.alpha, now)

    def stepped(self, version: int, now: float) -> None:
        """A trainer step completed; the trainer now holds ``version``."""
        self.version, self._stepped = int(version), (now, None)

    def storm(self, counts: dict) -> bool:
        return bool(self.streak_limit) and counts["failed_streak"] >= self.streak_limit

    def stalled(self, counts: dict, workers: list[dict] | None, now: float) -> str | None:
        """Why the run stalled, or None. ``workers``: ``{address, pool, version,
        load_error}`` of each live inference worker (None: not looked at)."""
        if not self.stall:
            return None
        return (self._all_dropped(counts, workers, now)
                or self._worker_behind(workers or [], now)
                or self._stuck(counts, now)
                or self._starved_trainer(counts, now))

    def _all_dropped(self, counts: dict, workers, now: float) -> str | None:
        since, dropped = self._stepped
        if dropped is None:  # the first look since the step: count drops from here
            self._stepped = (since, counts["dropped"])
            return None
        if counts["dropped"] <= dropped or now - since < self.stall:
            return None
        return (f"no trainer step completed for {now - since:.0f} s while "
                f"{counts['dropped'] - dropped} trajectories were dropped as too stale "
                f"(Rollout.stall_timeout={self.stall:g}): rollout runs on weights older "
                f"than the trainer's bound (alpha={self.alpha}), so nothing reaches the "
                f"trainer. {self.report(workers)} Resume from the last checkpoint "
                "(rollart train --resume RUN) once it is fixed.")

    def _worker_behind(self, workers: list[dict], now: float) -> str | None:
        if self.version is None:
            return None
        bound = self.version - self.alpha
        for w in workers:
            if w["version"] >= bound:
                self._behind.pop(w["address"], None)
                continue
            since = self._behind.setdefault(w["address"], now)
            if now - since >= self.stall:
                return (f"inference worker {w['address']} ({w['pool']}) has held weight "
                        f"version {w['version']} for {now - since:.0f} s while the trainer "
                        f"is at {self.version} (Rollout.stall_timeout={self.stall:g}; "
                        f"alpha={self.alpha}: every worker must hold at least {bound}). "
                        f"{self.report(workers)} Check the weight store (is it this run's? "
                        "can the worker read it?), then resume from the last checkpoint "
                        "(rollart train --resume RUN).")
        return None

    def _stuck(self, counts: dict, now: float) -> str | None:
        settled = counts["launched"] - counts["in_flight"]
        if settled != self._settled[0] or not counts["in_flight"]:
            self._settled = (settled, now)  # progress, or nothing is waited for
            return None
        if now - self._settled[1] < self.stall:
            return None
        return (f"{counts['in_flight']} trajectories are in flight but none has settled "
                f"for {now - self._settled[1]:.0f} s (Rollout.stall_timeout={self.stall:g}),"
                " so the run stops instead of waiting forever. Something they wait on never"
                " answers: an inference worker, a reward, or an env step (is "
                "Rollout.env_step_timeout set?); the dashboard's trajectory states show "
                "where they are. Resume from the last checkpoint (rollart train --resume "
                "RUN) once it is fixed.")

    def _starved_trainer(self, counts: dict, now: float) -> str | None:
        waiting = counts.get("waiters", 0) > 0 and not counts["in_flight"]
        if not waiting or counts["launched"] != self._starved[0]:
            self._starved = (counts["launched"], now)  # started something, or not waiting
            return None
        if now - self._starved[1] < self.stall:
            return None
        return (f"the trainer has waited {now - self._starved[1]:.0f} s for a batch while no "
                f"trajectory was in flight or started (Rollout.stall_timeout={self.stall:g}):"
                f" the buffer holds {counts.get('groups_complete', '?')} complete groups, "
                f"{counts.get('slots_held', '?')} of {counts.get('slots_capacity', '?')} "
                f"slots held, take window {counts.get('slots_take_window')} groups. Nothing "
                "will start until the trainer takes a batch, and the trainer cannot take one "
                "from what is held: report it with these counts (a rollart bug), and resume "
                "from the last checkpoint (rollart train --resume RUN).")

    def report(self, workers: list[dict] | None) -> str:
        """The trainer's version, each worker's and its last load error, in one line."""
        trainer = "unknown (no step completed yet)" if self.version is None else \
            f"v{self.version}"
        parts = [f"{w['address']} ({w['pool']}) v{w['version']}"
                 + (f", last load error: {w['load_error']}" if w.get("load_error") else "")
                 for w in workers or []]
        return f"Trainer at {trainer}; inference workers: " + ("; ".join(parts) or "none") + "."
