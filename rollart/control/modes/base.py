"""What every mode shares (``Pipeline``): the group sequence, the trainer step and its
recovery, the watchdog.

Consumes the run's ``Fleet`` (``rollart.control.fleet``: the started actors and the one
way to call them, which knows what is lost) and the ``Graph``; the per-mode subclasses
(``rollart.control.modes.lockstep``, ``rollart.control.modes.asynchronous``) call these
helpers from their ``step``; ``rollart.control.loop`` calls ``step`` once per trainer
step.

The group sequence (task and seed of each group, ``rollart.policy.admission.GroupSequence``)
is drawn in the buffer in the asynchronous modes and here in the others; either way one
RNG seeded by ``Graph.seed``, saved in checkpoints (``state``/``load_state``). Inference
workers find new versions in the weight store themselves (``InferenceWorker``): the
driver never relays them, it only waits for them where the mode needs it.

Lost workers (``rollart.control.supervisor``, the fleet's): the pipeline heals while it
waits, hands the groups of an env manager that was lost back to the buffer
(asynchronous modes: ``SampleBuffer.holder_lost``) or restarts their missing members on
another manager (the others), and re-runs a step whose trainer was lost on a re-created
trainer, after the buffer put that step's ``taken`` batch back
(``SampleBuffer.release_taken``: the re-run trains it; a batch is ``trained`` only once
an update with it was published), or records it once if the lost trainer had published
it (``published_step``). A call whose actor's worker left the cluster fails at once
(``Fleet.result``: the scheduler would retry connecting to it until Dask's connect
time-out).

A run that stops progressing says so (the rules: ``rollart.policy.watchdog``): the last
``Rollout.failure_streak_limit`` trajectories all failed → ``FailureStormError``; for
``Rollout.stall_timeout`` seconds in-flight trajectories stopped settling, or no trainer
step completed while groups kept being dropped as too stale, or an inference worker
stayed below the trainer's version − alpha → ``StallError``, naming the trainer's
version, each worker's and its last load error. A trajectory that failed with a
configuration error (``rollart.buffer.arrivals.STOPS_RUN``: an agent's request the chat
template can never serve) stops the run at the next look with that error
(``stop_on_config_error``: a ``ChatTemplateError``, one line and rc 2 from the CLI).
A task whose every trajectory failed for ``Rollout.failing_task_steps`` trainer steps
in a row is no longer launched (``after_step``, the rule: ``rollart.policy.quarantine``);
once every task is, the run stops with ``TasksStoppedError`` (one line, rc 2).

After every step the loop reads the ledger's counts (``traj/<state>``) with the rest of
the fleet's sample; the buffer checks that they add up to the launches (a mismatch
raises ``AccountingError``).
"""

from __future__ import annotations

import abc
import logging
import time

from rollart.control.fleet import ActorLost, Fleet
from rollart.policy.admission import GroupSequence
from rollart.policy.quarantine import FailingTasks, TasksStoppedError
from rollart.policy.staleness import StalenessBound
from rollart.policy.watchdog import Watchdog

logger = logging.getLogger(__name__)


