"""``Arrivals``: the ``SampleBuffer``'s part that counts what reached it, besides the ledger.

Holds the counters every metrics row carries next to the ledger's (``received``:
arrivals; ``orphaned``: ids failed because their worker was lost; ``ignored``: arrivals
of orphaned ids, a recovered buffer's late members), the ids given up as lost (a late
arrival of one is ignored), the failed arrivals since the last good one and what the
latest failures said (a run whose every trajectory fails is stopped by the pipeline:
``rollart.control.modes``; so is one whose trajectory met a configuration error,
``STOPS_RUN``), and per task what arrived (``tasks``: the step rows'
``traj/<kind>/<task>``, ``rollart.observe.figures``). Used by ``rollart.buffer.buffer``
(each arrival, each orphan) and ``rollart.buffer.restore`` (counters, per-task counts and
orphans continued from durable state).
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from rollart.types import Trajectory, TrajState

logger = logging.getLogger(__name__)
FAILED = TrajState.FAILED.value
#: what ``Arrivals.tasks`` counts per task, cumulative: arrivals, failed ones, truncated
#: ones, ones with at least one invalid tool call, tool calls made, and arrivals that
#: were offered tools (``Trajectory.tool_calls`` not None)
TASK_COUNTS = ("received", "failed", "truncated", "invalid_tool_calls", "tool_calls",
               "tools_offered")
#: a failed trajectory whose error starts so stops the run (``Arrivals.stop``, read by
#: the driver: ``rollart.control.modes.base``): a configuration error that every
#: trajectory of its task meets and no retry fixes, e.g. an agent's request the chat
#: template can never serve (``rollart.chat.template_support.ChatTemplateError``, as the
#: trajectory runner writes errors: ``"<class>: <message>"``)
STOPS_RUN = ("ChatTemplateError: ",)


def is_failed(traj: Trajectory) -> bool:
    """Failed by its state or by its outcome."""
    return getattr(traj.state, "value", traj.state) == FAILED or traj.outcome == FAILED


class Arrivals:
    """Arrival counters, the lost ids and the failure streak (module docstring).

    >>> a = Arrivals()
    >>> a.orphaned(["t-0"]); a.ignore("t-0"), a.ignore("t-1"), a.counts()
    (True, False, {'received': 0, 'orphaned': 1, 'ignored': 1})
    >>> t = Trajectory("t-2", "calc", "g", 0, [], [], [], [], [], outcome="truncated",
    ...                tool_calls=3, invalid_tool_calls=1)
    >>> a.received(t); a.tasks()["calc"]["truncated"], a.tasks()["calc"]["tool_calls"]
    (1, 3)
    """

    def __init__(self):
        self._counts = dict(received=0, orphaned=0, ignored=0)
        self._orphans: set[str] = set()
        self.streak = 0  # failed arrivals since the last good one
        self._errors: deque[str] = deque(maxlen=5)
        self._first: dict[str, str] = {}  # per task, what its first failed trajectory said
        self._stop: str | None = None  # the first failure that stops the run (STOPS_RUN)
        self._tasks: dict[str, Counter] = {}

    def ignore(self, traj_id: str) -> bool:
        """True for a trajectory already given up as lost (its late arrival is ignored,
        and counted so)."""
        if traj_id in self._orphans:
            self._counts["ignored"] += 1
            logger.warning("trajectory %s arrived after it was counted lost; ignored", traj_id)
            return True
        return False

    def received(self, traj: Trajectory) -> None:
        """One arrival (not an ignored one), counted for its task too."""
        self._counts["received"] += 1
        c = self._tasks.setdefault(traj.task, Counter())
        c["received"] += 1
        c["failed"] += is_failed(traj)
        c["truncated"] += traj.outcome == "truncated"
        if traj.tool_calls is not None:
            c["tools_offered"] += 1
            c["tool_calls"] += traj.tool_calls
            c["invalid_tool_calls"] += bool(traj.invalid_tool_calls)

    def tasks(self) -> dict[str, dict[str, int]]:
        """Per task seen, ``TASK_COUNTS`` so far."""
        return {t: {k: c[k] for k in TASK_COUNTS} for t, c in sorted(self._tasks.items())}

    def noted(self, traj: Trajectory, failed: bool) -> None:
        """The streak goes on with a failed ``traj`` (what it said kept), ends with a
        good one."""
        if failed:
            self.streak += 1
            self._errors.append(f"{traj.task} {traj.traj_id}: {traj.error or 'failed'}")
            if traj.error:
                self._first.setdefault(traj.task, traj.error)
            if self._stop is None and traj.error.startswith(STOPS_RUN):
                self._stop = f"{traj.task}: {traj.error}"
        else:
            self.streak = 0

    def error(self, why: str) -> None:
        """A failure that is no arrival (a group's run raised)."""
        self._errors.append(why)

    def first_errors(self) -> dict[str, str]:
        """Per task whose trajectories failed with an error, the first error's text (the
        driver names it in one console line as soon as it sees it)."""
        return dict(self._first)

    def stop(self) -> str | None:
        """``"<task>: <error>"`` of the first failure that stops the run (``STOPS_RUN``),
        or None.

        >>> a = Arrivals()
        >>> t = Trajectory("t-0", "qa", "g", 0, [], [], [], [], [], outcome="failed",
        ...                error="ChatTemplateError: set tools_in_prompt")
        >>> a.noted(t, True); a.stop()
        'qa: ChatTemplateError: set tools_in_prompt'
        """
        return self._stop

    def errors(self) -> list[str]:
        """What the latest failures said, newest last (at most 5)."""
        return list(self._errors)

    def orphaned(self, traj_ids: list[str]) -> None:
        """``traj_ids`` were given up as lost with their worker."""
        self._orphans.update(traj_ids)
        self._counts["orphaned"] += len(traj_ids)

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def record(self) -> dict:
        """``counts()`` and, under ``"tasks"``, ``tasks()``: what ``load`` continues from."""
        return {**self._counts, "tasks": self.tasks()}

    def load(self, counts: dict | None, orphans=None) -> None:
        """Continue from recorded counters (``record()``; missing ones are 0) and, when
        given, the ids given up as lost."""
        counts = counts or {}
        self._counts = {k: int(counts.get(k, 0)) for k in self._counts}
        self._tasks = {t: Counter({k: int(c.get(k, 0)) for k in TASK_COUNTS})
                       for t, c in (counts.get("tasks") or {}).items()}
        if orphans is not None:
            self._orphans = set(orphans)
