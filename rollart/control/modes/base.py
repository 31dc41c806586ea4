"""What every mode shares (``Pipeline``): the group sequence, waits that heal, recovery.

Consumes the started actors (``rollart.control.stages``: inference workers, env managers, the
sample buffer, the trainer) and the ``Graph``; the per-mode subclasses
(``rollart.control.modes.lockstep``, ``rollart.control.modes.asynchronous``) call these helpers
from their ``step``; ``rollart.control.loop`` calls ``step`` once per trainer step.

The group sequence (task and seed of each group, ``rollart.policy.admission.GroupSequence``)
is drawn in the buffer in the asynchronous modes and here in the others; either way one
RNG seeded by ``Graph.seed``, saved in checkpoints (``state``/``load_state``). Inference
workers find new versions in the weight store themselves (``InferenceWorker``): the
driver never relays them, it only waits for them where the mode needs it.

Lost workers (``rollart.control.supervisor``): with a ``supervisor`` set, the pipeline heals while
it waits, hands the groups of an env manager that was lost back to the buffer
(asynchronous modes: ``SampleBuffer.holder_lost``) or restarts their missing members on
another manager (the others), and re-runs a step whose trainer was lost on a re-created
trainer, after the buffer put that step's ``taken`` batch back
(``SampleBuffer.release_taken``: the re-run trains it; a batch is ``trained`` only once
an update with it was published), or records it once if the lost trainer had published
it (``published_step``). A call whose actor's worker left the cluster fails at once
(``result``: the scheduler would retry connecting to it until Dask's connect time-out).

A run that stops progressing says so (the rules: ``rollart.policy.watchdog``): the last
``Rollout.failure_streak_limit`` trajectories all failed → ``FailureStormError``; for
``Rollout.stall_timeout`` seconds in-flight trajectories stopped settling, or no trainer
step completed while groups kept being dropped as too stale, or an inference worker
stayed below the trainer's version − alpha → ``StallError``, naming the trainer's
version, each worker's and its last load error.

Every step ends with the ledger's counts (``traj/<state>``) and a check that they add
up to the launches (checked by the buffer's ledger; a mismatch raises
``AccountingError``).
"""

from __future__ import annotations

import abc
import logging
import time

from rollart.buffer.ledger import STATES
from rollart.policy.admission import GroupSequence
from rollart.observe.figures import rollout_figures
from rollart.policy.staleness import StalenessBound
from rollart.policy.watchdog import Watchdog

logger = logging.getLogger(__name__)


class ActorGone(OSError):
    """A call's actor left the cluster while the driver waited (``Pipeline.result``)."""


