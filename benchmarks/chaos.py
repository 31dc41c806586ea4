"""Chaos soak: train through env failures, hangs, stragglers and a killed worker.

One async run of N trainer steps on a tagged cluster (two env workers; no ``BUFFER``
tag, so the sample buffer goes on the trainer's worker, its first fallback:
``rollart.control.stages.buffer_worker``) where

* about 20% of trajectories hit an injected env failure (per-step probability derived
  from the task's turns), and 2% of steps hang (cut by ``env_step_timeout``);
* env steps straggle: Pareto-tailed latency whose slowest steps are 10× the fastest;
* one worker, picked at random among {an env worker, an inference worker, the
  trainer (with it the buffer, recovered from its durable journal)}, is killed at a
  random step (in-process: closed, then a fresh worker with the same spec starts after
  1 s; ``--processes``: SIGKILL, and its Nanny restarts it);
* and the trainer's worker is killed mid-step (``--trainer-kill-step K``, on by
  default): after step K's row is written, once step K+1 has taken its batch (or half
  a step's time into it), while that step runs (its row not written yet; the RESULT's
  ``trainer_mid_step`` says it was).

It prints the kills, the recoveries and one line

    RESULT lost=… duplicated=… max_recovery_s=… steps=… failed_frac=… restarted_groups=…

``lost`` and ``duplicated`` are counted without the ledger or its journal (``audit``),
from four records: what the envs played (every env is wrapped by ``RecordedEnv``, which
appends each episode's start and end, with its task and seed, to files of its own
outside the run dir), the trajectory rows (``rollart.buffer.read_samples``), the
trainer's own report of each step's batch (``trainer/batch_size`` and
``trainer/batch_sha1`` in ``metrics.jsonl``) and the group sequence the run's seed
draws (replayed from ``graph.json``):

* ``lost_trained``: trajectories the trainer says it trained at a step that are not
  ``trained`` at that step in the rows (per step: the batch size minus the rows there;
  a step whose rows do not hash to the trainer's digest counts its whole batch);
* ``lost_completed``: episodes an env played to the end whose trajectory has no row:
  per (task, seed), env-finished episodes beyond the rows whose env finished, less the
  members its group may have had beyond its size (redundant, aborted or lost-and-
  restarted members each started an episode of their own: at most ``started - size``),
  for a group that left the buffer whole; all of them for a (task, seed) the sequence
  never drew. A group with fewer rows than members, none of them left, was running when
  the run ended: its unrowed episodes are ``open_at_end`` (printed in the audit line);
* ``lost`` = the two; ``duplicated``: ids ``trained`` at two steps in the raw Parquet
  parts, plus trainer-reported trajectories beyond the distinct ids trained.

``ledger_lost`` is the old figure (the ledger's ``in_flight`` after shutdown plus any
gap in its sum), kept beside them. ``orphaned``: trajectories that were in flight on a
killed worker (counted ``failed``; their groups restart). ``max_recovery_s``: kill → the
replacement actor is ready, worst over the kills. A script, not a timed test.

The run trains ``--steps`` steps and then goes on, for at most ``--recovery-wait``
seconds, until every kill has been recovered from: the replacement is made while the
pipeline waits, so a run that ended first (a short run on a loaded machine, where the
remaining steps finished on the surviving workers before the killed one came back)
reported no recovery at all (``max_recovery_s=inf``) although nothing was wrong.

    python benchmarks/chaos.py --quick
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _chaos_audit.py

from _results import Run, add_arguments  # noqa: E402
from _chaos_audit import (audit, check_trainer_record, digest_of,  # noqa: E402,F401
                          read_env_log, reported_subset)


#: the actors a killed worker of each tag takes with it (the buffer lives on TRAIN here)
ROLES = {"CPU_ENV": {"env"}, "H800": {"inference"}, "H20": {"inference"},
         "TRAIN": {"trainer", "buffer"}}


def chaos_resources(processes: bool):
    from rollart.runtime.resources import Pool, Resources
    from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN

    return Resources(pools=(
        Pool("infer-h800", tag=H800, kind="compute_gpu"),
        Pool("infer-h20", tag=H20, kind="bandwidth_gpu"),
        Pool("env", tag=CPU_ENV, kind="cpu_env", workers=2),
        Pool("reward", tag=REWARD, kind="reward", threads=2),
        Pool("trainer", tag=TRAIN, kind="trainer"),
    ), processes=processes, dashboard_address=":0", source="benchmarks/chaos.py")


class RecordedEnv:
    """An env that appends what it plays to ``{log_dir}/env-{pid}.jsonl``, outside the
    run and its ledger: ``start`` (task, seed) at each reset, ``end`` with ``success``
    when a step ends the episode, ``cut`` when a reset or step raised or was cancelled
    (an injected failure, a hang cut by its time-out, a cancelled member). An episode
    on a killed worker ends with no line. Offers ``areset``/``astep`` when the wrapped
    env does (``FaultyEnv``), so the env manager awaits it as it would the env."""

    def __init__(self, env, task: str, log_dir: str) -> None:
        self.env, self.task, self.log_dir, self.seed = env, task, log_dir, None
        if hasattr(env, "areset"):
            self.areset, self.astep = self._areset, self._astep

    def _write(self, event: str, **extra) -> None:
        import json
        import os

        line = json.dumps({"ev": event, "task": self.task, "seed": self.seed, **extra})
        with open(os.path.join(self.log_dir, f"env-{os.getpid()}.jsonl"), "a") as f:
            f.write(line + "\n")

    def _after(self, step):
        if step.done:
            self._write("end", success=bool(step.info.get("success")))
        return step

    def reset(self, seed: int):
        self.seed = int(seed)
        self._write("start")
        return self._guard(self.env.reset, seed)

    def step(self, action):
        return self._after(self._guard(self.env.step, action))

    async def _areset(self, seed: int):
        self.seed = int(seed)
        self._write("start")
        return await self._aguard(self.env.areset(seed))

    async def _astep(self, action):
        return self._after(await self._aguard(self.env.astep(action)))

    def _guard(self, fn, arg):
        try:
            return fn(arg)
        except BaseException:
            self._write("cut")
            raise

    async def _aguard(self, coro):
        try:
            return await coro
        except BaseException:  # CancelledError included: the episode was cut
            self._write("cut")
            raise

    def close(self) -> None:
        self.env.close()


class RecordedEnvFactory:
    """Picklable factory of ``RecordedEnv`` around ``env_factory()``'s envs."""

    def __init__(self, env_factory, task: str, log_dir: str) -> None:
        self.env_factory, self.task, self.log_dir = env_factory, task, log_dir

    def __call__(self) -> RecordedEnv:
        return RecordedEnv(self.env_factory(), self.task, self.log_dir)


