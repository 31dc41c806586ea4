"""Keep a run going when Dask workers die: find lost actors, re-create them, restart work.

Dask actors are not resilient by themselves: when the worker holding one dies, calls on
it raise (``OSError`` in flight, then "Worker holding Actor was lost") and the actor is
gone. The ``Supervisor`` is the driver-side answer; the pipeline calls ``heal()`` while
it waits and ``replace_trainer()`` when a trainer step is lost.

==================  ===================================================================
actor lost          what happens
==================  ===================================================================
``EnvManager``      the pipeline's ``run_group`` future fails; the buffer turns that
                    group's in-flight members into ``failed`` (``orphan_group``) and the
                    missing members restart on a live manager (new member ids, so none
                    is counted twice). A new manager starts once a CPU_ENV worker
                    without one appears (Nanny restart or a new worker).
``InferenceWorker`` each manager's ``LLMProxy`` re-sends the request to another worker;
                    a new actor starts on the restarted worker, loads the newest
                    weights, and the managers get the new worker list.
``Trainer``         the step's future fails; a new trainer starts on a TRAIN worker and
                    restores the run's last complete checkpoint (``rollart.checkpoint``:
                    weights, optimizer, KL reference, RNG); when the weight store holds
                    a newer published version, those weights are loaded on top (so
                    rollout never goes back in version). The lost step is re-run on
                    fresh groups; its batch stays counted ``trained`` (never re-used).
``SampleBuffer``    holds the ledger: its loss ends the run with ``RunLostError``.
==================  ===================================================================

Every replacement is an event ``{role, address, lost_s, recovered_s, recovery_s}``
(``recovery_s``: loss noticed → replacement ready), kept in ``Supervisor.events``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rollart.resources import cluster_tags
from rollart.rollout.proxy import is_worker_lost
from rollart.types import CPU_ENV, TRAIN

logger = logging.getLogger(__name__)

__all__ = ["FailureStormError", "RunLostError", "StallError", "Supervisor", "is_worker_lost"]


class RunLostError(RuntimeError):
    """A fault the run cannot recover from (e.g. the sample buffer's worker died)."""


class FailureStormError(RuntimeError):
    """Every recent trajectory failed (``Rollout.failure_streak_limit`` in a row): an
    env, reward or inference pool is broken, and going on would only burn compute."""


class StallError(RuntimeError):
    """Trajectories are in flight but none has settled for ``Rollout.stall_timeout``
    seconds: something waits forever (a hung engine, a reward that never answers, an
    env step with no time-out), and the trainer with it."""


@dataclass
class _Lost:
    role: str
    address: str
    tag: str
    since: float = field(default_factory=time.monotonic)


class Supervisor:
    """Replaces lost actors of ``actors`` (a ``rollart.control.Actors``) in place."""

    def __init__(self, client, actors, graph, model_path: str, run_dir, *,
                 store_url: str | None = None, checkpoint_url: str | None = None,
                 check_every: float = 0.5, wait_for_worker: float = 300.0):
        self.client, self.actors, self.graph = client, actors, graph
        self.model_path, self.run = model_path, run_dir.name
        self.store_url = store_url or str(run_dir / "weights")
        self.checkpoint_url = checkpoint_url
        self.check_every, self.wait_for_worker = check_every, wait_for_worker
        self.events: list[dict] = []
        self.pending: list[_Lost] = []
        self._last = 0.0
        self._n = 0
        self.t0 = time.monotonic()
        # hold every actor's key from the driver: a key no client wants is released by
        # the scheduler (and its actor deleted) when some other holder goes away
        self._holds = [self._hold(x) for x in [actors.trainer, actors.buffer,
                                               *actors.managers,
                                               *(w for w, _, _ in actors.workers)]]

    def _hold(self, actor):
        from distributed import Future

        return Future(actor.key, self.client)

    def _submit(self, *args, **kwargs):
        fut = self.client.submit(*args, **kwargs)
        self._holds.append(fut)
        return fut.result()

    # -- detection ----------------------------------------------------------------------
    def live(self) -> dict[str, dict]:
        return cluster_tags(self.client)

    @staticmethod
    def _lost(actor, live) -> bool:
        fut = getattr(actor, "_future", None)
        return (fut is not None and fut.status == "error") or actor._address not in live

    @staticmethod
    def _why(actor, live) -> str:
        fut = getattr(actor, "_future", None)
        return (f"actor {fut.status if fut is not None else 'unknown'}, worker "
                f"{'alive' if actor._address in live else 'gone'}")

    def is_lost(self, actor, error: BaseException) -> bool:
        """Did ``error`` (raised by a call on ``actor``) come from losing its worker?"""
        return is_worker_lost(error) or self._lost(actor, self.live())

    def alive(self, actor, grace: float = 5.0) -> bool:
        """Is ``actor`` still served by a live worker? A call that raised a comm error may
        come from some other worker dying; the scheduler takes a moment to notice a lost
        worker, so a worker it still lists must also answer a cheap call within
        ``grace`` s."""
        if self._lost(actor, self.live()):
            return False
        try:
            actor.stats().result(timeout=grace)
        except Exception:
            return False
        return not self._lost(actor, self.live())

    def wait_idle(self, trainer, timeout: float = 120.0) -> None:
        """Wait until ``trainer`` runs no step (a failed call may have left one going)."""
        deadline = time.monotonic() + timeout
        while trainer.stats().result(timeout=30).get("stepping") and \
                time.monotonic() < deadline:
            time.sleep(0.1)

    def heal(self, force: bool = False) -> list[dict]:
        """Find lost actors and replace those whose pool has a free worker; returns the
        replacements made now. Cheap when nothing is lost (at most every
        ``check_every`` s)."""
        now = time.monotonic()
        if not force and now - self._last < self.check_every:
            return []
        self._last = now
        live = self.live()
        a = self.actors
        if self._lost(a.buffer, live):
            raise RunLostError(
                f"the worker holding the SampleBuffer ({a.buffer._address}, "
                f"{self._why(a.buffer, live)}) was lost, and "
                "with it the trajectory ledger; the run cannot continue. Resume it from its "
                "last checkpoint, and give the buffer's worker a pool of its own")
        for actor in [m for m in a.managers if self._lost(m, live)]:
            a.managers.remove(actor)
            self.pending.append(_Lost("env", actor._address, CPU_ENV))
        for entry in [w for w in a.workers if self._lost(w[0], live)]:
            a.workers.remove(entry)
            self.pending.append(_Lost("inference", entry[2], entry[1]))
        made = []
        inference_changed = False
        for lost in list(self.pending):
            addr = self._free_worker(lost.tag, live)
            if addr is None:
                continue
            if lost.role == "env":
                a.managers.append(self._spawn_manager(addr))
            else:
                a.workers.append((self._spawn_inference(addr, lost.tag), lost.tag, addr))
                inference_changed = True
            self.pending.remove(lost)
            made.append(self._event(lost, addr))
        if inference_changed:
            self._announce_workers()
        return made

    def _free_worker(self, tag: str, live) -> str | None:
        """A live worker carrying ``tag`` that holds no actor of that role yet."""
        a = self.actors
        used = {m._address for m in a.managers} if tag == CPU_ENV else \
            {addr for _, _, addr in a.workers}
        free = sorted(addr for addr, r in live.items() if r.get(tag, 0) > 0 and addr not in used)
        return free[0] if free else None

    def _event(self, lost: _Lost, addr: str) -> dict:
        now = time.monotonic()
        event = {"role": lost.role, "address": lost.address, "replacement": addr,
                 "lost_s": lost.since - self.t0, "recovered_s": now - self.t0,
                 "recovery_s": now - lost.since, "recovered_at": time.time()}
        self.events.append(event)
        logger.warning("recovered from the loss of %s worker %s: new actor on %s after "
                       "%.1fs", lost.role, lost.address, addr, event["recovery_s"])
        return event

    # -- replacements -------------------------------------------------------------------
    def _key(self, name: str, addr: str) -> str:
        self._n += 1
        return f"{name}-{addr}-{self.run}-r{self._n}"

    def _spawn_manager(self, addr: str):
        from rollart.env.manager import EnvManager
        from rollart.rollout import LLMProxy

        g = self.graph
        proxy = LLMProxy([(w, tag) for w, tag, _ in self.actors.workers])
        return self._submit(
            EnvManager, proxy, self.actors.buffer, self.model_path,
            temperature=g.policy.temperature, top_p=g.policy.top_p,
            env_step_timeout=g.rollout.env_step_timeout,
            reward_timeout=g.rollout.reward_timeout, local_reward=g.rollout.local_reward,
            trajectory_timeout=g.rollout.trajectory_timeout,
            max_concurrency=g.rollout.env_concurrency,
            inference_pools=g.rollout.inference_pools, seed=g.seed, actor=True,
            workers=[addr], resources={CPU_ENV: 1},
            key=self._key("EnvManager", addr))

    def _spawn_inference(self, addr: str, tag: str):
        from rollart.rollout import InferenceWorker
        from rollart.weights import WeightStore

        w = self._submit(
            InferenceWorker, self.model_path, self.store_url, pool=tag, version=-1,
            threads=1, actor=True, **self.graph.policy.worker_options(), workers=[addr],
            resources={tag: 1}, key=self._key(f"InferenceWorker-{tag}", addr))
        version = WeightStore(self.store_url).latest()
        if version >= 0:
            w.update_weights(version).result()
            w.wait_version(version).result()
        return w

    def _announce_workers(self) -> None:
        workers = [(w, tag) for w, tag, _ in self.actors.workers]
        for m in list(self.actors.managers):
            try:
                m.set_inference_workers(workers).result()
            except Exception as e:
                if not is_worker_lost(e):
                    raise

    def replace_trainer(self):
        """Start a new ``Trainer`` on a TRAIN worker (waiting for one to come back) and
        restore the newest published weights; returns the version it holds."""
        from rollart.trainer import Trainer

        lost = _Lost("trainer", self.actors.trainer._address, TRAIN)
        deadline = time.monotonic() + self.wait_for_worker
        while True:
            live = self.live()
            free = sorted(a for a, r in live.items() if r.get(TRAIN, 0) > 0)
            if free:
                break
            if time.monotonic() > deadline:
                raise RunLostError(
                    f"the trainer's worker {lost.address} was lost and no TRAIN worker came "
                    f"back within {self.wait_for_worker:.0f}s; restart one (or resume the "
                    "run from its last checkpoint)")
            time.sleep(0.25)
        g = self.graph
        trainer = self._submit(
            Trainer, self.model_path, self.store_url, g.algo,
            temperature=g.policy.temperature, threads=1, seed=g.seed, actor=True,
            workers=[free[0]], resources={TRAIN: 1},
            key=self._key("Trainer", free[0]))
        version, source = self._restore(trainer)
        self.actors.trainer = trainer
        event = self._event(lost, free[0])
        event.update(version=version, restored_from=source)
        return version

    def _restore(self, trainer) -> tuple[int, str]:
        """Last checkpoint first, then newer published weights; returns (version, how)."""
        from rollart import checkpoint
        from rollart.weights import WeightStore

        how, version = [], -1
        path = checkpoint.latest(self.checkpoint_url) if self.checkpoint_url else None
        if path is not None:
            try:
                checkpoint.load(path)  # verifies the manifest: no half-restored trainer
                version = trainer.load_state(path).result()
                how.append(f"checkpoint {path}")
            except checkpoint.CheckpointError as e:
                logger.warning("not restoring the trainer from %s: %s", path, e)
        if WeightStore(self.store_url).latest() > version:
            version = trainer.restore_latest().result()
            how.append(f"weights v{version}")
        if not how:
            raise RunLostError(f"the trainer was lost and there is neither a checkpoint under "
                               f"{self.checkpoint_url} nor published weights in "
                               f"{self.store_url} to restore it from")
        return version, " + ".join(how)

    def wait_for_manager(self) -> None:
        """Block until at least one env manager is alive (after all of them were lost)."""
        deadline = time.monotonic() + self.wait_for_worker
        while not self.actors.managers:
            self.heal(force=True)
            if self.actors.managers:
                return
            if time.monotonic() > deadline:
                raise RunLostError(
                    f"every env manager was lost and no CPU_ENV worker came back within "
                    f"{self.wait_for_worker:.0f}s; start CPU_ENV workers")
            time.sleep(0.25)


def lose_worker(cluster, client, address: str, restart_after: float | None = 0.0) -> str:
    """Fault injection (tests, ``benchmarks/chaos.py``): make worker ``address`` of a
    ``SpecCluster`` die as a crash would. A worker process gets SIGKILL (its Nanny starts
    a fresh one); an in-process worker is closed abruptly and, unless ``restart_after``
    is None, a fresh worker with the same spec starts after that many seconds (what a
    Nanny does). Returns the worker's name."""
    import os
    import signal
    from distributed import Nanny

    name = next(n for n, w in cluster.workers.items()
                if getattr(w, "worker_address", None) == address or
                getattr(w, "address", None) == address)
    w = cluster.workers[name]
    if isinstance(w, Nanny):
        pid = client.run(os.getpid, workers=[address])[address]
        os.kill(pid, signal.SIGKILL)
        return name
    cluster.sync(w.close, executor_wait=False, nanny=False, reason="rollart: worker lost")
    if restart_after is not None:
        time.sleep(restart_after)
        del cluster.workers[name]
        cluster.sync(cluster._correct_state)
    return name
