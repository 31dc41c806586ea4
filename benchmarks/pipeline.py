"""Pipeline benchmark: time to a held-out target, every mode on the same code and cluster.

Runs the paper's §7.1 set of modes — ``sync`` (a barrier at every turn), ``sync+`` (the
paper's main baseline: trajectory-level env interaction, rollout stopped while the
trainer steps), ``one-off``, ``areal`` (staleness checked when a group starts) and
``async`` (rollart) — on one cluster (``resources/laptop.py``), from one warmed-up tiny
model, on the default task mix whose envs cost what sandboxes cost
(``rollart.chaos.workload``: CPU-burning steps, heavy-tailed waits, slow resets that fail
about once per 10 steps and are retried, pooled warm sandboxes; one scale factor).

Per seed (``--seeds``; the order of the runs shuffled by a seeded RNG and printed) each
run trains ``--steps`` steps and keeps a checkpoint every ``--every`` steps. After the
run (outside its timed window) each checkpoint's policy is evaluated on held-out seeds
(``rollart.observe.evaluate.evaluate``, seeds from ``rollart.types.EVAL_SEED_BASE``) and
mapped to the wall time its step finished (the metrics rows' ``time``, less the time
the driver spent writing earlier checkpoints). A run's *time to target* is that of its
first checkpoint at or above the target held-out success, which is fixed before any
run: the warm-up policy's held-out success + ``TARGET_MARGIN``. A run that never gets
there counts ``inf``. The headline runs have no redundant members (every mode alike);
the modes that can use redundancy (``REDUNDANT_MODES``: their groups run on their own;
``sync`` and ``one-off`` move a batch turn by turn) also run with ``--redundancy``
extras per group, reported beside them as ``<mode>@r`` (``--redundant``; the full run
does all three, ``--quick`` none, to fit its time). Ends with

    RESULT speedup_vs_syncplus=… speedup_vs_sync=… speedup_vs_oneoff=… speedup_vs_areal=…
           throughput_vs_sync=… heldout_async=… heldout_syncplus=… seeds=… target=… …

``speedup_vs_X`` = X's median time to target ÷ async's (``_min``/``_max``: the per-seed
ratios' range); ``throughput_vs_sync`` = async's median trained trajectories/s ÷ sync's;
``heldout_*`` = the median held-out success of each mode's last checkpoint. A script,
not a test.

    python benchmarks/pipeline.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py

from _results import Run, add_arguments, fill  # noqa: E402

MODES = ("sync", "sync+", "one-off", "areal", "async")
REDUNDANT_MODES = ("sync+", "areal", "async")  # the modes whose groups run on their own
TARGET_MARGIN = 0.10  # target = warm-up held-out success + this (fixed before any run)
BASELINES = {"syncplus": "sync+", "sync": "sync", "oneoff": "one-off", "areal": "areal"}
# sized (before any measurement) so that --quick fits ~13 minutes of a 2-core machine
QUICK = {"steps": 10, "every": 2, "groups": 6, "eval_seeds": 32, "seeds": 3,
         "redundant": ""}
FULL = {"steps": 30, "every": 3, "groups": 12, "eval_seeds": 64, "seeds": 3,
        "redundant": ",".join(REDUNDANT_MODES)}
WARM_CACHE = "~/.cache/rollart/pipeline-bench"


def warm_model(path: Path, tasks, steps: int) -> str:
    """The built-in tiny model after its format warm-up (shared by every run)."""
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model, load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup

    init = build_tiny_model(str(path / "init"), task_corpus(tasks))
    model, tok = load_model(init), load_tokenizer(init)
    run_warmup(model, tok, list(tasks), steps=steps, batch_size=32, lr=3e-3)
    model.save_pretrained(path / "warm")
    tok.save_pretrained(path / "warm")
    return str(path / "warm")


def cached_warm_model(folder: str, tasks, steps: int) -> tuple[str, bool]:
    """``warm_model`` kept in ``folder/warm-<steps>-<corpus hash>`` and reused when it
    is there (the warm-up is seeded: the same tasks and steps give the same model);
    returns (path, reused)."""
    from rollart.env.tasks import task_corpus

    key = hashlib.sha1("\n".join(task_corpus(tasks)).encode()).hexdigest()[:10]
    path = Path(folder).expanduser() / f"warm-{steps}-{key}"
    if (path / "warm" / "config.json").exists():
        return str(path / "warm"), True
    return warm_model(path, tasks, steps), False


@contextlib.contextmanager
def timed_checkpoints(durations: dict):
    """Record how long the driver spends in each ``rollart.control.checkpoint.save`` (step ->
    seconds): the checkpoints exist for the held-out evaluation, so their time is taken
    out of the run's clock. The real ``save`` runs unchanged."""
    from rollart.control import checkpoint

    real = checkpoint.save

    def save(url, step, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(url, step, *args, **kwargs)
        finally:
            durations[int(step)] = time.perf_counter() - t0

    checkpoint.save = save
    try:
        yield durations
    finally:
        checkpoint.save = real


def clock(rows: list[dict], ckpt_s: dict) -> dict[int, float]:
    """Step -> seconds since the run's start when the step finished, without the time
    spent writing the checkpoints of earlier steps."""
    return {r["step"]: r["time"] - sum(d for s, d in ckpt_s.items() if s < r["step"])
            for r in rows}


def run_one(client, base, tasks, model: str, label: str, seed: int, a, out: Path) -> dict:
    """Train one (mode, redundancy) from ``model``; returns its clock and checkpoints."""
    import rollart
    from rollart.chaos.workload import drain_pools, pool_stats

    mode, redundancy = label.split("@")[0], a.redundancy if "@" in label else 1.0
    graph = replace(base, tasks=tasks, mode=mode, steps=a.steps, seed=seed,
                    checkpoint_every=a.every,
                    policy=replace(base.policy, model=model, weight_update=a.weight_update),
                    algo=replace(base.algo, groups_per_step=a.groups, alpha=None),
                    rollout=replace(base.rollout, redundancy=redundancy,
                                    max_in_flight=a.max_in_flight,
                                    take_window=a.take_window))
    client.run(drain_pools, on_error="return")  # no run inherits another's warm sandboxes
    ckpt_s: dict[int, float] = {}
    run_dir = out / f"{label.replace('@', '_r').replace('+', 'plus')}-seed{seed}"
    with timed_checkpoints(ckpt_s):
        result = rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                               eval_seeds=0)
    env = _sum_stats(client.run(pool_stats, on_error="return"))
    rows = result.metrics
    t = clock(rows, ckpt_s)
    last = rows[-1]
    snaps = sorted((int(p.name.split("-")[1]), str(p / "model"))
                   for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    return {"label": label, "seed": seed, "clock": t, "snapshots": snaps,
            "traj_per_s": last["traj/trained"] / t[last["step"]],
            "wall_s": t[last["step"]], "ckpt_s": sum(ckpt_s.values()),
            "fail_per_step": env.get("reset_failures", 0) / max(env.get("steps", 0), 1),
            "reuse": env.get("reused", 0) / max(env.get("resets", 0), 1),
            # weight swaps that met rows generating, and the tokens re-prefilled after them
            "suspends": last.get("rollout/suspends", 0),
            "recompute_tokens": last.get("rollout/recompute_tokens", 0),
            "run_dir": str(run_dir)}


def _sum_stats(per_worker: dict) -> dict:
    out: dict[str, float] = {}
    for stats in per_worker.values():
        if isinstance(stats, BaseException):
            continue  # a worker that was gone
        for k, v in stats.items():
            out[k] = out.get(k, 0) + v
    return out


def score(run: dict, tasks, seeds, target: float) -> dict:
    """Evaluate the run's checkpoints in step order until one reaches ``target``, and
    its last one; time to target (inf if none did) and the last held-out success."""
    from rollart.observe.evaluate import evaluate

    def heldout(path):
        success = evaluate(path, tasks, seeds)
        return sum(success.values()) / len(success)

    run["time_to_target_s"], run["curve"] = math.inf, {}
    for step, path in run["snapshots"]:
        run["curve"][step] = heldout(path)
        if run["curve"][step] >= target:
            run["time_to_target_s"] = run["clock"][step]
            break
    last_step, last_path = run["snapshots"][-1]
    if last_step not in run["curve"]:
        run["curve"][last_step] = heldout(last_path)
    run["heldout"] = run["curve"][last_step]
    shutil.rmtree(run["run_dir"], ignore_errors=True)  # checkpoints are large
    return run


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def summarise(runs: list[dict], seeds: list[int]) -> dict:
    """The RESULT figures from every scored run."""
    by = {}
    for r in runs:
        by.setdefault(r["label"], {})[r["seed"]] = r

    def med(label, key):
        return _median([r[key] for r in by.get(label, {}).values()])

    def ratios(num: str, den: str, key: str) -> list[float]:
        return [_ratio(by[num][s][key], by[den][s][key]) for s in seeds
                if s in by.get(num, {}) and s in by.get(den, {})]

    out = {}
    for short, mode in BASELINES.items():
        out[f"speedup_vs_{short}"] = _ratio(med(mode, "time_to_target_s"),
                                            med("async", "time_to_target_s"))
    out["throughput_vs_sync"] = med("async", "traj_per_s") / med("sync", "traj_per_s")
    out["heldout_async"] = med("async", "heldout")
    out["heldout_syncplus"] = med("sync+", "heldout")
    out["seeds"] = len(seeds)
    out["target"] = math.nan  # set by main (kept here for the key order)
    for short, mode in BASELINES.items():
        per = ratios(mode, "async", "time_to_target_s")
        out[f"speedup_vs_{short}_min"], out[f"speedup_vs_{short}_max"] = _range(per)
    per = ratios("async", "sync", "traj_per_s")
    out["throughput_vs_sync_min"], out["throughput_vs_sync_max"] = _range(per)
    for label in by:
        key = label.replace("+", "plus").replace("-", "").replace("@r", "_r")
        out[f"ttt_{key}"] = med(label, "time_to_target_s")
        out[f"tps_{key}"] = med(label, "traj_per_s")
    if "sync+@r" in by and "async@r" in by:
        out["speedup_r_vs_syncplus_r"] = _ratio(med("sync+@r", "time_to_target_s"),
                                                med("async@r", "time_to_target_s"))
    return out


def _ratio(num: float, den: float) -> float:
    if math.isinf(num) and math.isinf(den):
        return math.nan  # neither reached the target
    return num / den if den else math.nan


def _range(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    return (min(xs), max(xs)) if xs else (math.nan, math.nan)


def fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="about 15 minutes on 2 cores")
    p.add_argument("--steps", type=int, help="trainer steps per run")
    p.add_argument("--every", type=int, help="checkpoint (and evaluate) every N steps")
    p.add_argument("--groups", type=int, help="groups of 8 per trainer step")
    p.add_argument("--eval-seeds", type=int, help="held-out seeds per task")
    p.add_argument("--seeds", type=int, help="seeds (1, 2, …); every mode runs each")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--redundant", default=None,
                   help="modes also run with redundancy (of REDUNDANT_MODES; '' = none)")
    p.add_argument("--max-in-flight", type=float, default=None,
                   help="Rollout.max_in_flight for async and areal (steps' worth of groups "
                        "in flight at once; default: async max(alpha, 1), areal its start "
                        "bound)")
    p.add_argument("--take-window", type=float, default=None,
                   help="Rollout.take_window for async and areal: take groups in start "
                        "order within this many steps' worth (default: completion order)")
    p.add_argument("--weight-update", choices=("recompute", "keep"), default="recompute",
                   help="Policy.weight_update: a weight swap re-prefills the rows being "
                        "generated, or they keep their KV")
    p.add_argument("--redundancy", type=float, default=1.5,
                   help="members launched per group member in the redundant runs")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="format warm-up steps (default: the graph's)")
    p.add_argument("--margin", type=float, default=TARGET_MARGIN,
                   help="target = warm-up held-out success + this (tests only: the "
                   "default is the benchmark's)")
    p.add_argument("--warm-cache", default=WARM_CACHE,
                   help="a folder to keep the warmed-up model in and reuse it from "
                   "('' = build it afresh in a temporary folder)")
    add_arguments(p)
    a = p.parse_args(argv)
    fill(a, QUICK if a.quick else FULL)
    a.modes = tuple(m for m in a.modes.split(",") if m)
    a.redundant = tuple(m for m in a.redundant.split(",") if m)
    bad = [m for m in a.modes if m not in MODES] + \
        [m for m in a.redundant if m not in REDUNDANT_MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}: --modes takes {MODES}, --redundant {REDUNDANT_MODES}")
    return a