class Pipeline(abc.ABC):
    """Shared by the modes: picks (task, seed) for groups, updates weights, counts."""

    def __init__(self, actors, graph):
        self.actors, self.graph = actors, graph
        self.sequence = GroupSequence(graph.tasks, graph.task_weights, graph.seed,
                                      graph.algo.group_size)
        self.errors: list[str] = []
        self.supervisor = None  # a rollart.control.supervisor.Supervisor, set by the control loop
        self._checked = 0.0  # last failure-storm check (check_failures)
        self.watchdog = Watchdog(self.stall_timeout, self.failure_streak_limit,
                                 graph.algo.alpha, time.monotonic())
        self.refilled_groups = 0  # lockstep modes: groups re-run after all members failed
        self.groups: dict[str, tuple] = {}  # gid -> (task, seed, size, restarts)
        self.placed: dict[str, tuple] = {}  # gid -> (future, manager) of a restarted group
        self.restarted_groups = 0
        self.trainer_recoveries = 0

    @property
    def version(self) -> int | None:
        """The trainer's version after the latest step (None before the first)."""
        return self.watchdog.version

    @property
    def n_groups(self) -> int:
        return self.sequence.n_groups

    def next_group(self) -> tuple:
        task, seed, gid, size = self.sequence.next()
        self.groups[gid] = (task, seed, size, 0)
        return task, seed, gid, size

    def state(self) -> dict:
        """What a checkpoint needs to continue the group sequence (``rollart.control.checkpoint``)."""
        return self.sequence.state()

    def load_state(self, state: dict) -> None:
        self.sequence.load_state(state)

    def manager(self, i: int, task=None):
        """The ``i``-th env manager (among those on ``task``'s env pool, if given)."""
        if not self.actors.managers and self.supervisor is not None:
            self.supervisor.wait_for_manager()
        managers = self.actors.managers_for(task) if task is not None else \
            self.actors.managers
        return managers[i % len(managers)]

    def ask_buffer(self, method: str, *args):
        """``buffer.method(*args).result()``; if the buffer's worker was lost, once more
        on the buffer the supervisor re-creates (``Supervisor.wait_for_buffer``)."""
        buf = self.actors.buffer
        try:
            return self.result(getattr(buf, method)(*args), buf)
        except Exception as e:  # noqa: BLE001
            if not self.lost(e, buf):
                raise
        self.supervisor.wait_for_buffer()
        buf = self.actors.buffer
        return self.result(getattr(buf, method)(*args), buf)

    def result(self, fut, actor, timeout: float | None = None):
        """``fut.result()`` of a call on ``actor``; ``OSError`` as soon as the scheduler
        no longer lists ``actor``'s worker (with a supervisor), ``TimeoutError`` after
        ``timeout`` s. A call made just as an in-process worker closed is proxied by the
        scheduler, which retries connecting to the closed address until Dask's connect
        time-out (``distributed.comm.timeouts.connect``: 30 s; 300 s in
        ``benchmarks/chaos.py``, where a run sat in ``counts`` after the trainer's worker
        was closed mid-step): the driver gives up on a lost worker instead."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.5 if end is None else min(0.5, max(end - time.monotonic(), 0.01))
            try:
                return fut.result(timeout=wait)
            except TimeoutError:
                if fut.done():  # done meanwhile, or the call's own TimeoutError
                    return fut.result()
                if end is not None and time.monotonic() >= end:
                    raise TimeoutError(f"the actor on {actor._address} gave no answer "
                                       f"within {timeout:g} s") from None
                self.check_alive(actor)

    def check_alive(self, actor) -> None:
        """``OSError`` if ``actor``'s worker left the cluster (see ``result``)."""
        if self.supervisor is not None and actor._address not in self.supervisor.live():
            raise ActorGone(f"Unable to contact Actor's worker {actor._address}: it left "
                          "the cluster")

    def heal(self) -> None:
        if self.supervisor is not None:
            self.supervisor.heal()
        self.check_failures()

    @property
    def failure_streak_limit(self) -> int:
        limit = self.graph.rollout.failure_streak_limit
        if limit is None:
            limit = 4 * self.graph.algo.group_size * self.graph.algo.groups_per_step
        return limit

    @property
    def stall_timeout(self) -> float:
        r = self.graph.rollout
        if r.stall_timeout is not None:
            return float(r.stall_timeout)
        longest = r.trajectory_timeout or (
            r.env_step_timeout * max(t.max_turns for t in self.graph.tasks) + r.reward_timeout)
        return max(300.0, 2.0 * longest)

    def check_failures(self, every: float = 1.0) -> None:
        """Stop a run that cannot progress (the rules: ``rollart.policy.watchdog``):
        ``FailureStormError`` or ``StallError``, checked at most every ``every`` s."""
        dog, now = self.watchdog, time.monotonic()
        if not (dog.stall or dog.streak_limit) or now - self._checked < every:
            return
        self._checked = now
        counts = self.ask_buffer("counts")
        why = dog.stalled(counts, self.worker_versions() if dog.stall else None, now)
        if why:
            from rollart.control.supervisor import StallError

            raise StallError(why)
        if not dog.storm(counts):
            return
        from rollart.control.supervisor import FailureStormError

        errors = self.ask_buffer("recent_errors")
        raise FailureStormError(
            f"the last {counts['failed_streak']} trajectories all failed and none reached "
            f"the buffer, so the run stops (Rollout.failure_streak_limit={dog.streak_limit})"
            ". Latest errors:\n  " + "\n  ".join(errors) + "\nFix the env, reward or "
            "inference pool they point at, then resume from the last checkpoint (rollart "
            "train --resume RUN).")

    def worker_versions(self) -> list[dict]:
        """``{address, pool, version, load_error}`` of every live inference worker."""
        out = []
        for w, tag, addr in list(self.actors.workers):
            try:
                st = self.result(w.stats(), w, timeout=30)
            except Exception as e:  # noqa: BLE001
                if not self.lost(e, w):
                    raise
                continue
            out.append({"address": addr, "pool": tag, "version": st["version"],
                        "load_error": st.get("load_error")})
        return out

    def until_done(self, fut, while_waiting=None, actor=None) -> None:
        """Wait for ``fut``, healing and checking for failure storms (and calling
        ``while_waiting``) meanwhile; errors raised here are not ``fut``'s, except an
        ``OSError`` once ``actor`` (the one called, if given) left the cluster
        (``result``)."""
        checked = time.monotonic()
        while not fut.done():
            if while_waiting is not None:
                while_waiting()
            self.heal()
            if actor is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if not fut.done():
                    self.check_alive(actor)
            time.sleep(0.02)

    def wait(self, fut, actor=None):
        """``fut.result()`` once done (``until_done``; ``actor``: the one called)."""
        self.until_done(fut, actor=actor)
        return fut.result()

    def lost(self, error: BaseException, actor=None) -> bool:
        """True when ``error`` came from a lost worker and the supervisor can help."""
        if self.supervisor is None:
            return False
        from rollart.control.supervisor import is_worker_lost

        return is_worker_lost(error) or (actor is not None and
                                         self.supervisor.is_lost(actor, error))

    def restart_group(self, gid: str, redundancy: float = 1.0):
        """The manager running ``gid`` was lost: fail its in-flight members and run the
        missing ones on a live manager. Returns the new future, or None if complete."""
        self.heal()
        info = self.ask_buffer("orphan_group", gid)
        task, seed, size, restarts = self.groups[gid]
        need = size - info["arrived"]
        if info["complete"] or need <= 0:
            return None
        restarts += 1
        self.groups[gid] = (task, seed, size, restarts)
        self.restarted_groups += 1
        fut, mgr = self.on_live_manager(
            self.n_groups + restarts, task,
            lambda m: m.run_group(task, seed, gid, size, redundancy=redundancy, need=need,
                                  backup_after=self.graph.rollout.backup_after,
                                  first_index=1000 * restarts))
        self.placed[gid] = (fut, mgr)
        return fut

    def on_live_manager(self, index: int, task, call, attempts: int = 100):
        """``(call(mgr), mgr)`` on the ``index``-th env manager for ``task``. A manager
        whose worker is gone (the call raises at once) is healed away and the next one
        tried, for up to ``attempts`` × 0.05 s while the scheduler notices the loss."""
        for attempt in range(attempts - 1):
            mgr = self.manager(index + attempt, task)
            try:
                return call(mgr), mgr
            except Exception as e:  # noqa: BLE001
                if not self.lost(e, mgr):
                    raise
                self.supervisor.heal(force=True)
                time.sleep(0.05)
        mgr = self.manager(index + attempts - 1, task)
        return call(mgr), mgr  # the last try: its error is the caller's

    @abc.abstractmethod
    def step(self, step: int) -> dict:
        """One trainer step in this mode; returns the trainer's metrics."""

    def train(self, step: int, while_waiting=None) -> dict:
        spurious = 0
        while True:
            trainer = self.actors.trainer
            try:
                fut = trainer.train_step(self.actors.buffer, step)
            except Exception as e:  # noqa: BLE001 - its actor is gone: judged below
                fut, error = None, e
            if fut is not None:
                try:
                    self.until_done(fut, while_waiting, trainer)
                except ActorGone as e:
                    fut, error = None, e
            if fut is not None:
                try:
                    metrics = fut.result()
                except Exception as e:  # noqa: BLE001
                    error = e
                else:
                    self.watchdog.stepped(metrics["version"], time.monotonic())
                    return metrics
            if not self.lost(error, trainer):
                raise error
            if self.supervisor.alive(trainer):
                # a comm error from another worker (e.g. an env worker dying while the
                # batch was gathered): the trainer is fine; once it is idle, re-run
                spurious += 1
                if spurious > 3:
                    raise error
                logger.warning("trainer step %d failed with %r but the trainer is alive; "
                               "re-running the step", step, error)
                self.supervisor.wait_idle(trainer)
                continue
            logger.warning("trainer step %d lost its trainer (%r); replacing it", step, error)
            version = self.supervisor.replace_trainer()  # then re-run this step
            self.trainer_recoveries += 1
            settled = self.release_taken(step, version)
            if settled.get("trained"):  # it published before it died: the step is done
                return self.published_step(step, version, settled)

    def published_step(self, step: int, version: int, settled: dict) -> dict:
        """Step ``step``'s trainer died after publishing ``version`` (its update is in
        the weights the new trainer loaded): the step is recorded, not re-run (a re-run
        would train a second batch under the same step number). Its loss figures died
        with the trainer; the batch's figures (size, digest, per-task reward and
        success, staleness) come from the buffer's record of it."""
        logger.warning("step %d: its trainer published v%d before it was lost; the step "
                       "stands (batch of %d from the buffer's record)", step, version,
                       settled["trained"])
        self.watchdog.stepped(version, time.monotonic())
        return {**settled.get("metrics", {}), "step": step, "version": version,
                "trainer/batch_size": settled["trained"],
                "trainer/batch_sha1": settled.get("batch_sha1", ""),
                "trainer/published_before_loss": 1}

    def release_taken(self, step: int, version: int) -> dict:
        """Step ``step`` lost its trainer; the new one holds ``version``. The batch the
        lost step took goes back to the buffer for the re-run (or is ``trained``, if the
        lost step published ``version`` before it died). A buffer lost meanwhile is asked
        once more when its replacement is up (its journal keeps the taken batch); lost
        again, its next ``get_table`` settles the batch the same way."""
        min_version = StalenessBound(self.graph.algo.alpha).min_version(version)
        for attempt in range(2):
            buf = self.actors.buffer
            try:
                out = self.result(buf.release_taken(step, min_version, version - 1), buf)
                break
            except Exception as e:  # noqa: BLE001
                if not self.lost(e, buf):
                    raise
                if attempt:
                    logger.warning("step %d: the buffer was lost again (%r); its next "
                                   "get_table settles the taken batch", step, e)
                    return {}
            # lost meanwhile: the recovered buffer keeps the taken batch (its journal)
            self.supervisor.wait_for_buffer()
        logger.warning("step %d: its taken batch was settled after the trainer was lost: "
                       "%s", step, out)
        return out

    def ask_versions(self, version: int) -> list:
        """Ask every live inference worker for ``version`` now (``wait_version`` makes
        it look in the weight store at once instead of at its next poll); returns
        ``[(worker, future), ...]`` for ``wait_workers``."""
        out = []
        for w, _, _ in list(self.actors.workers):
            try:
                out.append((w, w.wait_version(version)))
            except Exception as e:  # noqa: BLE001 - its actor is gone?
                if not self.lost(e, w):
                    raise
        return out

    def wait_workers(self, version: int, asked: list | None = None) -> None:
        """Until every live inference worker holds ``version`` (they find it in the
        weight store themselves; all are asked at once: ``ask_versions``, or ``asked``
        from an earlier call). A worker lost meanwhile is skipped (its replacement
        loads the newest version); one that fails to load it is asked again while the
        stall check (``check_versions``) bounds the wait."""
        for w, fut in (self.ask_versions(version) if asked is None else asked):
            while True:
                try:
                    self.until_done(fut, actor=w)  # heals; a stall raises here
                except ActorGone:
                    break
                try:
                    fut.result()
                    break
                except Exception as e:  # noqa: BLE001
                    if self.lost(e, w):
                        break
                    logger.warning("inference worker %s: %s; waiting on", w._address, e)
                    time.sleep(0.25)
                    self.heal()
                try:
                    fut = w.wait_version(version)
                except Exception as e:  # noqa: BLE001 - its actor is gone?
                    if self.lost(e, w):
                        break
                    raise

    def call_managers(self, method: str, *args) -> list:
        """``method(*args)`` on every live env manager; lost ones are skipped."""
        futs, out = [], []
        for m in list(self.actors.managers):
            try:  # a handle whose worker was just lost raises at the call itself
                futs.append((m, getattr(m, method)(*args)))
            except Exception as e:
                if not self.lost(e, m):
                    raise
        for m, f in futs:
            try:
                out.append(self.result(f, m))
            except Exception as e:
                if not self.lost(e, m):
                    raise
        return out

    def counts(self) -> dict:
        """The ledger's counts; the buffer raises ``AccountingError`` if they don't add up."""
        c = self.ask_buffer("counts")
        return {f"traj/{k}": c[k] for k in ("launched", *STATES)}

    def rollout_stats(self) -> dict:
        """Cumulative engine and env-manager figures (``rollart.observe.figures``)."""
        ws = []
        for w, _, _ in list(self.actors.workers):
            try:
                ws.append(self.result(w.stats(), w))
            except Exception as e:
                if not self.lost(e, w):
                    raise
        return rollout_figures(ws, self.call_managers("stats"), len(self.errors))

    def run_batch(self, groups: list[tuple]):
        """Start a lockstep batch, split across the env managers; returns futures."""
        per: dict[int, tuple] = {}
        for i, g in enumerate(groups):
            m = self.manager(i, g[0])
            per.setdefault(id(m), (m, []))[1].append(g)
        return [(m.run_batch(gs), gs, m) for m, gs in per.values()]

    def wait_batch(self, batch) -> None:
        """Wait for a ``run_batch``; groups of a lost manager restart elsewhere (without
        the lockstep barrier: the rest of their batch has moved on)."""
        restarted = []
        for fut, groups, mgr in batch:
            try:
                self.wait(fut, mgr)
            except Exception as e:
                if not self.lost(e, mgr):
                    raise
                restarted += [(g[2], self.restart_group(g[2])) for g in groups]
        for gid, fut in restarted:
            self.wait_group(gid, fut)

    def refill(self) -> None:
        """Lockstep modes: a group whose every member failed leaves nothing to train on;
        roll out replacement groups until one step's worth is complete (else the trainer
        would wait for groups nobody runs). A failure storm stops the run here."""
        need = self.graph.algo.groups_per_step
        while True:
            ready = self.ask_buffer("counts")["groups_complete"]
            if ready >= need:
                return
            self.check_failures(every=0.0)
            self.refilled_groups += need - ready
            self.roll_out([self.next_group() for _ in range(need - ready)])

    def roll_out(self, groups: list[tuple]) -> None:
        """Run ``groups`` (``next_group`` tuples) to the end: a lockstep batch here."""
        self.wait_batch(self.run_batch(groups))

    def wait_group(self, gid: str, fut, redundancy: float = 1.0) -> None:
        """Wait for a placed group (``self.placed``: a restarted one, or ``sync+``'s),
        restarting its missing members with ``redundancy`` if its manager is lost."""
        while fut is not None:
            try:
                self.wait(fut, self.placed[gid][1])
                break
            except Exception as e:
                if not self.lost(e, self.placed[gid][1]):
                    raise
                fut = self.restart_group(gid, redundancy)
        self.placed.pop(gid, None)

