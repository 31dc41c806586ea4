"""An inference pool resized mid-run (``Run.scale``): throughput before, during and after
a 1 -> 2 scale, how soon a worker that joins serves, what a scale-down stalls, and what
was lost or duplicated.

One run of ``--steps`` trainer steps (30) on a cluster rollart makes (``resources/local.py``'s
layout, worker processes; ``--quick``: in-process), two recorded tasks (gridnav, guess:
every env wrapped by ``benchmarks/chaos.py``'s ``RecordedEnv``), no faults. Before step
``--up-at`` the pool ``--pool`` (default ``infer-h20``, the decode pool) is asked to grow
1 -> 2; once its new worker has served and ``--during`` more steps ran (and not before
step ``--down-at``), to shrink back to 1. A thread polls every inference
worker's request count every 0.1 s.

Figures (``RESULT``):

- ``traj_s_before`` / ``traj_s_during`` / ``traj_s_after``: trajectories trained per second
  of trainer-step wall time over the steps before the grow, between the grow's join and the
  shrink, and after the shrink (from ``metrics.jsonl``'s ``traj/trained`` and ``time``);
  ``during_vs_before`` their ratio. On 2 cores a second inference process shares the same
  cores: this measures what the resize costs or gains here, not on a GPU cluster.
- ``join_to_first_request_s``: from the grow's request being carried out (its
  ``recovery.json`` row) to the new worker's first served request; ``join_in_steps``: that
  time over the median step time (goal ≤ 1).
- ``shrink_stall_s``: the step during which the shrink was carried out, less the median
  step; ``shrink_stall_steps``: over the median step (goal ≤ 1).
- ``lost`` / ``duplicated``: ``benchmarks/_chaos_audit.audit`` (the envs' own record, the
  Parquet rows, the trainer's batch digests; not the ledger). Both must be 0.

    python benchmarks/elastic.py --quick            # 12 steps, in-process, ~1 min
    flock /tmp/rollart-bench.lock python benchmarks/elastic.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Run, add_arguments  # noqa: E402
from _chaos_audit import audit, read_env_log  # noqa: E402
from chaos import RecordedEnvFactory  # noqa: E402


def elastic_graph(steps: int, seed: int, env_log: str):
    from rollart import GRPO, Graph, Policy
    from rollart.env.tasks import get_task

    tasks = tuple(replace(t, env_factory=RecordedEnvFactory(t.env_factory, t.name, env_log))
                  for t in (get_task("gridnav"), get_task("guess")))
    return Graph(name="elastic", tasks=tasks, steps=steps, seed=seed,
                 policy=Policy(warmup_steps=0),
                 algo=GRPO(group_size=2, groups_per_step=4))


def _requests(client) -> dict[str, int]:
    """Worker address -> requests its inference worker served."""
    def probe(dask_worker):
        return [a.engine.requests for a in dask_worker.state.actors.values()
                if type(a).__name__ == "InferenceWorker"]
    return {a: sum(v) for a, v in client.run(probe).items() if v}


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
    if args.quick:
        res = replace(res, processes=False)
    with tempfile.TemporaryDirectory(prefix="rollart-elastic-") as tmp:
        run_dir, env_log = Path(tmp) / "run", Path(tmp) / "envs"
        env_log.mkdir()
        graph = elastic_graph(args.steps, args.seed, str(env_log))
        with res.make_cluster() as cluster, Client(cluster) as client:
            run = start_run(client, graph, run_dir=run_dir)
            seen: dict[str, tuple] = {}  # address -> (time, steps done) of its first request
            stop = threading.Event()

            def poll():
                while not stop.is_set():
                    try:
                        for addr, n in _requests(client).items():
                            if n and addr not in seen:
                                seen[addr] = (time.time(), len(_rows(run_dir)))
                    except Exception:  # noqa: BLE001 - a worker leaving mid-probe
                        pass
                    time.sleep(0.1)
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            wait_for_step(run, args.up_at - 2, 600)
            asked = time.time()
            run.scale(args.pool, 2)
            # the shrink once the new worker has served and the larger pool has run a
            # few steps (a worker process takes seconds to start: a shrink before it
            # served would measure nothing)
            while not any(t > asked for t, _ in seen.values()) and not run.done():
                time.sleep(0.1)
            joined_at = len(_rows(run_dir))
            wait_for_step(run, max(args.down_at - 2, joined_at + args.during), 600)
            run.scale(args.pool, 1)
            result = run.wait(timeout=1800)
            stop.set()
            poller.join()
        rows = result.metrics
        events = [e for e in result.recovery if e.get("kind") == "scale"]
        if [(e["from"], e["to"]) for e in events] != [(1, 2), (2, 1)]:
            raise SystemExit(f"elastic.py: the pool was not resized 1 -> 2 -> 1 as asked "
                             f"(events {events}); the console says why")
        grow, shrink = events
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
        "traj_s_before": _rate(rows, 2, grow["step"] - 1),
        "traj_s_during": _rate(rows, joined_step + 1, shrink["step"] - 1),
        "traj_s_after": _rate(rows, shrink["step"] + 1, rows[-1]["step"]),
        "during_vs_before": _rate(rows, joined_step + 1, shrink["step"] - 1)
        / _rate(rows, 2, grow["step"] - 1),
        "join_to_first_request_s": join, "join_in_steps": join / median,
        "shrink_stall_s": stall, "shrink_stall_steps": stall / median,
        "step_s_median": median, "lost": checked["lost"],
        "duplicated": checked["duplicated"], "steps": len(rows),
        "grow_step": grow["step"], "shrink_step": shrink["step"], "joined_step": joined_step,
        "groups_left_by_shrink": shrink["groups_left"], "pool": args.pool,
        "processes": int(not args.quick),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10 steps, in-process workers")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--up-at", type=int, default=6, help="the grow is carried out "
                   "before about this step")
    p.add_argument("--down-at", type=int, default=16, help="the shrink, likewise")
    p.add_argument("--during", type=int, default=6, help="steps run with the larger pool "
                   "after the new worker first served, at least")
    p.add_argument("--pool", default="infer-h20")
    p.add_argument("--seed", type=int, default=1)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.up_at, args.down_at, args.during = 12, 4, 8, 2
    run = Run("elastic", args, argv)
    figures = measure(args)
    run.result(figures)
    return figures


if __name__ == "__main__":
    main()
