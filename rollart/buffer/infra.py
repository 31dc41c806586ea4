"""``InfraFailures``: the ``SampleBuffer``'s part that counts, per task, the members lost to
infrastructure and the groups they left too small to train.

An infrastructure failure is a member lost to the machinery, not to the policy: its env
raised, hung past a time-out or returned garbage, its reward raised or timed out (the
runner then returns it ``failed``: ``rollart.env.trajectory``), or its worker was lost
(orphaned: ``SampleBuffer.holder_lost``, ``orphan_group``). A trajectory the env scored,
whatever its reward (a malformed action the env penalises, a plain failure, a
truncation), is the policy's outcome and trains. The rule, one place each:

* re-run: a failed member is replaced by a new member of its group, at most
  ``group_size`` times per group (``EnvManager``; not in the lockstep baselines, whose
  turns run in a barrier); a lost worker's members run again elsewhere
  (``Admission.hand_out_again``, ``Lockstep.restart_group``);
* dropped: a failed member past that bound is dropped from its group, written as
  ``failed``: never a row with reward 0 among its group's advantages;
* too small: a group left with fewer trainable members than ``min_group``
  (``GRPO.min_group_size``; a group declared smaller needs all of them:
  ``rollart.policy.redundancy.min_members``, the simulator's rule too) is not trained;
  its members leave as ``dropped`` (``Groups.completed``), and the slot frees for
  another group (the lockstep baselines re-run it: ``Lockstep.refill``).

Counts (cumulative per task, ``INFRA_COUNTS``): ``infra_failed`` members that failed,
``infra_rerun`` those replaced by a new member, ``infra_dropped`` those dropped from
their group, ``groups_too_small`` groups not trained. Orphaned members are counted by
``rollart.buffer.arrivals`` (the ledger knows their ids, not their task). Read into the
step rows by ``rollart.observe.figures`` (``rollout/infra_*``, ``task/infra_*/<task>``).
"""

from __future__ import annotations

from collections import Counter

#: what ``InfraFailures.tasks`` counts per task (module docstring)
INFRA_COUNTS = ("infra_failed", "infra_rerun", "infra_dropped", "groups_too_small")


class InfraFailures:
    """Per task, ``INFRA_COUNTS`` so far.

    >>> f = InfraFailures()
    >>> f.failed("calc", rerun=True); f.failed("calc", rerun=False); f.too_small("calc")
    >>> f.tasks()["calc"]
    {'infra_failed': 2, 'infra_rerun': 1, 'infra_dropped': 1, 'groups_too_small': 1}
    """

    def __init__(self):
        self._tasks: dict[str, Counter] = {}

    def _of(self, task: str) -> Counter:
        return self._tasks.setdefault(task, Counter())

    def failed(self, task: str, rerun: bool) -> None:
        """A member of ``task`` failed: replaced by a new member (``rerun``) or dropped
        from its group."""
        c = self._of(task)
        c["infra_failed"] += 1
        c["infra_rerun" if rerun else "infra_dropped"] += 1

    def too_small(self, task: str) -> None:
        """A group of ``task`` ended with too few trainable members: not trained."""
        self._of(task)["groups_too_small"] += 1

    def tasks(self) -> dict[str, dict[str, int]]:
        return {t: {k: c[k] for k in INFRA_COUNTS} for t, c in sorted(self._tasks.items())}

    def totals(self) -> dict[str, int]:
        """``INFRA_COUNTS`` summed over the tasks."""
        return {k: sum(c[k] for c in self._tasks.values()) for k in INFRA_COUNTS}

    def load(self, tasks: dict | None) -> None:
        """Continue from ``tasks()`` as recorded (a journal entry, a snapshot)."""
        self._tasks = {t: Counter({k: int(c.get(k, 0)) for k in INFRA_COUNTS})
                       for t, c in (tasks or {}).items()}
