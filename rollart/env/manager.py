"""``EnvManager``: a Dask actor on the CPU_ENV pool that runs many trajectories at once.

Each trajectory is its own coroutine (``TrajectoryRunner.run``: env.reset →
LLMProxy.generate → env.step → … → reward task on the REWARD pool), so nothing waits on
a batch barrier and the driver never sees a token. This module owns the *group*
lifecycle around them:

* **Redundancy**: a group of ``group_size`` may launch ``ceil(group_size * redundancy)``
  members; once ``group_size`` are delivered to the ``SampleBuffer`` the rest are
  cancelled (their envs closed) and recorded as ``cancelled``. With ``backup_after=f``
  the extra members are *backups*: they start only once ``ceil(f * group_size)``
  members are delivered, at most one per member still running: groups without
  stragglers waste little, and extra compute goes to the groups that have them.
* **Abort and replace**: ``abort_older_than(v)`` cancels every running member whose
  oldest generated token is older than ``v`` (it could never be trained) and starts a
  fresh member of the same group in its place. With ``stale_members="rescore"`` it
  raises the members' floor instead: each re-scores its tokens older than it at its next
  turn boundary and goes on, aborted as above only when no worker reaches the floor in
  time (``rollart.env.rescore``).
* **Replace failures** (not in lockstep batches): a member that fails (env raised,
  hung past a time-out, returned garbage) is recorded as ``failed`` and a new member
  starts in its place, up to ``group_size`` replacements per group; after that
  failures are delivered to the buffer, which drops them from their group (never a
  zero reward among its advantages: ``rollart.buffer.infra``).
* **Lockstep batches** (the synchronous baselines): ``run_batch`` moves a whole batch
  turn by turn through a ``TurnBarrier``.
* **Taking work** (the async mode): ``take_work`` runs the groups the buffer hands out
  when a slot frees (``SampleBuffer.acquire``, ``rollart.buffer.backpressure``), each
  as ``run_group``, until the manager or the buffer closes.

Every launch, delivery, cancellation and abort is reported to the buffer's ledger.
Deliveries go to the buffer in ``put_many`` calls (``rollart.runtime.coalesce``): the
member that fills its group at once, with whatever else is waiting; the others wait
up to ``put_linger`` seconds (0.05) for company, so a group's members mostly travel in one
call instead of one call each.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field

import numpy as np

from rollart.policy.redundancy import Redundancy
from rollart.env.barrier import TurnBarrier
from rollart.env.rescore import Rescorer, stale_members_problem
from rollart.env.trajectory import TokenLog, TrajectoryRunner
from rollart.runtime.coalesce import Coalescer
from rollart.runtime.handles import Handle
from rollart.model import load_tokenizer
from rollart.runtime.near import near
from rollart.policy.staleness import within
from rollart.types import TrajState

logger = logging.getLogger(__name__)


@dataclass
class _GroupRun:
    task: object
    seed: int
    group_id: str
    size: int
    need: int = -1  # members still to deliver (< size when a lost manager delivered some)
    barrier: TurnBarrier | None = None
    next_index: int = 0
    delivered: int = 0
    putting: int = 0  # deliveries awaiting the buffer
    replaced: int = 0  # failed members replaced by new ones (at most ``size``)
    backups: int = 0  # extra members still to start as backups
    backup_at: int = 0  # ... once this many members are delivered
    jobs: dict = field(default_factory=dict)  # traj_id -> asyncio.Task
    logs: dict = field(default_factory=dict)  # traj_id -> TokenLog (live members)
    reasons: dict = field(default_factory=dict)  # traj_id -> why it was cancelled
    outcomes: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None  # the first member that raised (not a trajectory's failure)

    def __post_init__(self):
        if self.need < 0:
            self.need = self.size

    @property
    def filled(self) -> bool:
        return self.delivered >= self.need


class EnvManager:
    """Runs groups of trajectories; one per CPU_ENV worker.

    >>> # mgr = client.submit(EnvManager, proxy, buffer, model_path, actor=True,
    >>> #                     resources={"CPU_ENV": 1}).result()
    >>> # mgr.run_group(task, seed=3, group_id="g3", group_size=8).result()
    """

    def __init__(self, proxy, buffer, model_path: str, *, temperature: float = 1.0,
                 top_p: float = 1.0, env_step_timeout: float = 30.0,
                 reward_timeout: float = 30.0, trajectory_timeout: float | None = None,
                 max_concurrency: int = 256,
                 inference_pools: tuple[str, ...] | None = None, seed: int = 0,
                 max_context: int | None = None, env_threads: int = 8,
                 local_reward: bool = True, conversation: str = "auto",
                 system_prompt: str | None = None, put_linger: float = 0.05,
                 stale_members: str = "abort"):
        if problem := stale_members_problem(stale_members):
            raise ValueError(problem)
        self.buffer = near(buffer)
        self.runner = TrajectoryRunner(
            proxy, load_tokenizer(model_path), temperature=temperature, top_p=top_p,
            env_step_timeout=env_step_timeout, reward_timeout=reward_timeout,
            trajectory_timeout=trajectory_timeout, inference_pools=inference_pools, seed=seed,
            max_context=max_context or _max_positions(model_path), env_threads=env_threads,
            local_reward=local_reward, conversation=conversation,
            system_prompt=system_prompt, model_path=model_path)
        self._slots = asyncio.Semaphore(max_concurrency)  # binds to the loop on first use
        # finished trajectories go to the buffer in one call per batch (the buffer read
        # at each call: set_buffer may replace it)
        self._puts = Coalescer(lambda items: self.buffer.put_many(items), linger=put_linger)
        self._groups: dict[str, _GroupRun] = {}
        self._cleanups: set[asyncio.Task] = set()  # see _unstarted
        self._registering = 0  # _launch calls waiting for the ledger (see cancel_all)
        self._taking: asyncio.Task | None = None  # the take_work loop
        self._buffer_changed: asyncio.Event | None = None  # set by set_buffer
        self._closing = False
        self.group_errors: list[str] = []  # run_group calls of take_work that raised
        self.counts = {"launched": 0, "delivered": 0, "failed": 0, "cancelled": 0,
                       "aborted": 0, "replaced": 0, "backups": 0, "groups_taken": 0,
                       # generated tokens of members cancelled or aborted here (never
                       # delivered, so never trained on)
                       "wasted_tokens": 0}
        self.rescorer = Rescorer(temperature) if stale_members == "rescore" else None
        if self.rescorer is not None:
            self.runner.refresh = self._refresh

    # -- public actor methods -----------------------------------------------------------
    async def run_group(self, task, seed: int, group_id: str, group_size: int,
                        redundancy: float = 1.0, need: int | None = None,
                        first_index: int = 0, backup_after: float | None = None) -> dict:
        """Run a group of ``task`` from ``seed`` until ``group_size`` members are
        delivered to the buffer; return a summary.

        The ``redundancy`` extras start with the group, or with ``backup_after`` as
        backups (see the module docstring). A group restarted after its manager was
        lost passes ``need`` (the members still missing) and a ``first_index`` past the
        lost manager's member ids.
        """
        need = group_size if need is None else need
        grp = _GroupRun(task, seed, group_id, group_size, need, next_index=first_index)
        start, grp.backups, grp.backup_at = Redundancy(redundancy, backup_after).plan(need)
        if need > 0:
            await self._launch(grp, start)
        else:
            grp.done.set()
        return await self._finish(grp)

    async def take_work(self, holder: str, tasks=None, redundancy: float = 1.0,
                        backup_after: float | None = None) -> dict:
        """Run the groups the buffer hands out to ``holder`` (this manager's key; tasks
        named in ``tasks``, or any), each as ``run_group`` with ``redundancy`` and
        ``backup_after``, taking the next one as soon as the buffer frees a slot. Returns
        when the manager or the buffer closes. A buffer that was lost is asked again
        once the driver hands over its replacement (``set_buffer``)."""
        self._taking = asyncio.current_task()
        jobs: set[asyncio.Task] = set()
        try:
            await self._take(holder, tasks, redundancy, backup_after, jobs)
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # close() stopped the loop: end as when the buffer closes. Left to propagate,
            # the cancellation dropped this call's connection, and the scheduler relaying
            # it logged "broadcast to ... failed: CommClosedError" at the end of every run
        finally:
            self._taking = None
        return {"groups_taken": self.counts["groups_taken"], "running": len(jobs)}

    async def _take(self, holder: str, tasks, redundancy: float, backup_after,
                    jobs: set) -> None:
        """``take_work``'s loop: acquire work from the buffer, start each group."""
        while not self._closing:
            try:
                work = await self.buffer.acquire(holder, tasks)
            except Exception as e:  # noqa: BLE001 - the buffer's worker was lost?
                if self._closing:
                    break
                logger.warning("acquire on the sample buffer failed (%r); waiting for "
                               "its replacement", e)
                await self._new_buffer(5.0)
                continue
            if work is False:  # the buffer closes, or counts this holder lost
                break
            if work is None:
                continue  # no slot freed meanwhile: ask again
            self.counts["groups_taken"] += 1
            job = asyncio.ensure_future(self._run_work(work, redundancy, backup_after))
            jobs.add(job)
            job.add_done_callback(jobs.discard)

    async def _run_work(self, work, redundancy: float, backup_after) -> None:
        try:
            await self.run_group(work.task, work.seed, work.group_id, work.size,
                                 redundancy=redundancy, need=work.need,
                                 first_index=work.first_index, backup_after=backup_after)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a manager-level error: end its group
            msg = f"{work.group_id}: {type(e).__name__}: {e}"
            logger.warning("group %s", msg)
            self.group_errors.append(msg)
            try:
                await self.buffer.end_group(work.group_id, msg)
            except Exception as e2:  # noqa: BLE001
                logger.warning("could not end group %s at the buffer: %r", work.group_id, e2)

    async def _new_buffer(self, timeout: float) -> None:
        if self._buffer_changed is None:
            self._buffer_changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._buffer_changed.wait(), timeout)
        except TimeoutError:
            pass
        self._buffer_changed.clear()

    async def set_inference_workers(self, workers: list) -> int:
        """Route new requests over ``[(InferenceWorker actor, pool), ...]`` (after the
        driver re-created a lost one), with the same task routes (PD, affinities) as
        before (``LLMProxy.with_workers``); returns how many workers."""
        self.runner.proxy = self.runner.proxy.with_workers(workers)
        return len(workers)

    async def set_buffer(self, buffer) -> int:
        """Report to ``buffer`` from now on: the driver re-created a lost one, which
        reloaded its durable state (``rollart.control.stages``, ``SampleBuffer(recover=True)``).
        That buffer closed every group that was not complete and counted its members in
        flight as failed (orphaned), so the groups running here end now: their members
        are cancelled (the new buffer ignores their late reports) and each ``run_group``
        returns. Returns how many groups ended."""
        # ``buffer`` may come as ``(cls, address, key)``: the Handle is then built here,
        # bound to this worker (``rollart.control.stages`` hands it so at start: an actor object
        # passed in-process arrives bound to the driver's client)
        if isinstance(buffer, tuple):
            buffer = Handle(*buffer)
        self.buffer = near(buffer)
        if self._buffer_changed is not None:
            self._buffer_changed.set()  # take_work asks the new buffer
        groups = list(self._groups.values())
        jobs = [j for g in groups for j in g.jobs.values()]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        for grp in groups:  # also those whose last member failed to reach the lost buffer
            self._maybe_done(grp)
        return len(groups)

    async def run_batch(self, groups: list[tuple]) -> list[dict]:
        """Run ``[(task, seed, group_id, group_size), ...]`` in lockstep: every turn
        waits for every live trajectory of the batch (the synchronous baselines)."""
        barrier = TurnBarrier(sum(g[3] for g in groups))
        runs = [_GroupRun(t, s, gid, n, barrier=barrier) for t, s, gid, n in groups]
        for grp in runs:
            await self._launch(grp, grp.size)
        return list(await asyncio.gather(*(self._finish(g) for g in runs)))

    async def abort_older_than(self, min_version: int) -> int:
        """Abort running members whose oldest generated token is older than
        ``min_version`` and start replacements; returns how many were aborted. With
        ``stale_members="rescore"`` none is aborted now: they re-score at their next
        turn boundary (``_refresh``)."""
        if self.rescorer is not None:
            self.rescorer.raise_floor(min_version)
            return 0
        n = 0
        for grp in list(self._groups.values()):
            for traj_id, log in list(grp.logs.items()):
                gen = [v for v, m in zip(log.versions, log.loss_mask) if m]
                if gen and not within(min(gen), min_version) and traj_id in grp.jobs:
                    grp.reasons[traj_id] = TrajState.ABORTED.value
                    grp.jobs[traj_id].cancel()
                    n += 1
        return n

    async def _refresh(self, traj, task, log) -> None:
        """The runner's hook (``stale_members="rescore"``): re-score the member's stale
        tokens; when that fails it is aborted here, exactly as ``abort_older_than``
        aborts (cancelled, settled ``aborted``, replaced)."""
        r = self.runner
        at_end = r.running.get(traj.traj_id) == TrajState.SCORING.value
        if await self.rescorer.refresh(r.proxy, traj.traj_id, task.name, log,
                                       r.inference_pools, at_end):
            return
        grp = self._groups.get(traj.group_id)
        job = grp.jobs.get(traj.traj_id) if grp is not None else None
        if job is None or job is not asyncio.current_task():
            return  # not a member of this manager's groups: it goes on as it is
        grp.reasons[traj.traj_id] = TrajState.ABORTED.value
        job.cancel()
        await asyncio.sleep(0)  # the cancellation lands here

    async def stats(self) -> dict:
        r = self.runner
        states: dict[str, int] = {}
        for s in r.running.values():
            states[s] = states.get(s, 0) + 1
        lat = sorted(r.env_latency[-1000:])
        turns = max(r.turns, 1)
        proxy = r.proxy.stats()
        rescored = self.rescorer.counts if self.rescorer is not None else {}
        return {**self.counts, **rescored,
                "in_flight": sum(len(g.jobs) for g in self._groups.values()),
                "env_threads": r.env_threads,
                "group_errors": len(self.group_errors), "groups_running": len(self._groups),
                "rerouted": proxy.get("rerouted", 0),
                # deliveries to the buffer, and the calls that carried them (put_many)
                "put_items": self._puts.items, "put_calls": self._puts.calls,
                "states": states, "turns": r.turns,
                "env_step_p50": lat[len(lat) // 2] if lat else 0.0,
                "env_step_p99": lat[int(len(lat) * 0.99)] if lat else 0.0,
                "turn_overhead_s": (r.turn_seconds - r.gen_seconds - r.env_seconds) / turns,
                "barrier_wait_s": r.barrier_wait, "rewards_here": r.rewards["here"],
                # in all: CPU seconds rendering/tokenising turns; wall seconds of env
                # calls (summed over the trajectories running at once)
                "render_cpu_s": r.render_seconds, "env_s": r.env_seconds,
                "reward_tasks": r.rewards["tasks"], "stuck_env_calls": r.stuck_calls,
                **r.stats(), **r.serverless.stats()}

    async def env_latencies(self, last: int = 1000) -> np.ndarray:
        """The latest ``last`` env step latencies in seconds (for the dashboard), as one
        float64 array: Dask sends an array as one frame, while a list of floats returned
        by an actor is pickled float by float (1000 pickles per call, every second)."""
        return np.asarray(self.runner.env_latency[-last:], dtype=np.float64)

    async def cancel_all(self, settle_s: float = 30.0) -> int:
        """Cancel every running trajectory (end of run); returns how many. Returns once
        everything of them has reached the buffer (within ``settle_s``): the settling of
        members cancelled before they started (``_unstarted``), the deliveries still
        lingering in the put coalescer, the launches still registering (``_launch``
        settles those as cancelled once closing). The driver then counts whatever the
        buffer still has in flight as lost with its worker (``orphan_all_in_flight``);
        anything of a live manager arriving after that was miscounted as lost."""
        jobs = [j for g in self._groups.values() for j in g.jobs.values()]
        for j in jobs:
            j.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settle_s
        while loop.time() < deadline:
            if self._cleanups:
                await asyncio.wait(list(self._cleanups), timeout=deadline - loop.time())
            elif len(self._puts) or self._registering:
                await self._puts.flush()
                await asyncio.sleep(0.01)
            else:
                break
        else:
            logger.warning("closing: %d members still settling, %d deliveries and %d "
                           "launches still pending after %.0f s", len(self._cleanups),
                           len(self._puts), self._registering, settle_s)
        await self._puts.flush()
        return len(jobs)

    async def drain(self, timeout: float) -> dict:
        """Let the groups running here finish, for at most ``timeout`` s: the pool is
        shrinking (``rollart.control.scaling``) and the driver has already retired this
        manager's holder at the buffer, so no group starts here any more. Returns
        ``{"finished", "left"}``: the groups that ended meanwhile, and those still
        running (the driver hands them out again once this worker is retired)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen: set[str] = set()
        while True:
            running = [g for g in self._groups.values() if not g.done.is_set()]
            seen.update(self._groups)
            left = deadline - loop.time()
            if not running or left <= 0:
                break
            waits = [asyncio.ensure_future(g.done.wait()) for g in running]
            _, pending = await asyncio.wait(waits, timeout=min(left, 0.5),
                                            return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
        return {"finished": len(seen) - len(running), "left": len(running)}

    async def close(self) -> None:
        self._closing = True
        if self._taking is not None:
            self._taking.cancel()
        await self.cancel_all()
        self.runner.close()

    # -- group lifecycle ----------------------------------------------------------------
    async def _launch(self, grp: _GroupRun, n: int) -> None:
        if grp.error is not None:  # the group is ending: no replacement, no backup
            self._maybe_done(grp)
            return
        ids = [f"{grp.group_id}-{grp.next_index + i}" for i in range(n)]
        grp.next_index += n
        # while the ledger registers them they are neither jobs nor deliveries: count
        # them as pending, or another member ending meanwhile would end the group early
        grp.putting += 1
        self._registering += 1
        try:
            await self.buffer.launched(ids)
            self.counts["launched"] += n
            if self._closing:  # closed while they registered: they never start
                await self._settle(ids, TrajState.CANCELLED.value)
        finally:
            grp.putting -= 1
            self._registering -= 1
        if self._closing:
            self._maybe_done(grp)
            return
        self._groups[grp.group_id] = grp
        for traj_id in ids:
            grp.logs[traj_id] = TokenLog()
            job = grp.jobs[traj_id] = asyncio.ensure_future(self._member(grp, traj_id))
            job.add_done_callback(functools.partial(self._unstarted, grp, traj_id))
        if grp.filled:  # filled while these were registered (a backup, a replacement)
            self._cancel_rest(grp)

    def _unstarted(self, grp: _GroupRun, traj_id: str, job: asyncio.Task) -> None:
        """A member cancelled before its first step (e.g. a backup registered while its
        group filled) never ran ``_member``'s clean-up: do it here, else the group would
        wait for it forever. Members that ran have left ``grp.jobs`` already."""
        if grp.jobs.get(traj_id) is not job:
            return
        grp.jobs.pop(traj_id, None)
        grp.logs.pop(traj_id, None)
        grp.putting += 1  # the group is not done before this member is settled

        def settled(task: asyncio.Task) -> None:
            self._cleanups.discard(task)
            grp.putting -= 1
            if not task.cancelled() and task.exception() is not None:
                logger.warning("settling member %s failed: %r", traj_id, task.exception())
            self._maybe_done(grp)

        task = asyncio.ensure_future(self._cancelled(grp, traj_id))
        self._cleanups.add(task)
        task.add_done_callback(settled)

    async def _finish(self, grp: _GroupRun) -> dict:
        await grp.done.wait()
        self._groups.pop(grp.group_id, None)
        if grp.error is not None:  # take_work ends the group at the buffer with it
            raise RuntimeError(f"group {grp.group_id} ended: {grp.error}")
        return {"group_id": grp.group_id, "task": grp.task.name, "rewards": grp.rewards,
                "outcomes": grp.outcomes}

    async def _member(self, grp: _GroupRun, traj_id: str) -> None:
        """One member, contained: a member that raises (not a trajectory's failure,
        which the runner returns as ``failed``: a buffer call that raised, a bug) ends its
        group: the rest are cancelled and ``run_group`` raises with the error, which
        ``take_work`` reports to the buffer (``end_group``). Left to propagate, the
        exception ended only this task: the group ended one member short without a word,
        or, when it was the last one running, never ended."""
        try:
            await self._run_member(grp, traj_id)
        except Exception as e:  # noqa: BLE001 - contained: the group ends with it
            msg = f"member {traj_id}: {type(e).__name__}: {e}"
            logger.warning("%s", msg)
            grp.error = grp.error or msg
            self._cancel_rest(grp)
            self._maybe_done(grp)

    async def _run_member(self, grp: _GroupRun, traj_id: str) -> None:
        traj, log = None, grp.logs[traj_id]
        try:
            async with self._slots:
                traj = await self.runner.run(grp.task, grp.seed, traj_id, grp.group_id,
                                             grp.logs[traj_id], grp.barrier)
        except asyncio.CancelledError:
            pass  # handled below, once the member is no longer counted as running
        finally:
            grp.jobs.pop(traj_id, None)
            grp.logs.pop(traj_id, None)
        if traj is None:
            await self._cancelled(grp, traj_id, sum(log.loss_mask))
            return
        if grp.filled:  # a redundant member that finished late
            await self._settle([traj_id], TrajState.CANCELLED.value, sum(traj.loss_mask))
        elif traj.state == TrajState.FAILED.value and grp.barrier is None and \
                grp.replaced < grp.size:
            # failed (env raised, hung, returned garbage): record it, start a new member
            grp.replaced += 1
            grp.putting += 1
            try:
                await self.buffer.record_failed(traj)
            finally:
                grp.putting -= 1
            self.counts["failed"] += 1
            self.counts["replaced"] += 1
            await self._launch(grp, 1)
        else:
            grp.delivered += 1  # reserve the slot before awaiting: others see it filled
            grp.outcomes.append(traj.outcome)
            grp.rewards.append(traj.reward)
            failed = traj.state == TrajState.FAILED.value  # before the buffer owns it
            grp.putting += 1
            try:
                # the member that fills its group goes at once (the trainer waits
                # for complete groups); the others may wait put_linger for company
                await self._puts((traj, grp.size), urgent=grp.filled)
            finally:
                grp.putting -= 1
            self.counts["delivered"] += 1
            self.counts["failed"] += failed
        if grp.filled:
            self._cancel_rest(grp)
        elif n := Redundancy.backups_now(grp.backups, grp.delivered, grp.backup_at,
                                         len(grp.jobs)):
            grp.backups = 0
            self.counts["backups"] += n
            await self._launch(grp, n)  # backups for the members still running
        self._maybe_done(grp)

    @staticmethod
    def _cancel_rest(grp: _GroupRun) -> None:
        """The group is full: cancel its members still running (settled as cancelled)."""
        for other in list(grp.jobs.values()):
            other.cancel()

    @staticmethod
    def _maybe_done(grp: _GroupRun) -> None:
        """The group is over once nothing of it runs or is being delivered."""
        if not grp.jobs and not grp.putting:
            grp.done.set()

    async def _cancelled(self, grp: _GroupRun, traj_id: str, tokens: int = 0) -> None:
        reason = grp.reasons.pop(traj_id, TrajState.CANCELLED.value)
        await self._settle([traj_id], reason, tokens)
        if reason == TrajState.ABORTED.value and not grp.filled:
            await self._launch(grp, 1)  # replace it: the group still needs a member
        else:  # filled, or shut down before it filled
            self._maybe_done(grp)

    async def _settle(self, traj_ids: list[str], state: str, tokens: int = 0) -> None:
        """``traj_ids`` end here, cancelled or aborted (one buffer call), their
        ``tokens`` generated wasted."""
        key = "aborted" if state == TrajState.ABORTED.value else "cancelled"
        self.counts[key] += len(traj_ids)
        self.counts["wasted_tokens"] += tokens
        await self.buffer.settle(traj_ids, state)


def _max_positions(model_path: str) -> int:
    """The model's context length (prompt + generation), from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    return int(getattr(config, "max_position_embeddings", None) or 2048)
