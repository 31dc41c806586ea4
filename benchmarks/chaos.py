"""Chaos soak: train through env failures, hangs, stragglers and a killed worker.

One async run of N trainer steps on a tagged cluster (two env workers; no ``BUFFER``
tag, so the sample buffer goes on the trainer's worker, its first fallback:
``rollart.stages.buffer_worker``) where

* about 20% of trajectories hit an injected env failure (per-step probability derived
  from the task's turns), and 2% of steps hang (cut by ``env_step_timeout``);
* env steps straggle: Pareto-tailed latency whose slowest steps are 10× the fastest;
* one worker, picked at random among {an env worker, an inference worker, the
  trainer (with it the buffer, recovered from its durable journal)}, is killed at a
  random step (in-process: closed, then a fresh worker with the same spec starts after
  1 s; ``--processes``: SIGKILL, and its Nanny restarts it).

It prints the kills, the recoveries and one line

    RESULT lost=… duplicated=… max_recovery_s=… steps=… failed_frac=… restarted_groups=…

``lost``: launched trajectories with no final state once the run has shut down (the
ledger's ``in_flight``), plus any gap in the ledger's sum. ``orphaned``: trajectories
that were in flight on a killed worker (counted ``failed``; their groups restart). ``duplicated``: trajectories
trained more than once (from the Parquet samples). ``max_recovery_s``: kill → the
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
import tempfile
import threading
import time
from pathlib import Path


def chaos_resources(processes: bool):
    from rollart.resources import Pool, Resources
    from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN

    return Resources(pools=(
        Pool("infer-h800", tag=H800, kind="compute_gpu"),
        Pool("infer-h20", tag=H20, kind="bandwidth_gpu"),
        Pool("env", tag=CPU_ENV, kind="cpu_env", workers=2),
        Pool("reward", tag=REWARD, kind="reward", threads=2),
        Pool("trainer", tag=TRAIN, kind="trainer"),
    ), processes=processes, dashboard_address=":0", source="benchmarks/chaos.py")


def chaos_graph(steps: int, seed: int, env_fail: float, turns: float = 3.0):
    from rollart import GRPO, Graph, Policy, Rollout
    from rollart.env.faults import Faults, Latency, with_faults

    per_step = 1 - (1 - env_fail) ** (1 / turns)
    faults = Faults(step=Latency("pareto", seconds=0.003, shape=1.2, cap=0.03),
                    fail_prob=per_step, hang_prob=0.02, hang_seconds=60.0, seed=seed)
    tasks = tuple(with_faults(t, faults) for t in ("gridnav", "guess"))
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
    from rollart.recovery import lose_worker
    from rollart.resources import workers_with

    while len(_rows(run_dir)) < at_step:
        time.sleep(0.05)
    addr = workers_with(client, tag)[-1]
    t = time.time()
    kills.append({"tag": tag, "address": addr, "at": t, "after_step": at_step})
    kills[-1]["worker"] = name = lose_worker(cluster, client, addr,
                                             restart_after=restart_after)
    print(f"killed {name} ({tag}, {addr}) after step {at_step}", flush=True)


def should_stop(steps_done: int, steps: int, replaced: int, kills: int, killing: bool,
                waited: float, wait: float) -> bool:
    """Stop the run once it has ``steps`` steps and each kill has its replacement
    (``replaced``: the metrics' ``recovery/actors_replaced``), or ``wait`` s after
    ``steps`` without one (then the RESULT shows the missing recovery).

    >>> should_stop(5, 5, 0, 1, False, 3.0, 120.0), should_stop(6, 5, 1, 1, False, 4.0, 120.0)
    (False, True)
    """
    if steps_done < steps or killing:
        return False
    return replaced >= kills or waited >= wait


def stopper(run_dir: Path, steps: int, kills: list, killer_thread, wait: float) -> None:
    """Ask the run to stop (``rollart.metrics.request_stop``) when ``should_stop``."""
    from rollart.metrics import request_stop

    since = None
    while True:
        rows = _rows(run_dir)
        if len(rows) >= steps and since is None:
            since = time.monotonic()
        waited = time.monotonic() - since if since is not None else 0.0
        replaced = rows[-1].get("recovery/actors_replaced", 0) if rows else 0
        if should_stop(len(rows), steps, replaced, len(kills), killer_thread.is_alive(),
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
    ap.add_argument("--recovery-wait", type=float, default=120.0,
                    help="after --steps, go on at most this long until every kill has "
                         "been recovered from")
    args = ap.parse_args()
    steps = args.steps or (8 if args.quick else 30)

    import pyarrow.compute as pc
    from distributed import Client

    from rollart import train
    from rollart.buffer import read_samples
    from rollart.buffer.ledger import STATES
    from rollart.cli import quiet
    from rollart.types import CPU_ENV, H20, H800, TRAIN

    quiet()
    import dask

    # a crowded machine can starve an in-process cluster's shared event loop for tens of
    # seconds: be patient with comms, so only the injected kill removes a worker
    dask.config.set({"distributed.comm.timeouts.connect": "300s",
                     "distributed.comm.timeouts.tcp": "300s"})
    rng = random.Random(args.seed)
    tag = rng.choice([CPU_ENV, H800, H20, TRAIN])
    at_step = rng.randint(2, max(2, steps - 3))
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rollart-chaos-")) / "run"
    kills: list = []
    t0 = time.time()
    with chaos_resources(args.processes).make_cluster() as cluster, Client(cluster) as c:
        t = threading.Thread(target=killer, daemon=True, args=(
            cluster, c, run_dir, at_step, tag, kills,
            None if args.processes else args.restart_after))
        t.start()
        threading.Thread(target=stopper, daemon=True,
                         args=(run_dir, steps, kills, t, args.recovery_wait)).start()
        # the step budget is a ceiling: stopper ends the run (see the module docstring)
        result = train(chaos_graph(steps + 10_000, args.seed, args.env_fail), client=c,
                       run_dir=run_dir, progress=False, eval_seeds=0)
    wall = time.time() - t0
    final = result.final_counts
    gap = final["launched"] - sum(final[s] for s in STATES)
    lost = final["in_flight"] + abs(gap)
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))["traj_id"].to_pylist()
    duplicated = len(trained) - len(set(trained))
    recoveries = []
    for k in kills:
        who = k.get("worker", k["address"])
        after = [e for e in result.recovery if e["recovered_at"] >= k["at"]]
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
    print("RESULT " + " ".join(f"{k}={v}" for k, v in {
        "lost": lost, "duplicated": duplicated,
        "max_recovery_s": round(max(recoveries), 2) if recoveries else 0.0,
        "steps": len(result.metrics), "failed_frac": round(failed_frac, 3),
        "restarted_groups": result.metrics[-1].get("recovery/groups_restarted", 0),
        "orphaned": final.get("orphaned", 0),
        "killed": kills[0]["tag"] if kills else "none"}.items()))


if __name__ == "__main__":
    main()
