"""The asynchronous mode (``async``): env managers take groups from the buffer's slots.

Consumes the actors and ``Graph`` like every mode (``rollart.pipeline.base.Pipeline``);
hands the ``SampleBuffer`` its ``Slots`` (``rollart.buffer.slots``), keeps an
``EnvManager.take_work`` loop running on every live env manager while the trainer
steps, and aborts members that can no longer meet the bound. Built by
``rollart.pipeline.make_pipeline``.
"""

from __future__ import annotations

from rollart.buffer.slots import Slots
from rollart.pipeline.base import Pipeline


def slot_capacity(algo) -> int:
    """Groups in flight or buffered at once in async mode: ``(alpha + 1)`` steps' worth."""
    return (algo.alpha + 1) * algo.groups_per_step


class AsyncPipeline(Pipeline):
    """Trajectory-level asynchrony: the buffer's slots pace rollout (env managers take
    work when one frees), with redundancy and abort-and-replace."""

    def __init__(self, actors, graph):
        super().__init__(actors, graph)
        self.takers: dict[int, tuple] = {}  # id(manager) -> (manager, holder, future)
        self._slotted = None  # the buffer handle that has this run's slots
        self._holders = 0

    def state(self) -> dict:
        """The buffer draws the groups: its sequence (ours until slots are opened)."""
        if self._slotted is not None:
            return self.ask_buffer("slot_state") or self.sequence.state()
        return self.sequence.state()

    def keep_taking(self) -> None:
        """While the trainer steps: the buffer has its slots (once per buffer: a
        re-created one gets them again), every live env manager takes work, and an env
        manager that was lost has its groups handed back. Local checks only: no call
        unless something changed."""
        if self._slotted is not self.actors.buffer:
            slots = Slots(slot_capacity(self.graph.algo), self.sequence)
            self.ask_buffer("open_slots", slots)
            self._slotted = self.actors.buffer
        live = {id(m) for m in self.actors.managers}
        for key, (mgr, holder, fut) in list(self.takers.items()):
            if key in live and not fut.done():
                continue
            del self.takers[key]
            error = None
            if key in live:
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001
                    error = e
            if key not in live or (error is not None and self.lost(error, mgr)):
                self.ask_buffer("holder_lost", holder)  # its groups go back in line
            elif error is not None:
                self.errors.append(f"{holder}: {type(error).__name__}: {error}")
        for mgr in list(self.actors.managers):
            if id(mgr) not in self.takers:
                self.take_work(mgr)

    def take_work(self, mgr) -> None:
        """Start ``mgr``'s ``take_work`` loop for the tasks of its env pool."""
        tasks = [t.name for t in self.graph.tasks
                 if any(m is mgr for m in self.actors.managers_for(t))]
        self._holders += 1
        holder = f"{mgr._address}#{self._holders}"
        r = self.graph.rollout
        try:
            fut = mgr.take_work(holder, tasks, r.redundancy, r.backup_after)
        except Exception as e:  # noqa: BLE001 - its worker is gone: healed away
            if not self.lost(e, mgr):
                raise
            return
        self.takers[id(mgr)] = (mgr, holder, fut)

    def step(self, step: int) -> dict:
        metrics = self.train(step, while_waiting=self.keep_taking)
        min_version = metrics["version"] - self.graph.algo.alpha
        metrics["rollout/aborted_now"] = sum(self.call_managers("abort_older_than",
                                                                min_version))
        return metrics
