"""The elastic reward pool's scaling as a plain decision.

Consumes the pool's demand (reward tasks waiting or running), its workers' idle times
and how many it has; produces the target size and which idle workers to retire. The
``ElasticPool`` (``rollart.reward.elastic``, Dask's adaptive core over its own workers)
calls it on every adapt tick; the cluster simulator (``rollart.sim``) calls the same
object for its elastic reward pool.

>>> s = Scaling(max_workers=4, threads=2, idle_timeout=10.0)
>>> s.target(demand=5), s.target(demand=0), s.target(demand=100)
(3, 0, 4)
>>> s.to_close({"a": 12.0, "b": 3.0, "c": 20.0}, busy={"c"}, planned=3, target=1)
['a']
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Scaling:
    """Target = ceil(demand / threads), between ``min_workers`` and ``max_workers``; a
    worker idle for ``idle_timeout`` seconds may retire, down to the target."""

    max_workers: int
    threads: int = 1
    idle_timeout: float = 0.25
    min_workers: int = 0

    def target(self, demand: int) -> int:
        """Workers wanted for ``demand`` tasks waiting or running."""
        want = math.ceil(max(demand, 0) / max(self.threads, 1))
        return max(self.min_workers, min(want, self.max_workers))

    def uncapped(self, demand: int) -> int:
        """The target before the ``max_workers`` cap (``AdaptiveCore`` caps it itself)."""
        return math.ceil(max(demand, 0) / max(self.threads, 1))

    def to_close(self, idle_s: dict, busy=(), planned: int = 0, target: int = 0) -> list:
        """Workers (keys of ``idle_s``: seconds idle) to retire: not ``busy``, idle for
        ``idle_timeout`` or more, at most ``planned - target`` of them."""
        idle = [n for n, s in idle_s.items() if n not in busy and s >= self.idle_timeout]
        return idle[:max(planned - target, 0)]
