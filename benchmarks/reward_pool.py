"""Reward pool benchmark: an always-on reward worker vs the serverless (scale-to-zero)
pool, with the same batching, in-process workers and worker processes.

Runs the same training run (the default multi-task graph, no warm-up, its reward an LLM
judge: ``rollart.reward.LLMJudge`` on a tiny judge model of its own) once per side and
per worker kind. Both sides send the judge through the same dispatcher
(``rollart.reward.dispatch``: ``@serverless``, backend ``pool``, the same ``max_batch``
and ``batch_wait``, by default ``ServerlessConfig``'s), to one worker of one slot:

* **dedicated**: that worker is started before the run and never retired (its pool's
  idle time-out is infinite), so it is held for the whole run, as a dedicated reward
  GPU is;
* **serverless**: the elastic pool (``rollart.reward.elastic.ElasticPool``, at most
  one worker) starts a worker when requests wait and retires it after
  ``ServerlessConfig``'s default idle time-out.

Each pair runs on an in-process cluster (``Worker`` threads: a cold start is a new
``Worker`` in this process, the judge model already loaded) and on a cluster of worker
processes (``Nanny``: a cold start is a new process that imports torch and loads the
judge model — real cold starts). The scheduler's ``ServerlessMonitor`` measures both
sides on the scheduler's clock over the run's window: worker-seconds held (from the
worker's registration; on the serverless side each cold start's start-up time — from
the pool asking for it to its registration — is added), busy seconds (task compute),
busy fraction = busy ÷ worker-seconds; the metrics rows give the step time.

RESULT keys (``<kind>`` is ``threads`` or ``procs``):

* ``busy_dedicated_<kind>``, ``busy_serverless_<kind>``: busy fraction of the reward
  worker(s), cold start-up counted as held on the serverless side;
* ``worker_s_dedicated_<kind>``, ``worker_s_serverless_<kind>``: worker-seconds held,
  and ``worker_s_ratio_<kind>`` (serverless ÷ dedicated, < 1: serverless holds less);
* ``step_time_ratio_<kind>`` (serverless ÷ dedicated mean step time, > 1: slower);
* ``cold_starts_<kind>``, ``cold_start_s_<kind>`` (mean start-up seconds);
  ``cold_starts_dedicated_<kind>`` (0: the dedicated worker was up before the run);
  ``run_s_dedicated_<kind>``, ``run_s_serverless_<kind>`` (each run's window);
* ``idle_timeout``, ``max_batch``, ``batch_wait``, ``steps``.

    python benchmarks/reward_pool.py --quick
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py

from _results import Run, add_arguments  # noqa: E402

DEDICATED = "DEDICATED"  # resource tag of the always-on reward worker


def judge_model(path: Path, tasks, hidden: int, layers: int) -> str:
    """The judge: a tiny causal LM over the tasks' words (its own weights)."""
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model

    return build_tiny_model(str(path), task_corpus(tasks), hidden_size=hidden,
                            num_layers=layers, seed=1)


def start_dedicated(client, cluster) -> str:
    """Start the always-on worker before the run, named as the ``DEDICATED`` pool's
    first worker, so that pool (max one worker) finds itself full and never scales."""
    from distributed import Worker

    from rollart.reward.elastic import ElasticPool
    from rollart.runtime.resources import worker_nanny

    pool = ElasticPool(cluster, DEDICATED)  # its naming and its reading of the cluster
    processes, name = pool.processes, pool.prefix + "-0"
    options = {"nthreads": 1, "resources": {DEDICATED: 1}, "name": name,
               "memory_limit": 0}
    if processes:
        options["env"] = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cluster.worker_spec[name] = {"cls": worker_nanny() if processes else Worker,
                                 "options": options}
    cluster.sync(cluster._correct_state)
    deadline = time.time() + 120
    while not any(w.get("resources", {}).get(DEDICATED)
                  for w in client.scheduler_info()["workers"].values()):
        if time.time() > deadline:
            raise RuntimeError("the dedicated reward worker did not start in 120 s")
        time.sleep(0.1)
    return name


def run_once(client, graph, run_dir: Path, tag: str) -> dict:
    """Train ``graph``; the reward pool ``tag``'s figures over the run, and step time."""
    import rollart
    from rollart.reward.elastic import pool_stats

    t0 = time.time()
    result = rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                           eval_seeds=0)
    t1 = time.time()
    time.sleep(0.5)  # let the last reward tasks' transitions reach the monitor
    pool = pool_stats(client, tag, since=t0, until=t1)
    rows = result.metrics
    steps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    last = rows[-1]
    cold, cold_s = last.get("reward/pool/cold_starts", 0), last.get(
        "reward/pool/cold_start_s", 0.0)
    held = pool["slot_seconds"] + cold * cold_s  # one slot per worker on both sides
    return {
        "busy": pool["busy_seconds"] / held if held > 0 else 0.0,
        "busy_registered": pool["busy_fraction"],
        "worker_s": held,
        "busy_s": pool["busy_seconds"],
        "step_s": sum(steps) / max(len(steps), 1),
        "run_s": t1 - t0,
        "reward_tasks": pool["done"] + pool["erred"],
        "reward_p50_s": pool["latency_p50"],
        "cold_starts": cold,
        "cold_start_s": cold_s,
        "max_queue": pool["max_queue"],
        "failed": last["traj/failed"],
        "trained": last["traj/trained"],
    }


