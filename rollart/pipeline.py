"""How rollout and training interleave: the three modes, on the same actors.

==========  ==========================================================================
mode        one trainer step
==========  ==========================================================================
``async``   Trajectory-level: groups keep flowing (``groups_per_step * alpha`` ahead,
            ``redundancy`` × members each, extras cancelled); the trainer takes any
            ``alpha``-fresh complete groups; weights update at the next decode step;
            members that can no longer meet the bound are aborted and replaced.
``one-off`` One-step off-policy: the next batch rolls out (turn by turn, batch-level
            barriers) while the trainer trains on the current one (``alpha = 1``).
``sync``    The strengthened synchronous baseline: roll out a batch turn by turn with
            every worker on the trainer's version, then train with rollout stopped,
            then sync weights (``alpha = 0``).
==========  ==========================================================================

Every step ends with the ledger's counts (``traj/<state>``) and a check that they add
up to the launches (checked by the buffer's ledger; a mismatch raises
``AccountingError``). Used by ``rollart.control``.
"""

from __future__ import annotations

import abc
import random
import time

from rollart.buffer.ledger import STATES


class Pipeline(abc.ABC):
    """Shared by the modes: picks (task, seed) for groups, updates weights, counts."""

    def __init__(self, actors, graph):
        self.actors, self.graph = actors, graph
        self.rng = random.Random(graph.seed)
        self.weights = list(graph.task_weights or [1.0] * len(graph.tasks))
        self.n_groups = 0
        self.errors: list[str] = []

    def next_group(self) -> tuple:
        task = self.rng.choices(self.graph.tasks, weights=self.weights)[0]
        gid = f"g{self.n_groups:06d}"
        self.n_groups += 1
        return task, self.rng.randrange(1_000_000), gid, self.graph.algo.group_size

    def state(self) -> dict:
        """What a checkpoint needs to continue the group sequence (``rollart.checkpoint``)."""
        return {"n_groups": self.n_groups, "rng": self.rng.getstate()}

    def load_state(self, state: dict) -> None:
        from rollart.checkpoint import _tupled

        self.n_groups = int(state["n_groups"])
        self.rng.setstate(_tupled(state["rng"]))

    def manager(self, i: int, task=None):
        """The ``i``-th env manager (among those on ``task``'s env pool, if given)."""
        managers = self.actors.managers_for(task) if task is not None else \
            self.actors.managers
        return managers[i % len(managers)]

    @abc.abstractmethod
    def step(self, step: int) -> dict:
        """One trainer step in this mode; returns the trainer's metrics."""

    def train(self, step: int, while_waiting=None) -> dict:
        fut = self.actors.trainer.train_step(self.actors.buffer, step)
        while not fut.done():
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.02)
        return fut.result()

    def publish(self, version: int, wait: bool) -> None:
        """Tell the inference workers about ``version``; with ``wait``, until they hold it."""
        futs = [w.update_weights(version) for w, _, _ in self.actors.workers]
        if wait:
            for f in futs:
                f.result()
            for w, _, _ in self.actors.workers:
                w.wait_version(version).result()

    def counts(self) -> dict:
        """The ledger's counts; the buffer raises ``AccountingError`` if they don't add up."""
        c = self.actors.buffer.counts().result()
        return {f"traj/{k}": c[k] for k in ("launched", *STATES)}

    def rollout_stats(self) -> dict:
        """Cumulative engine and env-manager figures (for throughput and busy fraction)."""
        workers = [w.stats() for w, _, _ in self.actors.workers]
        managers = [m.stats() for m in self.actors.managers]
        ws, ms = [f.result() for f in workers], [f.result() for f in managers]
        turns = sum(m["turns"] for m in ms)
        return {
            "rollout/tokens_generated": sum(w["tokens_generated"] for w in ws),
            "rollout/engine_busy_s": sum(w["busy_seconds"] for w in ws),
            "rollout/suspends": sum(w.get("suspends", 0) for w in ws),
            "rollout/turns": turns,
            "rollout/turn_overhead_s": sum(m["turn_overhead_s"] * m["turns"] for m in ms)
            / max(turns, 1),
            "env/step_p99_s": max(m["env_step_p99"] for m in ms),
            # share of prompt tokens served from a worker's prefix cache; KV moved for PD
            "rollout/prefix_reuse": sum(w.get("prefix_hit_tokens", 0) for w in ws)
            / max(sum(w.get("prefix_prompt_tokens", 0) for w in ws), 1),
            "rollout/kv_bytes_moved": sum(w.get("kv_bytes_received", 0) for w in ws),
        }

    def run_batch(self, groups: list[tuple]):
        """Start a lockstep batch, split across the env managers; returns futures."""
        per: dict[int, tuple] = {}
        for i, g in enumerate(groups):
            m = self.manager(i, g[0])
            per.setdefault(id(m), (m, []))[1].append(g)
        return [m.run_batch(gs) for m, gs in per.values()]


class AsyncPipeline(Pipeline):
    """Trajectory-level asynchrony with redundancy and abort-and-replace."""

    def __init__(self, actors, graph):
        super().__init__(actors, graph)
        self.inflight: dict[str, object] = {}

    def top_up(self) -> None:
        for gid, fut in list(self.inflight.items()):
            if fut.done():
                del self.inflight[gid]
                try:
                    fut.result()
                except Exception as e:  # a manager-level error: record, keep going
                    self.errors.append(f"{gid}: {type(e).__name__}: {e}")
        ready = self.actors.buffer.counts().result()["groups_complete"]
        target = self.graph.algo.groups_per_step * max(self.graph.algo.alpha, 1)
        while len(self.inflight) + ready < target:
            task, seed, gid, size = self.next_group()
            self.inflight[gid] = self.manager(self.n_groups, task).run_group(
                task, seed, gid, size, redundancy=self.graph.rollout.redundancy)

    def step(self, step: int) -> dict:
        metrics = self.train(step, while_waiting=self.top_up)
        version = metrics["version"]
        self.publish(version, wait=False)
        min_version = version - self.graph.algo.alpha
        aborted = [m.abort_older_than(min_version) for m in self.actors.managers]
        metrics["rollout/aborted_now"] = sum(f.result() for f in aborted)
        return metrics


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
        for f in self.pending:  # batch k is complete (its turns ran in lockstep)
            f.result()
        self.pending = self.launch_batch()  # batch k+1 overlaps training on batch k
        metrics = self.train(step)
        self.publish(metrics["version"], wait=False)
        return metrics


class SyncPipeline(Pipeline):
    """Roll out a batch on the current version, then train with rollout stopped."""

    def step(self, step: int) -> dict:
        batch = self.run_batch([self.next_group()
                                for _ in range(self.graph.algo.groups_per_step)])
        for f in batch:
            f.result()
        metrics = self.train(step)
        self.publish(metrics["version"], wait=True)
        return metrics


def make_pipeline(actors, graph) -> Pipeline:
    cls = {"async": AsyncPipeline, "one-off": OneOffPipeline, "sync": SyncPipeline}
    return cls[graph.mode](actors, graph)
