"""The batch-at-a-time baselines (``one-off``, ``sync``, ``sync+``): the driver draws
and launches each step's batch.

Consumes the actors and ``Graph`` like every mode (``rollart.control.modes.base.Pipeline``).
``one-off`` and ``sync`` run a batch through ``EnvManager.run_batch`` (a
``TurnBarrier`` at every turn); ``sync+`` runs each group on its own
(``EnvManager.run_group``, with ``Rollout.redundancy``/``backup_after``), so no member
waits for another's turn, and stops rollout while the trainer steps. Built by
``rollart.control.modes.make_pipeline``.
"""

from __future__ import annotations

from rollart.control.modes.base import Pipeline


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


class SyncPlusPipeline(Pipeline):
    """The paper's main baseline (§7.1): trajectory-level env interaction and reward
    (each group runs on its own, ``redundancy`` extras cancelled once ``group_size``
    members finished), but rollout stops while the trainer steps and weights sync:
    launch a step's groups on the trainer's version, wait for all of them, train, wait
    until every inference worker loaded the new version (``alpha = 0``)."""

    def roll_out(self, groups: list[tuple]) -> None:
        """Run each group with ``EnvManager.run_group`` (no barrier), spread over the env
        managers of its task; a group whose manager is lost restarts elsewhere."""
        r = self.graph.rollout
        placed = []
        for i, (task, seed, gid, size) in enumerate(groups):
            def call(m, task=task, seed=seed, gid=gid, size=size):
                return m.run_group(task, seed, gid, size, redundancy=r.redundancy,
                                   backup_after=r.backup_after)

            fut, mgr = self.on_live_manager(i, task, call)
            self.placed[gid] = (fut, mgr)
            placed.append((gid, fut))
        for gid, fut in placed:
            self.wait_group(gid, fut, r.redundancy)

    def step(self, step: int) -> dict:
        self.roll_out([self.next_group() for _ in range(self.graph.algo.groups_per_step)])
        self.refill()  # groups whose every member failed are re-run (as in sync)
        metrics = self.train(step)  # rollout is stopped: every group above has ended
        self.wait_workers(metrics["version"])  # the next batch rolls out on it
        return metrics
