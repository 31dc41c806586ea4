"""Reward pool benchmark: a dedicated, always-on reward worker vs the serverless pool.

Runs the same training run twice on one cluster — the default multi-task graph whose
reward is an LLM judge (``rollart.reward.LLMJudge`` on a tiny judge model) — first
with the judge as a plain reward (one Dask task per trajectory on the fixed REWARD
worker, held for the whole run), then as ``@serverless`` on the elastic pool (batched,
scaled with demand, down to zero when idle). The scheduler's ``ServerlessMonitor``
measures both over the run: busy fraction (task compute ÷ slot-seconds held, a worker
counted from its registration to its removal), worker-seconds held, cold starts (and
their start-up time); the metrics rows give the rollout step time.
Prints per run, then one line

    RESULT serverless_busy=… dedicated_busy=… worker_seconds_ratio=… step_time_ratio=…

(ratios serverless ÷ dedicated). A script, not a test: side-by-side figures, one run.

    python benchmarks/reward_pool.py --quick
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def judge_model(path: Path, tasks, hidden: int, layers: int) -> str:
    """The judge: a tiny causal LM over the tasks' words (its own weights)."""
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model

    return build_tiny_model(str(path), task_corpus(tasks), hidden_size=hidden,
                            num_layers=layers, seed=1)


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
    return {
        "busy": pool["busy_fraction"],
        "worker_s": pool["worker_seconds"],
        "busy_s": pool["busy_seconds"],
        "step_s": sum(steps) / max(len(steps), 1),
        "run_s": t1 - t0,
        "reward_tasks": pool["done"] + pool["erred"],
        "reward_p50_s": pool["latency_p50"],
        "cold_starts": last.get("reward/pool/cold_starts", 0),
        "cold_start_s": last.get("reward/pool/cold_start_s", 0.0),
        "max_queue": pool["max_queue"],
        "failed": last["traj/failed"],
        "trained": last["traj/trained"],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--max-workers", type=int, default=1,
                   help="elastic pool maximum (1: the capacity of the dedicated worker)")
    p.add_argument("--idle-timeout", type=float, default=0.0,
                   help="seconds an elastic worker may idle before it is retired")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--batch-wait", type=float, default=0.02,
                   help="seconds a request may wait for others to share its batch")
    p.add_argument("--judge-hidden", type=int, default=256)
    p.add_argument("--judge-layers", type=int, default=4)
    p.add_argument("--processes", action="store_true",
                   help="worker processes (default: threads in one process)")
    a = p.parse_args(argv)
    steps = a.steps or (6 if a.quick else 20)

    from rollart.cli import quiet

    quiet()
    from distributed import Client

    import rollart
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model
    from rollart.reward import SERVERLESS, LLMJudge, serverless
    from rollart.reward.elastic import install_monitor
    from rollart.types import REWARD

    base, _ = rollart.load_graph("multitask")
    res = replace(rollart.load_resources(), processes=a.processes, dashboard_address=":0")
    out = {}
    with tempfile.TemporaryDirectory() as tmp, res.make_cluster() as cluster, \
            Client(cluster) as client:
        install_monitor(client)
        policy = build_tiny_model(str(Path(tmp) / "policy"), task_corpus(base.tasks))
        judge = LLMJudge(judge_model(Path(tmp) / "judge", base.tasks, a.judge_hidden,
                                     a.judge_layers))
        offloaded = serverless(judge, max_workers=a.max_workers, max_batch=a.max_batch,
                               batch_wait=a.batch_wait, idle_timeout=a.idle_timeout, timeout=60)
        for name, reward, tag in (("dedicated", judge, REWARD),
                                  ("serverless", offloaded, SERVERLESS)):
            tasks = tuple(replace(t, reward_fn=reward) for t in base.tasks)
            graph = replace(base, tasks=tasks, steps=steps,
                            policy=replace(base.policy, model=policy),
                            algo=replace(base.algo, groups_per_step=4))
            out[name] = run_once(client, graph, Path(tmp) / name, tag)
            print(f"{name:10s} " + " ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in out[name].items()), flush=True)
    d, s = out["dedicated"], out["serverless"]
    ratio = {
        "serverless_busy": s["busy"],
        "dedicated_busy": d["busy"],
        "worker_seconds_ratio": s["worker_s"] / d["worker_s"],
        "step_time_ratio": s["step_s"] / d["step_s"],
        # counting each cold start's start-up time as held too (the monitor counts a
        # worker from when it registers with the scheduler)
        "serverless_busy_incl_cold": s["busy_s"] / (s["worker_s"] + s["cold_starts"]
                                                    * s["cold_start_s"]),
        "step_s_serverless": s["step_s"],
        "step_s_dedicated": d["step_s"],
        "cold_starts": s["cold_starts"],
        "steps": steps,
    }
    print("RESULT " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in ratio.items()))
    return ratio


if __name__ == "__main__":
    main()