def run_pair(processes: bool, base, policy: str, judge, steps: int, cfg: dict,
             idle_timeout: float) -> dict:
    """Dedicated, then serverless, on one cluster of ``processes`` or in-process workers."""
    from distributed import Client

    import rollart
    from rollart.reward import SERVERLESS, serverless
    from rollart.reward.elastic import install_monitor

    res = replace(rollart.load_resources(), processes=processes, dashboard_address=":0")
    sides = (("dedicated", serverless(judge, pool=DEDICATED, idle_timeout=math.inf,
                                      max_workers=1, **cfg), DEDICATED),
             ("serverless", serverless(judge, max_workers=1, idle_timeout=idle_timeout,
                                       **cfg), SERVERLESS))
    out = {}
    kind = "procs" if processes else "threads"
    with tempfile.TemporaryDirectory() as tmp, res.make_cluster() as cluster, \
            Client(cluster) as client:
        install_monitor(client)
        for name, reward, tag in sides:
            if name == "dedicated":
                start_dedicated(client, cluster)
            tasks = tuple(replace(t, reward_fn=reward) for t in base.tasks)
            graph = replace(base, tasks=tasks, steps=steps,
                            policy=replace(base.policy, model=policy, warmup_steps=0),
                            algo=replace(base.algo, groups_per_step=4))
            out[name] = run_once(client, graph, Path(tmp) / name, tag)
            print(f"{kind:7s} {name:10s} " + " ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in out[name].items()), flush=True)
    return out


def main(argv=None) -> dict:
    from rollart.reward.offload import ServerlessConfig

    default = ServerlessConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--kinds", default="threads,procs",
                   help="worker kinds to run: threads (in-process), procs (processes)")
    p.add_argument("--idle-timeout", type=float, default=default.idle_timeout,
                   help="serverless side: seconds idle before a worker is retired "
                        "(default: ServerlessConfig's)")
    p.add_argument("--max-batch", type=int, default=default.max_batch)
    p.add_argument("--batch-wait", type=float, default=default.batch_wait)
    p.add_argument("--judge-hidden", type=int, default=256)
    p.add_argument("--judge-layers", type=int, default=4)
    add_arguments(p)
    a = p.parse_args(argv)
    run = Run("reward_pool", a, argv)
    steps = a.steps or (6 if a.quick else 20)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - {"threads", "procs"}:
        raise SystemExit(f"--kinds takes threads and/or procs, got {a.kinds!r}")

    from rollart.app.cli import quiet

    quiet()
    import rollart
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model
    from rollart.reward import LLMJudge

    base, _ = rollart.load_graph("multitask")
    cfg = {"max_batch": a.max_batch, "batch_wait": a.batch_wait, "timeout": 60}
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_tiny_model(str(Path(tmp) / "policy"), task_corpus(base.tasks))
        judge = LLMJudge(judge_model(Path(tmp) / "judge", base.tasks, a.judge_hidden,
                                     a.judge_layers))
        for kind in kinds:
            out = run_pair(kind == "procs", base, policy, judge, steps, cfg, a.idle_timeout)
            d, s = out["dedicated"], out["serverless"]
            result.update({
                f"busy_dedicated_{kind}": d["busy"], f"busy_serverless_{kind}": s["busy"],
                f"worker_s_dedicated_{kind}": d["worker_s"],
                f"worker_s_serverless_{kind}": s["worker_s"],
                f"worker_s_ratio_{kind}": s["worker_s"] / d["worker_s"],
                f"step_time_ratio_{kind}": s["step_s"] / d["step_s"],
                f"cold_starts_{kind}": s["cold_starts"],
                f"cold_start_s_{kind}": s["cold_start_s"],
                f"cold_starts_dedicated_{kind}": d["cold_starts"],
                f"run_s_dedicated_{kind}": d["run_s"],
                f"run_s_serverless_{kind}": s["run_s"],
            })
    result.update(idle_timeout=a.idle_timeout, max_batch=a.max_batch,
                  batch_wait=a.batch_wait, steps=steps)
    run.result(result, fmt=lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))
    return result


if __name__ == "__main__":
    main()
