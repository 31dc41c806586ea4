"""Tasks that go silent, named: a plain object the control loop feeds each step's row.

A task goes silent when, for ``Rollout.silent_task_steps`` (K) trainer steps in a row,

* ``untrainable``: none of its groups in the trained batch was trainable (the row's
  ``trainer/trainable_groups/<task>`` is 0: its groups all had equal rewards, so GRPO's
  advantages are zero; or its trajectories failed or never reached the batch), or
* ``no_tool_calls``: its trajectories were offered tools (``Trajectory.tool_calls`` not
  None) and made no tool call at all (the cumulative ``task/tool_calls/<task>`` did
  not move while ``task/received/<task>`` did; a step in which none of its trajectories
  arrived leaves this streak as it was). An ``AgentTask`` is exempt: its agent, not an
  env, decides which tools it offers.

The control loop watches every task with a weight above 0 (``Graph.task_weights``).
``SilentTasks.update(row, per_task)`` returns the ``Notice`` s of that step: one when a
task goes silent, one when it recovers, nothing on the steps between, so the console
(``rollart.control.loop`` logs them) and the dashboard (``Monitor.notice``, shown by
``RunState.warnings``) say it once each way. Pure: no Dask, no logging.

>>> w = SilentTasks(["calc"], steps=2)
>>> row = {"trainer/trainable_groups/calc": 0, "task/received/calc": 8}
>>> w.update(row), [n.reason for n in w.update(row)], w.update(row)
([], ['untrainable'], [])
>>> [(n.reason, n.active) for n in w.update({**row, "trainer/trainable_groups/calc": 1})]
[('untrainable', False)]
"""

from __future__ import annotations

from dataclasses import dataclass

REASONS = ("untrainable", "no_tool_calls")


@dataclass(frozen=True)
class Notice:
    """A task that went silent (``active``) or recovered, and the line that says so."""

    task: str
    reason: str  # one of REASONS
    active: bool
    text: str

    def message(self, run: str) -> dict:
        """The dashboard's message (``rollart.observe.metrics.RunState.ingest``)."""
        return {"kind": "warning", "run": run, "task": self.task, "reason": self.reason,
                "active": self.active, "text": self.text}


class SilentTasks:
    """Streaks of silent steps per task and reason (module docstring); ``steps`` = K,
    0 = never warn; ``exempt``: tasks the tool rule skips (agent tasks)."""

    def __init__(self, tasks, steps: int, exempt=()):
        self.tasks, self.steps, self.exempt = list(tasks), steps, set(exempt)
        self.streak = {(t, r): 0 for t in self.tasks for r in REASONS}
        self.active: set[tuple[str, str]] = set()
        self._last: dict[str, tuple[int, int, int]] = {}  # task -> (received, calls, offered)

    def update(self, row: dict, per_task: dict | None = None) -> list[Notice]:
        """The notices of the step whose metrics row is ``row``; ``per_task``: the
        buffer's per-task counts (``SampleBuffer.stats()["tasks"]``), for
        ``tools_offered``."""
        out = []
        for task in self.tasks:
            untrainable = not row.get(f"trainer/trainable_groups/{task}")
            out += self._judge(task, "untrainable", untrainable, row)
            silent = self._no_tool_calls(task, row, (per_task or {}).get(task, {}))
            if silent is not None:
                out += self._judge(task, "no_tool_calls", silent, row)
        return out

    def _no_tool_calls(self, task: str, row: dict, counts: dict) -> bool | None:
        """True/False: this step's arrivals made no tool call / some; None: no evidence."""
        now = (row.get(f"task/received/{task}", 0), row.get(f"task/tool_calls/{task}", 0),
               counts.get("tools_offered", 0))
        before, self._last[task] = self._last.get(task, (0, 0, 0)), now
        if task in self.exempt or now[0] == before[0] or now[2] == before[2]:
            return None  # nothing arrived, or nothing that was offered tools
        return now[1] == before[1]

    def _judge(self, task: str, reason: str, silent: bool, row: dict) -> list[Notice]:
        key = (task, reason)
        if not silent:
            self.streak[key] = 0
            if key in self.active:
                self.active.discard(key)
                return [Notice(task, reason, False, f"task {task!r} recovered at step "
                               f"{row.get('step', '?')}: {_RECOVERED[reason]}")]
            return []
        self.streak[key] += 1
        if self.steps and self.streak[key] >= self.steps and key not in self.active:
            self.active.add(key)
            return [Notice(task, reason, True, _silent_text(task, reason, self.steps, row))]
        return []


_RECOVERED = {"untrainable": "a group of it is trainable again",
              "no_tool_calls": "its trajectories call tools again"}


def _silent_text(task: str, reason: str, steps: int, row: dict) -> str:
    counts = (f"so far: {row.get(f'task/received/{task}', 0)} of its trajectories "
              f"arrived, {row.get(f'task/failed/{task}', 0)} failed, "
              f"{row.get(f'task/truncated/{task}', 0)} truncated")
    if reason == "untrainable":
        return (f"task {task!r} produced no trainable group for {steps} steps (to step "
                f"{row.get('step', '?')}): its groups all had equal rewards, failed, or "
                f"none reached the batch ({counts}); check its env and reward, or that its "
                f"prompts fit the model's context")
    return (f"task {task!r} made no tool call for {steps} steps (to step "
            f"{row.get('step', '?')}) although its env declares tools ({counts}); check "
            f"that the chat template shows the tools and the tool-call format the model "
            f"uses")
