"""Pipeline benchmark: async vs one-off vs sync on the same cluster, model and workload.

Runs the three modes back to back on the default multi-task graph whose envs straggle
(heavy-tailed start-up and step latency: ``rollart.env.faults.straggler_profile``), from
the same warmed-up tiny model, and prints per mode: trajectories/s, generated tokens/s,
trainer steps/min, time to a target reward, inference-engine busy fraction, per-turn
orchestration overhead and final reward — then one line

    RESULT async_vs_sync=… async_vs_oneoff=… reward_gap=… …

(throughput ratios of trained trajectories/s; reward_gap = async final reward − sync's,
the training reward of the batches each mode trained on). Each mode's final model is
also evaluated on held-out seeds (``--eval-seeds``, outside the timed run):
``heldout_gap`` = async's mean held-out success − sync's. It is the fairer comparison of
what was learned: with redundant members a group keeps its fastest finishers, and in
the built-in games a fast episode is often a successful one, so async's training reward
can read higher than its policy is. A script, not a test: figures are ratios measured
side by side in one run.

Every mode runs on ``resources/laptop.py`` with one inference pool by default: on a
2-core machine that layout wastes the least on comm (rollout in one worker process, the
trainer in another). ``--resources local --inference-pools ''`` gives every role a
process of its own and uses the graph's two inference pools.

    python benchmarks/pipeline.py --quick
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

MODES = ("sync", "one-off", "async")


def warm_model(path: Path, tasks, steps: int) -> str:
    """The built-in tiny model after its format warm-up (shared by all modes)."""
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model, load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup

    init = build_tiny_model(str(path / "init"), task_corpus(tasks))
    model, tok = load_model(init), load_tokenizer(init)
    run_warmup(model, tok, list(tasks), steps=steps, batch_size=32, lr=3e-3)
    model.save_pretrained(path / "warm")
    tok.save_pretrained(path / "warm")
    return str(path / "warm")


def summarise(rows: list[dict], n_workers: int, target: float) -> dict:
    """Per-mode figures from a run's metrics rows."""
    from rollart.report import smooth

    t = rows[-1]["time"]
    reward = smooth([r["reward/mean"] for r in rows], 5)
    full = list(zip(rows, reward))[4 if len(rows) >= 5 else 0:]  # full 5-step windows
    hit = next((r["time"] for r, s in full if s >= target), float("nan"))
    last = rows[-1]
    return {
        "traj_per_s": last["traj/trained"] / t,
        "tokens_per_s": last["rollout/tokens_generated"] / t,
        "steps_per_min": len(rows) / t * 60,
        "time_to_target_s": hit,
        "engine_busy": last["rollout/engine_busy_s"] / (t * n_workers),
        "turn_overhead_ms": last["rollout/turn_overhead_s"] * 1000,
        "final_reward": sum(reward[-5:]) / len(reward[-5:]),
        "wall_s": t,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--redundancy", type=float, default=1.5)
    p.add_argument("--backup-after", type=float, default=None,
                   help="async extras start as backups once this share of a group is "
                        "in (default: with the group)")
    p.add_argument("--target", type=float, default=0.6, help="reward/mean to reach")
    p.add_argument("--eval-seeds", type=int, default=64,
                   help="held-out seeds per task for each mode's final model (0: none)")
    p.add_argument("--resources", default="laptop",
                   help="the layout (resources/NAME.py); laptop: rollout in one worker, "
                   "the trainer in another; local: a process per role")
    p.add_argument("--inference-pools", default="H800",
                   help="comma-separated inference pool tags ('' = the graph's own)")
    a = p.parse_args(argv)
    steps = a.steps or (20 if a.quick else 60)

    from rollart.cli import quiet

    quiet()
    from distributed import Client

    import rollart
    from rollart.env.faults import straggler_profile, with_faults
    from rollart.control import EVAL_SEED_BASE
    from rollart.evaluate import evaluate

    base, _ = rollart.load_graph("multitask")
    if a.inference_pools:
        pools = tuple(t for t in a.inference_pools.split(",") if t)
        base = replace(base, rollout=replace(base.rollout, inference_pools=pools))
    tasks = tuple(with_faults(t, straggler_profile(seed=i)) for i, t in enumerate(base.tasks))
    res = rollart.load_resources(a.resources)
    out = {}
    with tempfile.TemporaryDirectory() as tmp, res.make_cluster() as cluster, \
            Client(cluster) as client:
        model = warm_model(Path(tmp), base.tasks, base.policy.warmup_steps)
        seeds = range(EVAL_SEED_BASE, EVAL_SEED_BASE + a.eval_seeds)
        start = evaluate(model, base.tasks, seeds) if a.eval_seeds else {}
        n_workers = sum(len(rollart.resources.workers_with(client, t))
                        for t in base.rollout.inference_pools)
        for mode in MODES:
            graph = replace(base, tasks=tasks, mode=mode, steps=steps,
                            policy=replace(base.policy, model=model),
                            rollout=replace(base.rollout, redundancy=a.redundancy
                                            if mode == "async" else 1.0,
                                            backup_after=a.backup_after))
            t0 = time.time()
            result = rollart.train(graph, client=client, run_dir=Path(tmp) / mode,
                                   progress=False, eval_seeds=0)
            out[mode] = summarise(result.metrics, n_workers, a.target)
            if a.eval_seeds:
                success = evaluate(result.model_dir, base.tasks, seeds)
                out[mode]["heldout_success"] = sum(success.values()) / len(success)
            print(f"{mode:8s} " + " ".join(f"{k}={v:.3g}" for k, v in out[mode].items())
                  + f" (run {time.time() - t0:.0f}s)", flush=True)
    ratio = {
        "async_vs_sync": out["async"]["traj_per_s"] / out["sync"]["traj_per_s"],
        "async_vs_oneoff": out["async"]["traj_per_s"] / out["one-off"]["traj_per_s"],
        "reward_gap": out["async"]["final_reward"] - out["sync"]["final_reward"],
        "tokens_async_vs_sync": out["async"]["tokens_per_s"] / out["sync"]["tokens_per_s"],
        **({"heldout_gap": out["async"]["heldout_success"]
            - out["sync"]["heldout_success"],
            "heldout_start": sum(start.values()) / len(start),
            **{f"heldout_{m.replace('-', '')}": out[m]["heldout_success"] for m in MODES}}
           if a.eval_seeds else {}),
        "busy_async": out["async"]["engine_busy"],
        "busy_sync": out["sync"]["engine_busy"],
        "steps": steps,
        "resources": a.resources,
        "inference_pools": "+".join(base.rollout.inference_pools),
    }
    print("RESULT " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in ratio.items()))
    return ratio


if __name__ == "__main__":
    main()
