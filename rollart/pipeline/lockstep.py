"""The lockstep baselines (``one-off``, ``sync``): the driver launches each batch.

Consumes the actors and ``Graph`` like every mode (``rollart.pipeline.base.Pipeline``);
draws each batch's groups in the driver and runs it through ``EnvManager.run_batch``
(a ``TurnBarrier`` at every turn). Built by ``rollart.pipeline.make_pipeline``.
"""

from __future__ import annotations

from rollart.pipeline.base import Pipeline


class OneOffPipeline(Pipeline):
    """Batch k+1 rolls out (lockstep) while the trainer trains on batch k."""

    def __init__(self, actors, graph):
        super().__init__(actors, graph)
        self.pending = None

    def launch_batch(self):
        return self.run_batch([self.next_group()
                               for _ in range(self.graph.algo.groups_per_step)])

    def step(self, step: int) -> dict:
        if self.pending is None:
            self.pending = self.launch_batch()
        self.wait_batch(self.pending)  # batch k is complete (its turns ran in lockstep)
        self.refill()
        if self.version is not None:  # batch k+1 must be within the bound at step k+1
            self.wait_workers(self.version)
        self.pending = self.launch_batch()  # batch k+1 overlaps training on batch k
        return self.train(step)


class SyncPipeline(Pipeline):
    """Roll out a batch on the current version, then train with rollout stopped."""

    def step(self, step: int) -> dict:
        batch = self.run_batch([self.next_group()
                                for _ in range(self.graph.algo.groups_per_step)])
        self.wait_batch(batch)
        self.refill()
        metrics = self.train(step)
        self.wait_workers(metrics["version"])  # the next batch rolls out on it
        return metrics
