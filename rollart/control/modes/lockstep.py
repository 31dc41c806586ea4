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

import logging
import time

from rollart.control.fleet import ActorLost
from rollart.control.modes.base import Pipeline

logger = logging.getLogger(__name__)


class Lockstep(Pipeline):
    """The driver launches each batch and waits for it; groups of a lost env manager
    restart their missing members on a live one, and groups whose every member failed
    are re-run (``refill``)."""

    def __init__(self, fleet, graph):
        super().__init__(fleet, graph)
        self.groups: dict[str, tuple] = {}  # gid -> (task, seed, size, restarts)
        self.placed: dict[str, tuple] = {}  # gid -> (future, manager) of a placed group

    def next_group(self) -> tuple:
        task, seed, gid, size = super().next_group()
        self.groups[gid] = (task, seed, size, 0)
        return task, seed, gid, size

    def run_batch(self, groups: list[tuple]):
        """Start a lockstep batch, split across the env managers; returns futures."""
        per: dict[int, tuple] = {}
        for i, g in enumerate(groups):
            m = self.fleet.manager(i, g[0])
            per.setdefault(id(m), (m, []))[1].append(g)
        return [(m.run_batch(gs), gs, m) for m, gs in per.values()]

    def wait_batch(self, batch) -> None:
        """Wait for a ``run_batch``; groups of a lost manager restart elsewhere (without
        the lockstep barrier: the rest of their batch has moved on)."""
        restarted = []
        for fut, groups, mgr in batch:
            try:
                self.wait(fut, mgr)
            except ActorLost:
                restarted += [(g[2], self.restart_group(g[2])) for g in groups]
        for gid, fut in restarted:
            self.wait_group(gid, fut)

    def roll_out(self, groups: list[tuple]) -> None:
        """Run ``groups`` (``next_group`` tuples) to the end: a lockstep batch here."""
        self.wait_batch(self.run_batch(groups))

    def refill(self) -> None:
        """A group whose every member failed leaves nothing to train on; roll out
        replacement groups until one step's worth is complete (else the trainer would
        wait for groups nobody runs). A failure storm stops the run here."""
        need = self.graph.algo.groups_per_step
        while True:
            ready = self.fleet.ask_buffer("counts")["groups_complete"]
            if ready >= need:
                return
            self.check_failures(every=0.0)
            self.refilled_groups += need - ready
            self.roll_out([self.next_group() for _ in range(need - ready)])

    def restart_group(self, gid: str, redundancy: float = 1.0):
        """The manager running ``gid`` was lost: fail its in-flight members and run the
        missing ones on a live manager. Returns the new future, or None if complete."""
        self.heal()
        info = self.fleet.ask_buffer("orphan_group", gid)
        task, seed, size, restarts = self.groups[gid]
        need = size - info["arrived"]
        if info["complete"] or need <= 0:
            return None
        restarts += 1
        self.groups[gid] = (task, seed, size, restarts)
        self.restarted_groups += 1
        fut, mgr = self.fleet.on_live_manager(
            self.n_groups + restarts, task,
            lambda m: m.run_group(task, seed, gid, size, redundancy=redundancy, need=need,
                                  backup_after=self.graph.rollout.backup_after,
                                  first_index=1000 * restarts))
        self.placed[gid] = (fut, mgr)
        return fut

    def wait_group(self, gid: str, fut, redundancy: float = 1.0) -> None:
        """Wait for a placed group (a restarted one, or ``sync+``'s), restarting its
        missing members with ``redundancy`` if its manager is lost."""
        while fut is not None:
            try:
                self.wait(fut, self.placed[gid][1])
                break
            except ActorLost:
                fut = self.restart_group(gid, redundancy)
        self.placed.pop(gid, None)

    def wait_workers(self, version: int) -> None:
        """Until every live inference worker holds ``version`` (they find it in the
        weight store themselves; all are asked at once: ``ask_versions``). A worker lost
        meanwhile is skipped (its replacement loads the newest version); one that fails
        to load it is asked again while the stall check bounds the wait."""
        for w, fut in self.ask_versions(version):
            while fut is not None:
                try:
                    self.fleet.until_done(fut, self.heal, w)  # a stall raises here
                except ActorLost:
                    break
                fut = self._loaded(w, fut, version)

    def _loaded(self, worker, fut, version: int):
        """None once ``worker`` holds ``version`` (or was lost); after a failed load, the
        future of asking it again."""
        try:
            self.fleet.attempt(worker, fut.result)
            return None
        except ActorLost:
            return None
        except Exception as e:  # noqa: BLE001 - the load failed: ask again
            logger.warning("inference worker %s: %s; waiting on", worker._address, e)
        time.sleep(0.25)
        self.heal()
        try:
            return self.fleet.submit(worker, "wait_version", version)
        except ActorLost:
            return None


class OneOffPipeline(Lockstep):
    """Batch k+1 rolls out (lockstep) while the trainer trains on batch k."""

    def __init__(self, fleet, graph):
        super().__init__(fleet, graph)
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


class SyncPipeline(Lockstep):
    """Roll out a batch on the current version, then train with rollout stopped."""

    def step(self, step: int) -> dict:
        batch = self.run_batch([self.next_group()
                                for _ in range(self.graph.algo.groups_per_step)])
        self.wait_batch(batch)
        self.refill()
        metrics = self.train(step)
        self.wait_workers(metrics["version"])  # the next batch rolls out on it
        return metrics


class SyncPlusPipeline(Lockstep):
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

            fut, mgr = self.fleet.on_live_manager(i, task, call)
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