def chaos_graph(steps: int, seed: int, env_fail: float, turns: float = 3.0,
                env_log: str | None = None):
    from dataclasses import replace

    from rollart import GRPO, Graph, Policy, Rollout
    from rollart.chaos.faults import Faults, Latency, with_faults

    per_step = 1 - (1 - env_fail) ** (1 / turns)
    faults = Faults(step=Latency("pareto", seconds=0.003, shape=1.2, cap=0.03),
                    fail_prob=per_step, hang_prob=0.02, hang_seconds=60.0, seed=seed)
    tasks = tuple(with_faults(t, faults) for t in ("gridnav", "guess"))
    if env_log is not None:
        tasks = tuple(replace(t, env_factory=RecordedEnvFactory(t.env_factory, t.name,
                                                                env_log)) for t in tasks)
    return Graph(name="chaos", tasks=tasks, steps=steps, seed=seed, checkpoint_every=2,
                 policy=Policy(warmup_steps=0),
                 algo=GRPO(group_size=2, groups_per_step=3, alpha=1),
                 rollout=Rollout(redundancy=1.5, env_step_timeout=1.0,
                                 trajectory_timeout=30.0))


def _rows(run_dir: Path) -> list[dict]:
    import json

    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def killer(cluster, client, run_dir: Path, at_step: int, tag: str, kills: list,
           restart_after: float | None) -> None:
    from rollart.control.supervisor import lose_worker
    from rollart.runtime.resources import workers_with

    while len(_rows(run_dir)) < at_step:
        time.sleep(0.05)
    addr = workers_with(client, tag)[-1]
    t = time.time()
    kills.append({"tag": tag, "address": addr, "at": t, "after_step": at_step})
    kills[-1]["worker"] = name = lose_worker(cluster, client, addr,
                                             restart_after=restart_after)
    print(f"killed {name} ({tag}, {addr}) after step {at_step}", flush=True)


