"""``rollart.chaos.workload``'s pooled sandboxes as the simulator's env cost.

Consumes a ``rollart.chaos.workload.Workload``; produces ``SandboxPoolCost``, an env cost
the simulator (``rollart.sim.cluster``) samples as it samples an ``EnvCost``: a reset per
trajectory, a step per turn. It follows the workload's own rules, so the simulator can
be calibrated on the pipeline benchmark's envs (``rollart.sim.heldout``):

* a reset attempt takes a warm sandbox from the pool if one is idle (``reuse_reset`` +
  ``reset_cpu``) or makes one (``create`` + ``create_cpu``); it fails with
  ``reset_fail_prob``, then waits ``fail_wait`` and discards that sandbox, and the next
  attempt takes or makes another, up to ``max_reset_attempts``;
* a step is ``step_cpu`` of work and a ``step_wait``;
* a trajectory that ends gives its sandbox back (``release``; at most ``pool_size`` idle).

Every duration runs at ``Workload.scale``, as the workload runs it. CPU work counts as
the time it takes one idle core (the hashing threads release the GIL; on a busy machine
they run longer, which this model leaves out: a step's CPU is 2 ms against a median wait
of 18 ms at the default scale). Stated simplification: an episode whose every reset
attempt fails (``reset_fail_prob ** max_reset_attempts``: 0.24% at the defaults) fails
in the real run; here it pays every attempt's wait and goes on.

The pool is the state of one env process: give each simulated run its own instance
(``rollart.sim.heldout`` makes one per ``SimConfig``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from rollart.chaos.workload import Workload

__all__ = ["SandboxPoolCost"]


@dataclass
class SandboxPoolCost:
    """The pooled sandboxes of one env process, sampled by the simulator."""

    workload: Workload
    name: str = "sandbox-pool"
    idle: int = 0  # warm sandboxes in the pool
    counts: dict = field(default_factory=lambda: {"created": 0, "reused": 0,
                                                  "reset_failures": 0, "steps": 0})

    def sample_reset(self, rng: random.Random) -> float:
        """Seconds of one trajectory's reset; it then holds a sandbox until ``release``."""
        w, total = self.workload, 0.0
        for _ in range(w.max_reset_attempts):
            cold = self.idle == 0
            if not cold:
                self.idle -= 1
            self.counts["created" if cold else "reused"] += 1
            latency, cpu = (w.create, w.create_cpu) if cold else (w.reuse_reset, w.reset_cpu)
            fails = rng.random() < w.reset_fail_prob
            total += cpu * w.scale + w.wait(w.fail_wait if fails else latency, rng)
            if not fails:
                break
            self.counts["reset_failures"] += 1  # that sandbox is discarded
        return total

    def sample_step(self, rng: random.Random) -> tuple[float, bool]:
        """(seconds, failed) of one step: its CPU work and its wait; steps never fail."""
        w = self.workload
        self.counts["steps"] += 1
        return w.step_cpu * w.scale + w.wait(w.step_wait, rng), False

    def release(self) -> None:
        """A trajectory that reset ended: its sandbox goes back to the pool."""
        if self.idle < self.workload.pool_size:
            self.idle += 1
