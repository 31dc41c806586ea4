"""Learning with more work in flight: does two steps' worth hurt a task, and does start
order give it back?

Runs the default graph (``graphs/multitask.py``: gridnav, guess, boxpush) as the CI
learning test runs it (``tests/test_e2e.py``: 80 async steps on ``resources/local.py``,
in-process) from the warmed-up model the pipeline benchmark caches, with
``Rollout.max_in_flight`` one step's worth (the default), two steps' worth in completion
order, and two steps' worth in start order (``take_window`` one step's worth), on each of
``--seeds`` seeds (the order of the settings shuffled per seed), and evaluates the warm-up
policy (once) and each trained policy on the same held-out seeds (paired per seed; the
warm-up model is shared, so the seeds vary the RL run only). Ends with

    RESULT gain_<setting>=… gridnav_<setting>=… guess_<setting>=… boxpush_<setting>=…
           worst_<setting>=… seeds=… steps=… eval_seeds=…

``gain_*`` = the median over seeds of the mean held-out gain over the tasks, ``<task>_*``
each task's median gain, ``worst_*`` the median of each run's smallest task gain (with
``_min``/``_max`` over the seeds for gains). A script, not a test.

    flock /tmp/rollart-bench.lock python benchmarks/inflight_learning.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py, pipeline.py

from _results import Run, add_arguments  # noqa: E402

SETTINGS = {"one": (None, None), "two": (2.0, None), "two_start": (2.0, 1.0)}
TASKS = ("gridnav", "guess", "boxpush")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (minutes)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0, 1, … (default 3)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default 80)")
    p.add_argument("--eval-seeds", type=int, default=None,
                   help="held-out seeds per task (default 128)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of "
                   + ", ".join(SETTINGS))
    add_arguments(p)
    a = p.parse_args(argv)
    for k, full, quick in (("seeds", 3, 1), ("steps", 80, 4), ("eval_seeds", 128, 8)):
        if getattr(a, k) is None:
            setattr(a, k, quick if a.quick else full)
    a.settings = tuple(s for s in a.settings.split(",") if s)
    bad = [s for s in a.settings if s not in SETTINGS]
    if bad:
        p.error(f"unknown setting(s) {bad}: use {list(SETTINGS)}")
    return a


def run_one(base, model: str, warm: dict, setting: str, seed: int, a, tmp: Path) -> dict:
    """One 80-step run of ``setting`` on ``seed``: its held-out gain per task over the
    warm-up policy's ``warm`` (the same held-out seeds)."""
    from distributed import Client

    import rollart
    from rollart.runtime.resources import load_resources

    in_flight, window = SETTINGS[setting]
    graph = replace(base, steps=a.steps, seed=seed,
                    policy=replace(base.policy, model=model, warmup_steps=0),
                    rollout=replace(base.rollout, max_in_flight=in_flight,
                                    take_window=window))
    res = replace(load_resources(), processes=False, dashboard_address=":0")
    t0 = time.time()
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = rollart.train(graph, client=client, run_dir=tmp / f"{setting}-{seed}",
                               progress=False, eval_seeds=a.eval_seeds)
    trained = result.evaluation["trained"]
    gains = {t: trained[t] - warm[t] for t in TASKS}
    print(f"  {setting:9s} seed {seed}: gains " + " ".join(f"{t}={g:+.3f}" for t, g in
                                                           gains.items())
          + f" ({time.time() - t0:.0f}s)", flush=True)
    return gains


def warm_up(a, base, tmp: str) -> dict:
    """The warm-up model (``--quick``: a short warm-up of its own in ``tmp``, a smoke
    run; otherwise the pipeline benchmark's cached one) and its held-out success."""
    from pipeline import WARM_CACHE, cached_warm_model

    from rollart.observe.evaluate import evaluate
    from rollart.types import EVAL_SEED_BASE

    model, reused = cached_warm_model(tmp if a.quick else WARM_CACHE, base.tasks,
                                      20 if a.quick else base.policy.warmup_steps)
    seeds = range(EVAL_SEED_BASE, EVAL_SEED_BASE + a.eval_seeds)
    heldout = evaluate(model, base.tasks, seeds, **base.policy.conversation_options())
    print(f"warm-up model {model} ({'reused' if reused else 'built'}): held-out {heldout}",
          flush=True)
    return {"model": model, "heldout": heldout}


def summarise(runs: dict) -> dict:
    """``{setting: [gains per task, one dict per seed]}`` -> the RESULT figures."""
    out = {}
    for s, per_seed in runs.items():
        if not per_seed:
            continue
        means = [sum(g.values()) / len(g) for g in per_seed]
        out[f"gain_{s}"] = statistics.median(means)
        out[f"gain_{s}_min"], out[f"gain_{s}_max"] = min(means), max(means)
        for t in TASKS:
            out[f"{t}_{s}"] = statistics.median(g[t] for g in per_seed)
        out[f"worst_{s}"] = statistics.median(min(g.values()) for g in per_seed)
    return out


def main(argv=None) -> dict:
    a = parse(argv)
    run = Run("inflight_learning", a, argv)
    import rollart
    from rollart.app.cli import quiet

    quiet()
    base, _ = rollart.load_graph()
    t_all = time.time()
    runs: dict = {s: [] for s in a.settings}
    with tempfile.TemporaryDirectory() as tmp:
        warm = warm_up(a, base, tmp)
        for seed in range(a.seeds):
            order = random.Random(seed).sample(list(a.settings), len(a.settings))
            print(f"seed {seed}: order {' '.join(order)}", flush=True)
            for s in order:
                runs[s].append(run_one(base, warm["model"], warm["heldout"], s, seed, a,
                                       Path(tmp)))
            part = summarise(runs)
            print("PARTIAL " + " ".join(f"{k}={v:.3f}" for k, v in part.items()), flush=True)
    out = summarise(runs)
    out.update(seeds=a.seeds, steps=a.steps, eval_seeds=a.eval_seeds,
               **{f"warm_{t}": warm["heldout"][t] for t in TASKS},
               total_s=round(time.time() - t_all))
    run.result(out, {"runs": runs})
    return out


if __name__ == "__main__":
    main()
