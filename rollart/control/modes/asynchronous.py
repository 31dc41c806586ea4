"""The asynchronous modes (``async``, ``areal``): env managers take groups from the
buffer's slots.

Consumes the actors and ``Graph`` like every mode (``rollart.control.modes.base.Pipeline``);
hands the ``SampleBuffer`` its ``Slots`` (``rollart.policy.admission``) under the mode's
admission policy and keeps an ``EnvManager.take_work`` loop running on every live env
manager while the trainer steps. ``async`` aborts members that can no longer meet the
bound and the trainer drops complete groups that are too stale; ``areal`` checks the
bound only when a group starts (``StartBound``) and then trains whatever arrives.
With ``Rollout.max_in_flight="auto"`` the slots' limit is re-decided after every step
(``adapt``: ``rollart.policy.inflight.InflightLimit`` on the step's measured pace) and
sent to the buffer (``SampleBuffer.resize_slots``); every row reports the limit the
step ran under (``rollout/inflight_limit``) and the groups it held.
Built by ``rollart.control.modes.make_pipeline``.
"""

from __future__ import annotations

import logging
import time

from rollart.control.fleet import ActorLost
from rollart.control.modes.base import Pipeline
from rollart.policy.admission import (AUTO, Capacity, Slots, StartBound, auto_admission,
                                      slot_capacity, take_window_for)
from rollart.policy.inflight import InflightLimit, pace_of
from rollart.policy.staleness import StalenessBound

logger = logging.getLogger(__name__)

# s: the longest a step's take waits for the workers to hold the version just published
# (a load takes ~0.02 s on the laptop; a worker that cannot load is the stall check's)
VERSION_WAIT_S = 2.0