def warm_up(a, tasks, seeds, tmp: str) -> tuple[str, float, float]:
    """The shared warm-up model, its held-out success and the target (fixed here)."""
    from rollart.observe.evaluate import evaluate

    t0 = time.time()
    model, reused = cached_warm_model(a.warm_cache or tmp, tasks, a.warmup_steps)
    print(f"warm-up model {model}: " + ("reused" if reused else
                                        f"built in {time.time() - t0:.0f}s"), flush=True)
    start = evaluate(model, tasks, seeds)
    warm = sum(start.values()) / len(start)
    target = round(warm + a.margin, 4)
    print(f"warm-up held-out success {warm:.3f} -> target {target:.3f}", flush=True)
    return model, warm, target


def run_seed(client, base, model, labels, seed, a, tmp, heldout_seeds, target,
             runs: list, failed: list) -> None:
    """Every run of one seed, in an order shuffled by ``random.Random(seed)``."""
    from rollart.chaos.workload import Workload, with_workload

    order = random.Random(seed).sample(labels, len(labels))
    print(f"seed {seed}: order {' '.join(order)}", flush=True)
    tasks = tuple(with_workload(t, Workload(seed=seed)) for t in base.tasks)
    from rollart.runtime.priority import thread_nices

    for label in order:
        t0 = time.time()
        # every run starts from the cluster's own priorities (an asynchronous run nices
        # its rollout workers and gives it back at its end: rollart.runtime.priority)
        mine = [os.getpriority(os.PRIO_PROCESS, 0)]  # the workers' own, inherited
        nices = {w: sorted(set(n)) for w, n in client.run(thread_nices).items()}
        if any(n != mine for n in nices.values()):
            raise RuntimeError(f"before {label}/{seed}: worker priorities are not the "
                               f"cluster's start (nice {mine[0]}): {nices}")
        try:
            run = run_one(client, base, tasks, model, label, seed, a, Path(tmp))
        except Exception as e:  # noqa: BLE001 - reported, counted, the rest go on
            print(f"  {label:9s} FAILED: {type(e).__name__}: {e}"[:2000], flush=True)
            failed.append(f"{label}/{seed}")
            continue
        runs.append(score(run, base.tasks, heldout_seeds, target))
        print(f"  {label:9s} time_to_target_s={fmt(run['time_to_target_s'])} "
              f"traj_per_s={fmt(run['traj_per_s'])} heldout={fmt(run['heldout'])} "
              f"wall_s={fmt(run['wall_s'])} ckpt_s={fmt(run['ckpt_s'])} "
              f"env_fail_per_step={fmt(run['fail_per_step'])} reuse={fmt(run['reuse'])} "
              f"suspends={run['suspends']} recompute_tokens={run['recompute_tokens']} "
              "curve=" + ",".join(f"{s}:{v:.2f}" for s, v in run["curve"].items())
              + f" ({time.time() - t0:.0f}s)", flush=True)


