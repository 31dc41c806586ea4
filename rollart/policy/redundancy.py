"""Redundant members and backups of a group as a plain decision.

Consumes a group's size (or the members it still needs), ``Rollout.redundancy`` and
``Rollout.backup_after``; produces how many members start with the group, how many
backups wait and after how many deliveries they start, and how many start then. The
``EnvManager`` (``rollart.env.manager``) calls it when it launches a group and each time
a member is delivered; the cluster simulator (``rollart.sim``) calls the same object.
A group keeps its first ``need`` finishers; the rest are cancelled. ``min_members``:
how many finished (not failed) members a group needs to be trained at all, decided here
for the ``SampleBuffer`` (``rollart.buffer.infra``) and the simulator alike.

>>> r = Redundancy(1.5)
>>> r.plan(8)
(12, 0, 0)
>>> Redundancy(1.5, backup_after=0.75).plan(8)
(8, 4, 6)
>>> Redundancy(1.5, backup_after=0.75).backups_now(4, delivered=6, backup_at=6, running=2)
2
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Redundancy:
    """Launch ``ceil(need × redundancy)`` members; with ``backup_after = f`` the extras
    are backups that start once ``ceil(f × need)`` members are delivered, at most one
    per member still running."""

    redundancy: float = 1.0
    backup_after: float | None = None

    def plan(self, need: int) -> tuple[int, int, int]:
        """``(start now, backups held back, deliveries before the backups start)``."""
        extra = max(need, math.ceil(need * self.redundancy)) - need
        if self.backup_after is not None and extra:
            return need, extra, max(1, math.ceil(self.backup_after * need))
        return need + extra, 0, 0

    @staticmethod
    def backups_now(backups: int, delivered: int, backup_at: int, running: int) -> int:
        """Backups to start after a delivery (0 until ``backup_at`` deliveries)."""
        if not backups or delivered < backup_at or not running:
            return 0
        return min(backups, running)

    @staticmethod
    def keep(delivered: int, need: int) -> bool:
        """A finisher is kept while the group has fewer than ``need`` deliveries."""
        return delivered < need


def min_members(min_group: int, size: int) -> int:
    """Finished members a group of ``size`` needs to be trained: ``min_group``
    (``GRPO.min_group_size``), or all of a group declared smaller.

    >>> min_members(2, 8), min_members(2, 1)
    (2, 1)
    """
    return max(1, min(int(min_group), int(size)))
