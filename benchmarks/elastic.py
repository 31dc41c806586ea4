"""A pool resized mid-run (``Run.scale``, or workers started by hand): throughput before,
during and after a 1 -> N scale, how soon a worker that joins does work, what a
scale-down stalls, and what was lost or duplicated.

One run of ``--steps`` trainer steps (30) on a cluster rollart makes (``resources/local.py``'s
layout, worker processes; ``--quick``: in-process), two recorded tasks (gridnav, guess:
every env wrapped by ``benchmarks/chaos.py``'s ``RecordedEnv``), no faults. Before step
``--up-at`` the pool ``--pool`` (default ``infer-h20``, the decode pool; ``env``: the env
pool) is asked to grow 1 -> ``--to`` (2); with ``--hand`` it grows instead by ``TO - 1``
``dask worker --resources TAG=1`` processes started by hand against the run's scheduler.
Once every new worker has done work and ``--during`` more steps ran (and not before step
``--down-at``), the pool is asked to shrink back to 1 (by its tag with ``--hand``). A
thread polls every worker's actor every 0.1 s: requests an inference worker served,
groups an env manager took, a rank of the trainer gang held (``--pool trainer``: the
trainer's pool 1 -> TO ranks and back, ``rollart.control.resize``).
``tests/faults/test_scale_matrix.py`` (the kill matrix's scale cells) runs it at a small
size for the decode pool 1 -> 2 -> 1, the env pool 1 -> 3 -> 1, a hand-started decode
worker, and the trainer gang 1 -> 2 -> 1.

Figures (``RESULT``):

- ``tps_before`` / ``tps_during`` / ``tps_after``: trajectories trained per second of
  trainer-step wall time over the steps before the grow, between the first join and the
  shrink, and after the shrink (from ``metrics.jsonl``'s ``traj/trained`` and ``time``);
  ``tps_during_vs_before`` their ratio. On 2 cores a second inference process shares
  the same cores: this measures what the resize costs or gains here, not on a GPU
  cluster.
- ``join_to_first_request_s``: from the grow's request being carried out (its
  ``recovery.json`` row; with ``--hand``, the processes' start) to a new worker's first
  work; ``join_steps``: that time over the median step time (goal ≤ 1).
- ``scale_down_stall_s``: the step during which the shrink was carried out, less the
  median step; ``scale_down_stall_steps``: over the median step (goal ≤ 1).
- ``lost`` / ``duplicated``: ``benchmarks/_chaos_audit.audit`` (the envs' own record, the
  Parquet rows, the trainer's batch digests; not the ledger). Both must be 0.

The run fails (exit status 1, saying why) when the pool was not resized as asked, a new
worker did no work, or a hand-started worker did not exit cleanly once retired.

    python benchmarks/elastic.py --quick            # 12 steps, in-process, ~1 min
    flock /tmp/rollart-bench.lock python benchmarks/elastic.py
    python benchmarks/elastic.py --pool env --to 3   # the env pool 1 -> 3 -> 1
    flock /tmp/rollart-bench.lock python benchmarks/elastic.py --model smollm2-135m-instruct

``--model smollm2-135m-instruct`` makes the same run on the real model with
``graphs/real.py:lora``'s tasks and settings (14 steps of about 30 s on 2 cores, ~10 min):
there a worker's join is measured against a real trainer step, not a toy's 0.35 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Run, add_arguments, fill  # noqa: E402
from _chaos_audit import audit, read_env_log  # noqa: E402
from chaos import RecordedEnvFactory  # noqa: E402

from rollart.types import CPU_ENV, TRAIN  # noqa: E402


#: the run's sizes (steps; the grow before about ``up_at``, the shrink before about
#: ``down_at`` and at least ``during`` steps after the first join): the toy's, ``--quick``'s
#: and a real model's (its step is about 100 toy steps)
FULL = {"steps": 30, "up_at": 6, "down_at": 16, "during": 6}
QUICK = {"steps": 12, "up_at": 4, "down_at": 8, "during": 2}
REAL = {"steps": 14, "up_at": 3, "down_at": 8, "during": 2}

#: ``--model``'s graph: the real model's LoRA run (``graphs/real.py``), its tasks recorded
REAL_GRAPH = str(Path(__file__).resolve().parents[1] / "graphs" / "real.py") + ":lora"


def elastic_graph(steps: int, seed: int, env_log: str, model: str | None = None):
    from rollart import GRPO, Graph, Policy
    from rollart.config.graph import load_graph
    from rollart.env.tasks import get_task

    def recorded(tasks):
        return tuple(replace(t, env_factory=RecordedEnvFactory(t.env_factory, t.name,
                                                                env_log)) for t in tasks)
    if model is not None:  # a real model: graphs/real.py's tasks and settings, as fixed
        g = load_graph(REAL_GRAPH)[0]
        return replace(g, name="elastic-real", tasks=recorded(g.tasks), steps=steps,
                       seed=seed)
    return Graph(name="elastic", tasks=recorded((get_task("gridnav"), get_task("guess"))),
                 steps=steps, seed=seed, policy=Policy(warmup_steps=0),
                 algo=GRPO(group_size=2, groups_per_step=4))


def _served(client, pool_tag: str) -> dict[str, int]:
    """Worker address -> the work its actor of ``pool_tag``'s role did so far: requests an
    inference worker served, groups an env manager took; a TRAIN worker counts 1 once it
    holds a rank of the trainer gang (a gang forms at the step that uses it)."""
    cls, count = {CPU_ENV: ("EnvManager", lambda a: a.counts["groups_taken"]),
                  TRAIN: ("GangRank", lambda a: 1)}.get(
        pool_tag, ("InferenceWorker", lambda a: a.engine.requests))

    def probe(dask_worker):
        return [count(a) for a in dask_worker.state.actors.values()
                if type(a).__name__ == cls]
    return {a: sum(v) for a, v in client.run(probe).items() if v}


def _start_by_hand(address: str, tag: str, k: int, log_dir: Path) -> list:
    """``k`` ``dask worker --resources TAG=1`` processes joining ``address``, as a user
    starts them on another host (no nanny: a retired one exits)."""
    procs = []
    for i in range(k):
        log = open(log_dir / f"hand-{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--resources",
             f"{tag}=1", "--nthreads", "1", "--no-nanny", "--name", f"hand-{tag}-{i}"],
            stdout=log, stderr=subprocess.STDOUT))
    return procs


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _rate(rows: list[dict], first: int, last: int) -> float:
    """Trajectories trained per second over steps ``first``..``last``."""
    span = [r for r in rows if first <= r["step"] <= last]
    prev = next((r for r in rows if r["step"] == first - 1), None)
    t0 = prev["time"] if prev else span[0]["time"] - (span[1]["time"] - span[0]["time"])
    done = span[-1]["traj/trained"] - (prev["traj/trained"] if prev else 0)
    return done / max(span[-1]["time"] - t0, 1e-9)


def measure(args) -> dict:
    from distributed import Client

    from rollart.app.api import start_run, wait_for_step
    from rollart.runtime.resources import load_resources

    res = replace(load_resources(), dashboard_address=":0")
    if args.quick and not args.hand and args.pool != "trainer":  # a hand-started worker
        res = replace(res, processes=False)  # needs a TCP scheduler, a gang processes
    tag = next(p.tag for p in res.pools if p.name == args.pool)
    hand: list = []
    with tempfile.TemporaryDirectory(prefix="rollart-elastic-") as tmp:
        run_dir, env_log = Path(tmp) / "run", Path(tmp) / "envs"
        env_log.mkdir()
        graph = elastic_graph(args.steps, args.seed, str(env_log), args.model)
        with res.make_cluster() as cluster, Client(cluster) as client:
            run = start_run(client, graph, run_dir=run_dir, model=args.model)
            seen: dict[str, tuple] = {}  # address -> (time, steps done) of its first request
            stop = threading.Event()

            def poll():
                while not stop.is_set():
                    try:
                        for addr, n in _served(client, tag).items():
                            if n and addr not in seen:
                                seen[addr] = (time.time(), len(_rows(run_dir)))
                    except Exception:  # noqa: BLE001 - a worker leaving mid-probe
                        pass
                    time.sleep(0.1)
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            wait_for_step(run, args.up_at - 2, 600)
            asked, asked_step = time.time(), len(_rows(run_dir))
            if args.hand:  # by hand: workers of the pool's tag join the scheduler
                hand = _start_by_hand(cluster.scheduler_address, tag, args.to - 1,
                                      Path(tmp))
            else:
                run.scale(args.pool, args.to)
            # the shrink once the new worker has served and the larger pool has run a
            # few steps (a worker process takes seconds to start: a shrink before it
            # served would measure nothing)
            deadline = time.monotonic() + 300
            while (len([t for t, _ in seen.values() if t > asked]) < args.to - 1
                   and not run.done() and time.monotonic() < deadline):
                time.sleep(0.1)
            joined_at = len(_rows(run_dir))
            wait_for_step(run, max(args.down_at - 2, joined_at + args.during), 600)
            run.scale(tag if args.hand else args.pool, 1)  # by tag: the hand-started too
            try:
                result = run.wait(timeout=1800)
            finally:
                stop.set()
                poller.join()
                for proc in hand:  # retired, they exit; one that did not is a failure
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            served = len([t for t in seen.values() if t[0] > asked])
        rows = result.metrics
        events = [e for e in result.recovery if e.get("kind") == "scale"]
        moves = [(e["from"], e["to"]) for e in events]
        if moves != ([] if args.hand else [(1, args.to)]) + [(args.to, 1)]:
            raise SystemExit(f"elastic.py: the pool was not resized 1 -> {args.to} -> 1 as "
                             f"asked (events {events}); the console says why (a run that "
                             "ended first needs more --steps)")
        if served != args.to - 1:
            raise SystemExit(f"elastic.py: {served} of the {args.to - 1} workers that joined "
                             f"{args.pool} did any work")
        if any(p.returncode != 0 for p in hand):
            tails = "\n".join(f"{log.name}:\n" + log.read_text()[-1500:]
                              for log in sorted(Path(tmp).glob("hand-*.log")))
            raise SystemExit("elastic.py: a hand-started worker did not exit cleanly once "
                             f"retired (exit statuses {[p.returncode for p in hand]}):\n"
                             + tails)
        grow = {"at": asked, "step": asked_step + 1} if args.hand \
            else events[0]
        shrink = events[-1]
        first = min((t for t in seen.values() if t[0] > grow["at"]), default=None)
        durations = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
        median = statistics.median(durations)
        join = first[0] - grow["at"] if first else float("nan")
        joined_step = first[1] + 1 if first else grow["step"]  # the step it first served in
        stall_step = shrink["step"]  # the step during which the shrink ran (before it)
        stall = next(b["time"] - a["time"] for a, b in zip(rows, rows[1:])
                     if b["step"] == stall_step) - median
        checked = audit(run_dir, rows, read_env_log(env_log))
    return {
        "tps_before": _rate(rows, 2, grow["step"] - 1),
        "tps_during": _rate(rows, joined_step + 1, shrink["step"] - 1),
        "tps_after": _rate(rows, shrink["step"] + 1, rows[-1]["step"]),
        "tps_during_vs_before": _rate(rows, joined_step + 1, shrink["step"] - 1)
        / _rate(rows, 2, grow["step"] - 1),
        "join_to_first_request_s": join, "join_steps": join / median,
        "scale_down_stall_s": stall, "scale_down_stall_steps": stall / median,
        "step_s_median": median, "lost": checked["lost"],
        "duplicated": checked["duplicated"], "steps": len(rows),
        "grow_step": grow["step"], "shrink_step": shrink["step"], "joined_step": joined_step,
        "groups_left_by_shrink": shrink.get("groups_left", 0), "pool": args.pool,
        "to": args.to, "hand": int(args.hand), "model": args.model or "toy",
        "processes": int(not args.quick or args.hand),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="12 steps, in-process workers (with "
                   "--hand: 40 steps, worker processes)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (30)")
    p.add_argument("--up-at", type=int, default=None, help="the grow is carried out "
                   "before about this step (6)")
    p.add_argument("--down-at", type=int, default=None, help="the shrink, likewise (16)")
    p.add_argument("--during", type=int, default=None, help="steps run with the larger "
                   "pool after the new worker first served, at least (6)")
    p.add_argument("--pool", default="infer-h20", help="a Pool.name of resources/local.py: "
                   "infer-h20, infer-h800, env or trainer (the trainer gang: 1 -> TO ranks "
                   "and back, worker processes)")
    p.add_argument("--to", type=int, default=2, help="grow the pool 1 -> TO, then back to 1")
    p.add_argument("--hand", action="store_true", help="grow by starting TO-1 `dask worker "
                   "--resources TAG=1` processes by hand (the shrink goes through "
                   "Run.scale by tag); worker processes even with --quick")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default=None, help="a real model (smollm2-135m-instruct): "
                   "graphs/real.py:lora's tasks and settings on it, --steps 14 --up-at 3 "
                   "--down-at 8 --during 2 unless given (about 30 s a step on 2 cores)")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.quick:  # a worker process takes seconds (about 15 steps here) to join
        fill(args, {**QUICK, "steps": 40 if args.hand else QUICK["steps"]})
    fill(args, REAL if args.model else FULL)
    run = Run("elastic", args, argv)
    figures = measure(args)
    run.result(figures)
    return figures


if __name__ == "__main__":
    main()