def main(argv=None) -> dict:
    a = parse(argv)
    run = Run("pipeline", a, argv)
    from rollart.app.cli import quiet

    quiet()
    from distributed import Client

    import rollart
    from rollart.types import EVAL_SEED_BASE

    base, _ = rollart.load_graph("multitask")
    base = replace(base, rollout=replace(base.rollout, inference_pools=("H800",)))
    if a.warmup_steps is None:
        a.warmup_steps = base.policy.warmup_steps
    seeds = list(range(1, a.seeds + 1))
    labels = list(a.modes) + [f"{m}@r" for m in a.redundant]
    heldout_seeds = range(EVAL_SEED_BASE, EVAL_SEED_BASE + a.eval_seeds)
    runs, failed, t_all = [], [], time.time()
    with tempfile.TemporaryDirectory() as tmp, \
            rollart.load_resources("laptop").make_cluster() as cluster, Client(cluster) as client:
        model, warm, target = warm_up(a, base.tasks, heldout_seeds, tmp)
        for i, seed in enumerate(seeds):
            run_seed(client, base, model, labels, seed, a, tmp, heldout_seeds, target,
                     runs, failed)
            if i + 1 < len(seeds):  # figures so far, in case the run is cut short
                part = summarise(runs, seeds[:i + 1])
                print("PARTIAL " + " ".join(f"{k}={fmt(v)}" for k, v in part.items()
                                            if k != "target"), flush=True)
    out = summarise(runs, seeds)
    out.update(inflight=a.max_in_flight if a.max_in_flight is not None else "alpha",
               order="completion" if a.take_window is None else f"start{a.take_window:g}",
               weight_update=a.weight_update,
               target=target, failed_runs=len(failed),
               heldout_warm=warm, margin=a.margin,
               steps=a.steps, groups=a.groups, eval_seeds=a.eval_seeds,
               total_s=round(time.time() - t_all))
    keys = ("label", "seed", "time_to_target_s", "heldout", "traj_per_s", "wall_s",
            "suspends", "recompute_tokens")
    run.result(out, {"runs": [{k: r.get(k) for k in keys} for r in runs]}, fmt=fmt)
    return out


if __name__ == "__main__":
    main()
