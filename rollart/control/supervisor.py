"""Keep a run going when Dask workers die: find lost actors, re-create them, restart work.

Dask actors are not resilient by themselves: when the worker holding one dies, calls on
it raise (``OSError`` in flight, then "Worker holding Actor was lost") and the actor is
gone. The ``Supervisor`` is the driver-side answer; the pipeline calls ``heal()`` while
it waits and ``replace_trainer()`` when a trainer step is lost. Replacements are built
by ``rollart.control.stages.Stages.reconcile`` from the same role specs as at start-up, so they
are built like the originals (class, arguments, pool).

==================  ===================================================================
actor lost          what happens
==================  ===================================================================
``EnvManager``      the pipeline's ``run_group`` future fails; the buffer turns that
                    group's in-flight members into ``failed`` (``orphan_group``) and the
                    missing members restart on a live manager (new member ids, so none
                    is counted twice). A new manager starts once a worker of the lost
                    one's env pool without one appears (Nanny restart or a new worker).
``InferenceWorker`` each manager's ``LLMProxy`` re-sends the request to another worker;
                    a new actor starts on the restarted worker, loads the newest
                    weights, and the managers get the new worker list (their task
                    routes, PD included, kept: ``LLMProxy.with_workers``).
``Trainer``         the step's future fails; a new trainer of the same backend starts
                    on a TRAIN worker, loads the run's last complete checkpoint
                    (``rollart.control.checkpoint``: optimizer, KL reference, RNG) without
                    dropping the versions published after it, then the newest published
                    weights on top: its version is the newest published one, so no
                    ``trained`` row's update is rolled back and rollout never goes back
                    in version (``--resume`` differs: it truncates to the checkpoint).
                    The lost step's batch was ``taken``, not ``trained``: it is buffered
                    again for the re-run (``lost_in_step`` if the bound rules it out) or,
                    if the lost step published its update before dying, ``trained`` and
                    the step recorded once from the buffer's record, not re-run.
``SampleBuffer``    holds the ledger, off the env pool (the ``BUFFER`` tag; on the
                    trainer's worker in ``resources/local.py`` and ``laptop.py``, which
                    then loses both). Its journal is durable (``rollart.buffer.journal``),
                    so its loss does not end the run: a new one starts with
                    ``recover=True`` (it reloads the durable groups and ledger from the
                    run directory) and every manager and the pipeline get it. The groups
                    running then end: the recovered buffer closed them and counted their
                    members in flight ``failed`` (orphaned). The pipeline's calls and a
                    trainer step that failed on the lost buffer are retried on the new
                    one (``wait_for_buffer``).
==================  ===================================================================

A trainer gang fails as one (``rollart.trainer.gang``): a lost rank other than rank 0
is not a lost actor here; rank 0 forms the gang again within the step, and reports it
with the step (``trainer/gang_events``: ``gang_restarted``). Rank 0 lost is the trainer
lost (above), replaced by a gang of the same size. What the trainer says while it waits
for TRAIN workers (``rollart.trainer.gang_faults.NOTICES``, Dask events) is printed on the
driver's console as it comes.

Every replacement is an event ``{role, address, lost_s, recovered_s, recovery_s}``
(``recovery_s``: loss noticed → replacement ready), kept in ``Supervisor.events``. A
replacement that does not start, or a restore call that does not return, within its
bound (``rollart.control.stages.Waits``; through the ``Stages``' ``Door``) is a
``StuckError`` naming the actor and its worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rollart.runtime.resources import cluster_tags
from rollart.runtime.lost import gone
from rollart.runtime.waits import StuckError
from rollart.types import BUFFER

logger = logging.getLogger(__name__)

__all__ = ["FailureStormError", "RunLostError", "StallError", "StuckError", "Supervisor"]


class RunLostError(RuntimeError):
    """A fault the run cannot recover from (e.g. no worker came back for a lost role)."""


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
    """Replaces lost actors of ``actors`` (a ``rollart.control.actors.Actors``) in place, each
    from its role's spec (``stages``, a ``rollart.control.stages.Stages``)."""

    def __init__(self, stages, actors, *, checkpoint_url: str | None = None,
                 check_every: float = 0.5, wait_for_worker: float = 300.0):
        self.stages, self.client, self.actors = stages, stages.client, actors
        self.waits, self.door = stages.waits, stages.door  # a restore's calls, their bounds
        self.graph, self.store_url = stages.graph, stages.store_url
        self.checkpoint_url = checkpoint_url
        self.check_every, self.wait_for_worker = check_every, wait_for_worker
        self.events: list[dict] = []
        self.pending: list[_Lost] = []
        self._last = 0.0
        self.t0 = time.monotonic()
        self._t0_wall = time.time()
        from rollart.trainer.gang_faults import NOTICES

        self.client.subscribe_topic(NOTICES, _say)  # the trainer's waits, on the console

    def close(self) -> None:
        """The run is over: the trainer's notices are no longer this run's to print."""
        from rollart.trainer.gang_faults import NOTICES

        try:
            self.client.unsubscribe_topic(NOTICES)
        except Exception as e:  # noqa: BLE001 - a client already closed: nothing to stop
            logger.debug("unsubscribing the trainer's notices: %r", e)

    # -- detection ----------------------------------------------------------------------
    def live(self) -> dict[str, dict]:
        return cluster_tags(self.client)

    def alive(self, actor, grace: float = 5.0) -> bool:
        """Is ``actor`` still served by a live worker? A call that raised a comm error may
        come from some other worker dying; the scheduler takes a moment to notice a lost
        worker, so a worker it still lists must also answer a cheap call within
        ``grace`` s."""
        if gone(actor, self.live()):
            return False
        try:
            self.door.call(actor, "stats", timeout=grace)
        except Exception:
            return False
        return not gone(actor, self.live())

    def wait_idle(self, trainer, timeout: float = 120.0) -> None:
        """Wait until ``trainer`` runs no step (a failed call may have left one going)
        and the buffer it reads from answers: the step's comm error may have been the
        buffer's worker dying, and a re-run needs its replacement (``wait_for_buffer``)."""
        deadline = time.monotonic() + timeout
        while self.door.call(trainer, "stats", timeout=30).get("stepping") and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        self.wait_for_buffer()

    def wait_for_buffer(self) -> None:
        """Block until the sample buffer answers, re-creating it (``heal``) if its worker
        was lost; ``RunLostError`` when no worker for it comes back within
        ``wait_for_worker`` s."""
        deadline = time.monotonic() + self.wait_for_worker
        while not self.alive(self.actors.buffer):
            self.heal(force=True)
            if time.monotonic() > deadline:
                raise RunLostError(
                    f"the sample buffer's worker {self.actors.buffer._address} was lost and "
                    f"no worker for it came back within {self.wait_for_worker:.0f}s; start "
                    f"a worker with the {BUFFER!r} resource (or resume the run)")
            time.sleep(0.25)

    def heal(self, force: bool = False) -> list[dict]:
        """Reconcile the buffer, inference workers and env managers with their specs
        (``Stages.reconcile``); returns the replacements made now. Cheap when nothing is
        lost (at most every ``check_every`` s)."""
        now = time.monotonic()
        if not force and now - self._last < self.check_every:
            return []
        self._last = now
        return self._note(self.stages.reconcile(self.actors, live=self.live()))

    def settle(self, timeout: float = 60.0) -> list[dict]:
        """At the run's end: notice what was lost since the last check and take up the
        replacements still starting (``Stages.starting``: an actor is taken up by a
        later reconcile once built), for at most ``timeout`` s, so that a loss late in a
        short run is in ``events`` too; a loss still without a replacement then is
        logged as such. Returns the replacements taken up now."""
        deadline = time.monotonic() + timeout
        made: list[dict] = []
        while True:
            try:
                made += self.heal(force=True)
            except StuckError as e:  # the run's work is done: say so, do not fail it
                logger.warning("at the run's end: %s", e)
                break
            if not self.stages.starting() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for lost in self.pending:
            logger.warning("the %s actor on %s was lost and not replaced by the run's end",
                           lost.role, lost.address)
        return made

    def _note(self, done) -> list[dict]:
        """Book what a reconcile removed (pending) and made (events, matched by role and
        pool to the oldest loss)."""
        self.pending += [_Lost(role, addr, tag) for role, tag, addr in done.removed]
        made = []
        for role, tag, addr in done.made:
            lost = next((p for p in self.pending if p.role == role and
                         (p.tag == tag or role in ("trainer", "buffer"))), None)
            if lost is None:  # a worker that joined: a new actor, not a replacement
                logger.info("started %s actor on new worker %s", role, addr)
                continue
            self.pending.remove(lost)
            made.append(self._event(lost, addr))
        return made

    def _event(self, lost: _Lost, addr: str) -> dict:
        now = time.monotonic()
        event = {"role": lost.role, "address": lost.address, "replacement": addr,
                 "lost_s": lost.since - self.t0, "recovered_s": now - self.t0,
                 "recovery_s": now - lost.since, "recovered_at": time.time()}
        self.events.append(event)
        logger.warning("recovered from the loss of %s worker %s: new actor on %s after "
                       "%.1fs", lost.role, lost.address, addr, event["recovery_s"])
        return event

    def gang_restarted(self, events: list[dict]) -> None:
        """Book the gang's own restarts (``trainer/gang_events`` of a step: a rank's worker
        lost and the gang formed again without the driver), as replacements are."""
        for e in events:
            event = {**e, "lost_s": e["lost_at"] - self._t0_wall,
                     "recovered_s": e["recovered_at"] - self._t0_wall}
            self.events.append(event)
            rank = "" if e.get("rank") is None else f" rank {e['rank']}"
            logger.warning("the trainer gang lost%s (%s) and formed again with %d ranks "
                           "(new worker %s) after %.1fs, from %s", rank, e["address"],
                           e["ranks"], e["replacement"], e["recovery_s"],
                           e["restored_from"])

    def replace_trainer(self):
        """Re-create the trainer from its spec on a TRAIN worker (waiting for one to come
        back; same backend) and restore it: the last checkpoint, then newer published
        weights. Returns the version it holds."""
        old = self.actors.trainer
        deadline = time.monotonic() + self.wait_for_worker
        self.wait_for_buffer()  # lost with the trainer (same worker)? back first
        while True:
            done = self.stages.reconcile(self.actors, ("trainer",), lost=[old])
            self.pending += [_Lost(role, addr, tag) for role, tag, addr in done.removed
                             if not any(p.role == role for p in self.pending)]
            if done.made:
                break
            if time.monotonic() > deadline:
                raise RunLostError(
                    f"the trainer's worker {old._address} was lost and no TRAIN worker came "
                    f"back within {self.wait_for_worker:.0f}s; restart one (or resume the "
                    "run from its last checkpoint)")
            time.sleep(0.25)
        version, source = self._restore(self.actors.trainer)
        lost = next(p for p in self.pending if p.role == "trainer")
        self.pending.remove(lost)
        event = self._event(lost, done.made[0][2])
        event.update(version=version, restored_from=source)
        return version

    def _restore(self, trainer) -> tuple[int, str]:
        """Last checkpoint first, then newer published weights; returns (version, how).

        Every published version is kept (``load_state(truncate=False)``): rows trained in
        steps after the checkpoint are in those versions' weights, so the new trainer
        continues from the newest one, never from the older checkpoint's. From the
        checkpoint it keeps the KL reference (frozen at the run's first publish, the
        same for every version), the optimizer moments (running averages over ~100
        steps: a few steps behind the weights, still their scale) and the RNG state."""
        from rollart.control import checkpoint  # import cycle: checkpoint -> fleet -> here
        from rollart.weights import WeightStore

        how, version = [], -1
        path = checkpoint.latest(self.checkpoint_url) if self.checkpoint_url else None
        if path is not None:
            try:
                checkpoint.load(path)  # verifies the manifest: no half-restored trainer
                version = self.door.call(trainer, "load_state", path, truncate=False,
                                         timeout=self.waits.call, stuck=f"the new trainer "
                                         f"on {trainer._address} did not load checkpoint {path}")
                how.append(f"checkpoint {path}")
            except checkpoint.CheckpointError as e:
                logger.warning("not restoring the trainer from %s: %s", path, e)
        if WeightStore(self.store_url).latest() > version:
            version = self.door.call(trainer, "restore_latest", timeout=self.waits.call,
                                     stuck=f"the new trainer on {trainer._address} did not "
                                     f"load the newest published weights from {self.store_url}")
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
                    f"every env manager was lost and no env worker came back within "
                    f"{self.wait_for_worker:.0f}s; start workers with the env pools' tags")
            time.sleep(0.25)