def trainer_killer(cluster, client, run_dir: Path, after_step: int, kills: list,
                   restart_after: float | None) -> None:
    """Kill the trainer's worker while step ``after_step + 1`` runs: once step
    ``after_step``'s row is written, as soon as the buffer (on the same worker) holds
    that step's batch ``taken`` (``_took``), or half the mean step time so far if that
    is not seen first; ``mid_step``: that step's row is still not there. (Waiting only
    the half step let a fast step finish first: ``trainer_mid_step=0``.)"""
    from rollart.control.supervisor import lose_worker
    from rollart.runtime.resources import workers_with
    from rollart.types import TRAIN

    while len(_rows(run_dir)) < after_step:
        time.sleep(0.02)
    rows = _rows(run_dir)
    addr = workers_with(client, TRAIN)[-1]
    deadline = time.monotonic() + 0.5 * rows[after_step - 1]["time"] / after_step
    while time.monotonic() < deadline and len(_rows(run_dir)) == after_step:
        try:
            if client.run(_took, step=after_step + 1, workers=[addr])[addr]:
                break
        except Exception:  # noqa: BLE001 - the worker is busy or gone: poll again
            pass
        time.sleep(0.01)
    mid_step = len(_rows(run_dir)) == after_step
    kills.append({"tag": TRAIN, "address": addr, "at": time.time(),
                  "after_step": after_step, "mid_step": mid_step})
    kills[-1]["worker"] = name = lose_worker(cluster, client, addr,
                                             restart_after=restart_after)
    print(f"killed {name} (TRAIN, {addr}) during step {after_step + 1}"
          f"{'' if mid_step else ' (its row was already written: not mid-step)'}",
          flush=True)


def _took(step: int, dask_worker=None) -> bool:
    """On a worker (``client.run``): does an actor there (the buffer) hold a batch
    ``taken`` for trainer step ``step``?"""
    from rollart.buffer import SampleBuffer

    return any(step in a.taken for a in dask_worker.state.actors.values()
               if isinstance(a, SampleBuffer))


def should_stop(steps_done: int, steps: int, replaced: int, needed: int, killing: bool,
                waited: float, wait: float) -> bool:
    """Stop the run once it has ``steps`` steps and each kill has its replacements
    (``replaced``: the metrics' ``recovery/actors_replaced``; ``needed``: the actors
    the kills took, ``replacements_needed``), or ``wait`` s after ``steps`` without them
    (then the RESULT shows the missing recovery).

    >>> should_stop(5, 5, 0, 1, False, 3.0, 120.0), should_stop(6, 5, 1, 1, False, 4.0, 120.0)
    (False, True)
    """
    if steps_done < steps or killing:
        return False
    return replaced >= needed or waited >= wait


def replacements_needed(kills: list[dict]) -> int:
    """Actors the ``kills`` took (``ROLES``), each killed tag counted once: a TRAIN
    worker takes the trainer and the buffer, so counting one replacement per kill
    stopped a run with a TRAIN kill and an env kill as soon as the trainer and buffer
    were back, before the env worker was; and two kills of one worker (``--processes``:
    the random kill after the mid-step one) may be recovered from at once, so counting
    each kill's actors waited the whole ``--recovery-wait`` for replacements that never
    came (157 steps instead of 9).

    >>> replacements_needed([{"tag": "TRAIN"}, {"tag": "CPU_ENV"}, {"tag": "TRAIN"}])
    3
    """
    return sum(len(ROLES.get(tag, {tag})) for tag in {k["tag"] for k in kills})