class AsyncPipeline(Pipeline):
    """Trajectory-level asynchrony: the buffer's slots pace rollout (env managers take
    work when one frees), with redundancy and abort-and-replace."""

    def __init__(self, fleet, graph):
        super().__init__(fleet, graph)
        self.takers: dict[int, tuple] = {}  # id(manager) -> (manager, holder, future)
        self._slotted = None  # the buffer handle that has this run's slots
        self._holders = 0
        self.yielded: dict[str, int] = {}  # workers that yield the CPU: their nice before
        # Rollout.max_in_flight="auto": the limit, and the figures the last pace was from
        self.inflight = InflightLimit.for_algo(graph.algo) \
            if graph.max_in_flight == AUTO else None
        self._paced: tuple | None = None  # (monotonic time, workers by address, buffer)

    def state(self) -> dict:
        """The buffer draws the groups: its sequence (ours until slots are opened);
        with ``max_in_flight="auto"`` the limit reached too (a resumed run goes on
        from it rather than from the start)."""
        state = self.sequence.state()
        if self._slotted is not None:
            state = self.fleet.ask_buffer("slot_state") or state
        if self.inflight is not None:
            state = {**state, "inflight_limit": self.inflight.limit}
        return state

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        if self.inflight is not None and state.get("inflight_limit"):
            self.inflight.resume(int(state["inflight_limit"]))

    def trainer_first(self) -> None:
        """Rollout processes on the trainer's host yield the CPU to it
        (``rollart.runtime.priority``); best effort: a failure is logged."""
        from distributed import default_client

        from rollart.runtime.priority import yield_to_trainer

        try:
            self.yielded = yield_to_trainer(default_client(),
                                            self.actors.placement["trainer"][0])
        except Exception as e:  # noqa: BLE001 - a speed-up, never a reason to stop
            logger.warning("could not give the trainer's host to the trainer first: %r", e)

    def close(self) -> None:
        """The run is over: the rollout workers get their priority back."""
        if not self.yielded:
            return
        from distributed import default_client

        from rollart.runtime.priority import give_back

        try:
            give_back(default_client(), self.yielded)
        except Exception as e:  # noqa: BLE001 - best effort, as the yield was
            logger.warning("could not give the rollout workers their priority back: %r", e)
        self.yielded = {}

    def stop_task(self, task: str) -> None:
        """The buffer draws the groups once it has its slots: it stops drawing ``task``."""
        super().stop_task(task)
        if self._slotted is not None:
            self.fleet.ask_buffer("stop_task", task)

    def limit(self) -> int:
        """Groups in flight or buffered at once now: ``slot_capacity``
        (``Rollout.max_in_flight`` steps' worth, else ``max(alpha, 1)``), or the
        adapted limit with ``"auto"``."""
        if self.inflight is not None:
            return self.inflight.limit
        return slot_capacity(self.graph.algo, self.graph.max_in_flight)

    def admission(self):
        """The buffer's admission policy: ``limit()`` groups at once; with ``"auto"``
        also AReaL's start bound (``StartBound(drop_stale=True)``), so a limit grown
        past ``alpha`` steps' worth starts no group that is stale before its take."""
        if self.inflight is not None:
            return auto_admission(self.graph.algo, self.limit())
        return Capacity(self.limit(), self.graph.algo.stale_groups == "drop")

    def keep_taking(self) -> None:
        """While the trainer steps: the buffer has its slots (once per buffer: a
        re-created one gets them again), every live env manager takes work, and an env
        manager that was lost has its groups handed back. Local checks only: no call
        unless something changed."""
        if self._slotted is None:  # once: the trainer first on a shared host
            self.trainer_first()
        if self._slotted is not self.actors.buffer:
            admission = self.admission()
            slots = Slots(self.limit(), self.sequence, admission,
                          take_window_for(self.graph))
            self.fleet.ask_buffer("open_slots", slots)
            # no pace across a (re)opening: the first step's wait is the start-up's, a
            # resumed or re-created buffer's counts are not the last step's
            self._paced = None
            self._slotted = self.actors.buffer
        live = {id(m) for m in self.actors.managers}
        for key, (mgr, holder, fut) in list(self.takers.items()):
            if key in live and not fut.done():
                continue
            del self.takers[key]
            try:
                if key not in live:
                    raise ActorLost(f"env manager {holder} was replaced")
                self.fleet.attempt(mgr, fut.result)
            except ActorLost:
                self.fleet.ask_buffer("holder_lost", holder)  # its groups go back in line
            except Exception as e:  # noqa: BLE001 - its loop ended in error: reported
                self.errors.append(f"{holder}: {type(e).__name__}: {e}")
        for mgr in list(self.actors.managers):
            if id(mgr) not in self.takers:
                self.take_work(mgr)

    def release_manager(self, mgr) -> None:
        """The buffer gives ``mgr``'s holder no more groups; its ``take_work`` ends."""
        taker = self.takers.get(id(mgr))
        if taker is not None:
            self.fleet.ask_buffer("retire_holder", taker[1])

    def forget_manager(self, mgr, lost: bool) -> None:
        """``mgr`` left the run; the groups it still ran go back in line (``lost``)."""
        taker = self.takers.pop(id(mgr), None)
        if taker is not None and lost:
            self.fleet.ask_buffer("holder_lost", taker[1])

    def take_work(self, mgr) -> None:
        """Start ``mgr``'s ``take_work`` loop for the tasks of its env pool."""
        tasks = [t.name for t in self.graph.tasks
                 if any(m is mgr for m in self.actors.managers_for(t))]
        self._holders += 1
        holder = f"{mgr._address}#{self._holders}"
        r = self.graph.rollout
        try:
            fut = self.fleet.submit(mgr, "take_work", holder, tasks, r.redundancy,
                                    r.backup_after)
        except ActorLost:  # its worker is gone: healed away
            return
        self.takers[id(mgr)] = (mgr, holder, fut)

    def step(self, step: int) -> dict:
        metrics = self.train(step, while_waiting=self.keep_taking)
        version = metrics["version"]
        asked = self.ask_versions(version)
        min_version = StalenessBound(self.graph.algo.alpha).min_version(version)
        metrics["rollout/aborted_now"] = sum(
            n for _, n in self.fleet.broadcast("env", "abort_older_than", min_version))
        # the next step's take frees the slots its batch held, and the groups that start
        # then must start on ``version``: on a worker still loading it their first turns
        # would be a version older, and the step after next would drop the whole group
        # as too stale (alpha 1) while the trainer waits for a replacement. Rollout in
        # flight goes on meanwhile; only the take waits.
        t0 = time.monotonic()
        self.wait_briefly(asked, t0 + VERSION_WAIT_S)
        metrics["rollout/version_wait_s"] = time.monotonic() - t0
        return metrics

    def adapt(self, trainer: dict, sample) -> dict:
        """After each step, from the loop's ``sample`` read after it (read before any
        resize, so its slot figures are the step's): the limit the step ran under, the
        groups holding slots and those still running. With ``"auto"``, the next step's
        limit from the step's pace (``pace_of``), sent to the buffer if it changed."""
        buf = sample.buffer
        out = {"rollout/inflight_limit": buf.get("slots_capacity", self.limit()),
               "rollout/groups_held": buf.get("slots_held", 0),
               "rollout/groups_in_flight": buf.get("groups_live", 0)}
        if self.inflight is None:
            return out
        now = time.monotonic()
        workers = {st.get("address", addr): st for _, addr, st in sample.workers}
        if self._paced is not None:
            then, before, buf_before = self._paced
            pace = pace_of(trainer, list(workers.values()), before, now - then, buf,
                           buf_before, batch=self.graph.policy.max_batch,
                           group_size=self.graph.algo.group_size)
            old, new = self.inflight.limit, self.inflight.update(pace)
            if new != old:
                logger.info("in-flight limit %d -> %d groups: %s", old, new,
                            self.inflight.why)
                self.fleet.ask_buffer("resize_slots", new)
        self._paced = (now, workers, buf)
        return out

    def wait_briefly(self, asked: list, deadline: float) -> None:
        """Wait for the ``ask_versions`` futures until ``deadline`` (healing meanwhile);
        a worker that fails to load, or is slower, is left to the stall check
        (``rollart.policy.watchdog``) rather than holding the trainer back."""
        for _, fut in asked:
            while not fut.done() and time.monotonic() < deadline:
                self.heal()
                time.sleep(0.01)


class AReaLPipeline(AsyncPipeline):
    """AReaL's scheme: asynchronous like ``async`` (the buffer's slots pace rollout,
    redundancy, weights swapped in mid-trajectory), but the staleness bound is checked
    only when a group starts (``StartBound``: groups started ≤ ``(version + alpha + 1)
    * groups_per_step``) and nothing is aborted in flight or dropped as stale: the
    trainer takes the groups as they complete, so ``trainer/staleness_max`` can exceed
    ``alpha`` by the groups that ran long (reported, not hidden)."""

    def limit(self) -> int:
        """Groups held at once: async's budget when ``Rollout.max_in_flight`` is set,
        else AReaL's start bound's window (``alpha + 1`` steps' worth)."""
        if self.graph.max_in_flight is None:
            return self.admission().capacity
        return super().limit()

    def admission(self):
        algo = self.graph.algo
        limit = self.graph.max_in_flight  # the same budget as async's, if set
        return StartBound(algo.alpha, algo.groups_per_step,
                          None if limit is None else super().limit())

    def step(self, step: int) -> dict:
        metrics = self.train(step, while_waiting=self.keep_taking)
        metrics["rollout/aborted_now"] = 0  # areal never aborts in flight
        return metrics