def _say(event) -> None:
    """A trainer's notice (a Dask event: ``(time, {"text": ...})``) on the console."""
    _, msg = event
    logger.warning("%s", msg.get("text", msg) if isinstance(msg, dict) else msg)


def lose_worker(cluster, client, address: str, restart_after: float | None = 0.0) -> str:
    """Fault injection (tests, ``benchmarks/chaos.py``): make worker ``address`` of a
    ``SpecCluster`` die as a crash would. A worker process gets SIGKILL (its Nanny starts
    a fresh one); an in-process worker is closed abruptly and, unless ``restart_after``
    is None, a fresh worker with the same spec starts after that many seconds (what a
    Nanny does). Returns the worker's name. Safe to call from several threads at once.

    The cluster forgets a worker the scheduler lost by itself, after
    ``distributed.deploy.lost-worker-timeout`` (15 s): a restart later than that (a long
    ``restart_after``, or a close slowed by a busy loop) finds its name already gone, so
    the restart drops it only if it is still there, on the cluster's own loop."""
    import os
    import signal
    from distributed import Nanny

    name = next(n for n, w in list(cluster.workers.items())
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
        cluster.sync(_restart, cluster, name, w)
    return name


async def _restart(cluster, name: str, closed) -> None:
    """Start a fresh worker for ``name`` from its spec (``lose_worker``), on the
    cluster's loop: the closed worker ``closed`` leaves ``cluster.workers`` unless the
    cluster dropped it already (or a replacement holds the name)."""
    if cluster.workers.get(name) is closed:
        del cluster.workers[name]
    await cluster._correct_state()