def stopper(run_dir: Path, steps: int, kills: list, killer_threads, wait: float,
            n_kills: int = 1) -> None:
    """Ask the run to stop (``rollart.observe.metrics.request_stop``) when ``should_stop``
    (the killers done: ``n_kills`` kills made, or their threads ended)."""
    from rollart.observe.metrics import request_stop

    since = None
    while True:
        rows = _rows(run_dir)
        if len(rows) >= steps and since is None:
            since = time.monotonic()
        waited = time.monotonic() - since if since is not None else 0.0
        replaced = rows[-1].get("recovery/actors_replaced", 0) if rows else 0
        killing = len(kills) < n_kills and any(k.is_alive() for k in killer_threads)
        if should_stop(len(rows), steps, replaced, replacements_needed(kills), killing,
                       waited, wait):
            request_stop(run_dir.name)
            return
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 steps, in-process workers")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env-fail", type=float, default=0.2)
    ap.add_argument("--processes", action="store_true",
                    help="worker processes: SIGKILL and Nanny restart (slow to start)")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--restart-after", type=float, default=1.0,
                    help="in-process workers: seconds until the killed worker is back")
    ap.add_argument("--trainer-kill-step", type=int, default=None,
                    help="kill the trainer's worker during the step after this one "
                         "(default: steps // 2; 0: no such kill)")
    ap.add_argument("--recovery-wait", type=float, default=120.0,
                    help="after --steps, go on at most this long until every kill has "
                         "been recovered from")
    add_arguments(ap)
    args = ap.parse_args()
    run = Run("chaos", args)
    steps = args.steps or (8 if args.quick else 30)

    from distributed import Client

    from rollart import train
    from rollart.buffer.ledger import STATES
    from rollart.app.cli import quiet
    from rollart.types import CPU_ENV, H20, H800, TRAIN
    from rollart.runtime.waits import close_bounded

    quiet()
    import dask

    # a crowded machine can starve an in-process cluster's shared event loop for tens of
    # seconds: be patient with comms, so only the injected kill removes a worker
    dask.config.set({"distributed.comm.timeouts.connect": "300s",
                     "distributed.comm.timeouts.tcp": "300s"})
    rng = random.Random(args.seed)
    tag = rng.choice([CPU_ENV, H800, H20, TRAIN])
    at_step = rng.randint(2, max(2, steps - 3))
    trainer_step = steps // 2 if args.trainer_kill_step is None else args.trainer_kill_step
    if trainer_step and trainer_step == at_step:  # one kill at a time
        at_step = trainer_step + 1 if trainer_step + 1 < steps else max(trainer_step - 1, 1)
    base = Path(args.run_dir or tempfile.mkdtemp(prefix="rollart-chaos-"))
    run_dir, env_log = base / "run", base / "envs"
    env_log.mkdir(parents=True, exist_ok=True)
    kills: list = []
    t0 = time.time()
    restart = None if args.processes else args.restart_after
    cluster = chaos_resources(args.processes).make_cluster()
    c = Client(cluster)
    try:
        t = threading.Thread(target=killer, daemon=True, args=(
            cluster, c, run_dir, at_step, tag, kills, restart))
        t.start()
        if trainer_step:
            t2 = threading.Thread(target=trainer_killer, daemon=True, args=(
                cluster, c, run_dir, trainer_step, kills, restart))
            t2.start()
        threading.Thread(target=stopper, daemon=True, args=(
            run_dir, steps, kills, (t, t2) if trainer_step else (t,),
            args.recovery_wait, 1 + bool(trainer_step))).start()
        # the step budget is a ceiling: stopper ends the run (see the module docstring)
        graph = chaos_graph(steps + 10_000, args.seed, args.env_fail, env_log=str(env_log))
        result = train(graph, client=c, run_dir=run_dir, progress=False, eval_seeds=0)
    finally:  # bounded: a close that hangs says what was still pending
        close_bounded(c, cluster)
    wall = time.time() - t0
    final = result.final_counts
    gap = final["launched"] - sum(final[s] for s in STATES)
    counted = audit(result.run_dir, result.metrics, read_env_log(env_log))
    recoveries = []
    for k in kills:
        who = k.get("worker", k["address"])
        roles = ROLES.get(k["tag"], set())
        after = [e for e in result.recovery if e["recovered_at"] >= k["at"]
                 and (e["role"] in roles or not roles)]
        if after:
            recoveries.append(after[0]["recovered_at"] - k["at"])
            print(f"recovered from {who}: {after[0]['role']} actor re-created on "
                  f"{after[0]['replacement']} {recoveries[-1]:.1f}s after the kill"
                  + (f" ({after[0]['restored_from']})" if "restored_from" in after[0] else ""))
        else:
            recoveries.append(float("inf"))
            print(f"no recovery event after killing {who}")
    done = final["launched"] - final["in_flight"]
    failed_frac = final["failed"] / max(done, 1)
    print(f"{len(result.metrics)} steps in {wall:.0f}s; ledger after shutdown: {final}")
    print(f"audit: {counted}")
    mid = [k["mid_step"] for k in kills if "mid_step" in k]
    run.result({
        "lost": counted["lost"], "duplicated": counted["duplicated"],
        "lost_trained": counted["lost_trained"],
        "trained_unreported": counted["trained_unreported"],
        "lost_completed": counted["lost_completed"], "left_buffered": counted["left_buffered"],
        "ledger_lost": final["in_flight"] + abs(gap),
        "max_recovery_s": round(max(recoveries), 2) if recoveries else 0.0,
        "steps": len(result.metrics), "failed_frac": round(failed_frac, 3),
        "restarted_groups": result.metrics[-1].get("recovery/groups_restarted", 0),
        "orphaned": final.get("orphaned", 0),
        "env_episodes": counted["env_episodes"],
        "trainer_mid_step": int(all(mid)) if mid else "none",
        "killed": next((k["tag"] for k in kills if "mid_step" not in k), "none")})


if __name__ == "__main__":
    main()
