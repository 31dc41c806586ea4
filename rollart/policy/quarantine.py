"""Tasks that fail every trajectory, stopped: a plain object the pipeline feeds each step.

A task is stopped once, for ``Rollout.failing_task_steps`` (K) trainer steps in a row,
every one of its trajectories that reached the buffer failed with an error (its
cumulative ``failed`` count moved as much as its ``received`` one: the buffer's
per-task counts, ``rollart.buffer.arrivals.TASK_COUNTS``). A reward of 0 is no failure;
one trajectory that did not fail ends the streak; a step in which none of its
trajectories arrived leaves the streak as it was. A stopped task is not launched again
(``GroupSequence.stop``, ``rollart.policy.admission``): without this a broken env was
relaunched group after group for the whole run (790 failed rows of one task in 12
steps), each group replacing its failed members once more. Its groups already in
flight finish. The pipeline (``rollart.control.modes.base``) names it in one console
line, counts it (``rollout/tasks_stopped``) and stops the run once every task is
stopped (``TasksStoppedError``). Pure: no Dask, no logging.

>>> q = FailingTasks(steps=2)
>>> bad = {"calc": {"received": 4, "failed": 4}, "qa": {"received": 4, "failed": 1}}
>>> q.update(bad)
[]
>>> q.update({"calc": {"received": 8, "failed": 8}, "qa": {"received": 8, "failed": 1}})
['calc']
>>> q.update({"calc": {"received": 9, "failed": 9}}), q.stopped
([], ['calc'])
"""

from __future__ import annotations


class TasksStoppedError(RuntimeError):
    """Every task of the run was stopped (``FailingTasks``): none is left to train on."""


class FailingTasks:
    """Per task, the trainer steps in a row in which all its arrivals failed (module
    docstring); ``steps`` = K, 0 = never stop a task."""

    def __init__(self, steps: int, stopped=()):
        self.steps = int(steps)
        self.stopped: list[str] = list(stopped)
        self.streak: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}  # task -> (received, failed) seen

    def update(self, per_task: dict | None) -> list[str]:
        """Feed one step's cumulative per-task counts; returns the tasks stopped now."""
        out = []
        for task, c in sorted((per_task or {}).items()):
            received, failed = int(c.get("received", 0)), int(c.get("failed", 0))
            seen, lost = self._last.get(task, (0, 0))
            self._last[task] = (received, failed)
            new, new_failed = received - seen, failed - lost
            if new <= 0 or task in self.stopped:  # nothing arrived (or counts restarted)
                continue
            self.streak[task] = self.streak.get(task, 0) + 1 if new_failed >= new else 0
            if self.steps and self.streak[task] >= self.steps:
                self.stopped.append(task)
                out.append(task)
        return out