class Pipeline(abc.ABC):
    """Shared by the modes: picks (task, seed) for groups, steps the trainer, watches."""

    def __init__(self, fleet: Fleet, graph):
        self.fleet, self.actors, self.graph = fleet, fleet.actors, graph
        self.sequence = GroupSequence(graph.tasks, graph.task_weights, graph.seed,
                                      graph.algo.group_size)
        self.errors: list[str] = []
        self.watchdog = Watchdog.for_graph(graph, time.monotonic())
        self._checked = 0.0  # last watchdog look (check_failures)
        self._named: set[str] = set()  # tasks whose first failure was named in the console
        self.failing = FailingTasks(graph.rollout.failing_task_steps)  # stopped tasks
        self.refilled_groups = 0  # lockstep modes: groups re-run after all members failed
        self.restarted_groups = 0  # lockstep modes: groups restarted after a lost manager
        self.trainer_recoveries = 0

    @property
    def supervisor(self):
        return self.fleet.supervisor

    @property
    def version(self) -> int | None:
        """The trainer's version after the latest step (None before the first)."""
        return self.watchdog.version

    @property
    def n_groups(self) -> int:
        return self.sequence.n_groups

    def next_group(self) -> tuple:
        return self.sequence.next()

    def state(self) -> dict:
        """What a checkpoint needs to continue the group sequence (``rollart.control.checkpoint``)."""
        return self.sequence.state()

    def load_state(self, state: dict) -> None:
        self.sequence.load_state(state)
        self.failing.stopped = sorted(self.sequence.stopped)

    @abc.abstractmethod
    def step(self, step: int) -> dict:
        """One trainer step in this mode; returns the trainer's metrics."""

    def close(self) -> None:
        """The run is over (finished, stopped or failed): undo what the mode changed
        on the cluster (the asynchronous modes: process priorities)."""

    # -- a pool shrinking (rollart.control.scaling) -------------------------------------
    def release_manager(self, mgr) -> None:
        """``mgr`` is drained before its worker leaves: it starts no more groups. The
        lockstep modes launch their batches from here, between steps: nothing to do."""

    def forget_manager(self, mgr, lost: bool) -> None:
        """``mgr`` left the run (``lost``: with groups still running, which the run
        hands out again)."""

    # -- waiting, healing, watching ---------------------------------------------------
    def heal(self) -> None:
        if self.supervisor is not None:
            self.supervisor.heal()
        self.check_failures()

    def wait(self, fut, actor=None, while_waiting=None):
        """``fut``'s result, healing and watching meanwhile (``Fleet.wait``)."""
        return self.fleet.wait(fut, self._ticker(while_waiting), actor)

    def _ticker(self, while_waiting=None):
        if while_waiting is None:
            return self.heal

        def tick():
            while_waiting()
            self.heal()
        return tick

    def check_failures(self, every: float = 1.0) -> None:
        """Stop a run that cannot progress (the rules: ``rollart.policy.watchdog``):
        ``FailureStormError`` or ``StallError``, checked at most every ``every`` s."""
        dog, now = self.watchdog, time.monotonic()
        if now - self._checked < every:
            return
        self._checked = now
        snap = self.fleet.sample(managers=False, workers=bool(dog.stall))
        stop_on_config_error(snap.buffer)
        self.name_failures(snap.buffer)
        if not (dog.stall or dog.streak_limit):
            return
        why = dog.stalled(snap.buffer, snap.worker_versions() if dog.stall else None, now)
        if why:
            from rollart.control.supervisor import StallError

            raise StallError(why)
        if not dog.storm(snap.buffer):
            return
        from rollart.control.supervisor import FailureStormError

        errors = self.fleet.ask_buffer("recent_errors")
        raise FailureStormError(
            f"the last {snap.buffer['failed_streak']} trajectories all failed and none "
            "reached the buffer, so the run stops (Rollout.failure_streak_limit="
            f"{dog.streak_limit}). Latest errors:\n  " + "\n  ".join(errors) + "\nFix the "
            "env, reward or inference pool they point at, then resume from the last "
            "checkpoint (rollart train --resume RUN).")

    def name_failures(self, buffer: dict) -> None:
        """One console line per task at its first trajectory that failed with an error,
        with what the error said (``SampleBuffer.stats``' ``first_errors``): a task that
        fails is named when it first does, not steps later under another reason."""
        for task, error in sorted((buffer.get("first_errors") or {}).items()):
            if task not in self._named:
                self._named.add(task)
                first = str(error).strip().splitlines()[0] if str(error).strip() else "?"
                logger.warning("task %r: a trajectory failed: %s (its first failure; "
                               "failed ones are counted as traj/failed/%s)", task,
                               first[:400], task)

    def after_step(self, buffer: dict) -> None:
        """At each step's end (``buffer``: the buffer's ``stats`` read after it): name
        the tasks that failed for the first time (a step shorter than the watchdog's
        tick left them unnamed) and stop the tasks that failed every trajectory for
        ``Rollout.failing_task_steps`` steps (``rollart.policy.quarantine``)."""
        self.name_failures(buffer)
        for task in self.failing.update(buffer.get("tasks")):
            error = str((buffer.get("first_errors") or {}).get(task) or "failed").strip()
            logger.warning("task %r stopped: every trajectory of it failed for %d trainer "
                           "steps in a row, so it is not launched again (its first error: "
                           "%s; counted as rollout/tasks_stopped)", task,
                           self.failing.steps, error.splitlines()[0][:400])
            self.stop_task(task)
        if self.failing.stopped and self.sequence.exhausted:
            firsts = buffer.get("first_errors") or {}
            raise TasksStoppedError(
                "every task was stopped after failing every trajectory for "
                f"{self.failing.steps} trainer steps in a row (Rollout.failing_task_steps)"
                ": " + "; ".join(f"{t}: {str(firsts.get(t, 'failed')).strip()[:200]}"
                                 for t in self.failing.stopped)
                + ". Fix the env or reward they point at, then run again")

    def adapt(self, trainer: dict, sample) -> dict:
        """After each step (``trainer``: its metrics; ``sample``: the fleet's figures
        read after it): the mode's own figures for the row, and whatever it re-decides
        for the next step (the asynchronous modes: the in-flight limit). None here."""
        return {}

    def stop_task(self, task: str) -> None:
        """Draw no more groups of ``task`` (the asynchronous modes: in the buffer too)."""
        self.sequence.stop(task)

    # -- the trainer step -------------------------------------------------------------
    def train(self, step: int, while_waiting=None) -> dict:
        """Trainer step ``step`` on the buffer's groups; a lost trainer is replaced and
        the step re-run (or recorded, if it published before it died)."""
        spurious = 0
        while True:
            trainer = self.actors.trainer
            try:
                fut = self.fleet.submit(trainer, "train_step", self.actors.buffer, step)
                metrics = self.wait(fut, trainer, while_waiting)
            except ActorLost as e:
                error = e
            else:
                events = metrics.pop("trainer/gang_events", None)  # a gang that re-formed
                if events and self.supervisor is not None:
                    self.supervisor.gang_restarted(events)
                self.watchdog.stepped(metrics["version"], time.monotonic())
                return metrics
            if self.supervisor.alive(trainer):
                # a comm error from another worker (e.g. an env worker dying while the
                # batch was gathered): the trainer is fine; once it is idle, re-run
                spurious += 1
                if spurious > 3:
                    raise error.__cause__ or error
                logger.warning("trainer step %d failed with %r but the trainer is alive; "
                               "re-running the step", step, error.__cause__ or error)
                self.supervisor.wait_idle(trainer)
                continue
            logger.warning("trainer step %d lost its trainer (%r); replacing it", step,
                           error.__cause__ or error)
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
            try:
                out = self.fleet.call(self.actors.buffer, "release_taken", step, min_version,
                                      version - 1)
                break
            except ActorLost as e:
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
        ``[(worker, future), ...]``."""
        out = []
        for w, _, _ in self.actors.workers:
            try:
                out.append((w, self.fleet.submit(w, "wait_version", version)))
            except ActorLost:
                continue
        return out


def stop_on_config_error(buffer: dict) -> None:
    """Raise the configuration error a trajectory met (the buffer's ``stop``:
    ``rollart.buffer.arrivals.STOPS_RUN``), so the run ends at once with its message
    (the CLI prints it as one line, rc 2) instead of failing every trajectory until a
    failure storm.

    >>> stop_on_config_error({"stop": None})
    >>> stop_on_config_error({"stop": "qa: ChatTemplateError: set tools_in_prompt"})
    Traceback (most recent call last):
    ...
    rollart.chat.template_support.ChatTemplateError: task 'qa': set tools_in_prompt
    """
    stop = buffer.get("stop")
    if not stop:
        return
    from rollart.chat.template_support import ChatTemplateError

    task, _, error = stop.partition(": ")
    message = error.partition(": ")[2] or error
    raise ChatTemplateError(message if repr(task) in message else f"task {task!r}: {message}")
