"""Pipeline benchmark on a real model: ``sync+``, ``areal`` and ``async`` (rollart's
default) training SmolLM2-135M-Instruct on ``graphs/real.py:lora``, timed to a held-out
target fixed before any run.

``benchmarks/pipeline.py`` decides its modes on the built-in tiny model, whose turns are
one or two tokens; this is the same comparison where a real model's compute binds: the
untrained instruct model (``--model smollm2-135m-instruct``), both of the graph's tasks
(``guess_number``, multi-turn feedback; ``calculator``, a tool call) in English through
its own chat template, LoRA at the graph's settings (``graphs/real.py``, fixed before any
run), on ``resources/laptop.py``. The envs are the tasks' own (no ``rollart.chaos``
workload: the model's compute is the cost here).

Each label is built by ``pipeline.label_graph`` (the same modes and async variants as
``pipeline.py``: ``--modes sync+,areal,async,async@completion_clip``); each run trains
``--steps`` steps, keeping a checkpoint every ``--every``. **The clock** is
``pipeline.py``'s (the metrics rows' ``time``: from the start of step 1, start-up and
model loading off it, checkpoint writes on it for every mode alike; held-out evaluation
never on it). **The target** is the untrained model's held-out success (the mean over
the tasks, on ``--eval-seeds`` held-out seeds each) + ``--margin`` (0.10, as
``pipeline.py``'s), computed before any run and printed. A run's time to target is the
clock at its first checkpoint at or above it (``inf``: never); the headline is paired per
seed (``pipeline.paired``: the median ratio, the win count and the spread). Per seed the
order of the runs is shuffled by ``random.Random(seed)`` and printed; every run starts a
cluster of its own (off the clock), so none inherits another's worker memory.

About 50 minutes a seed on two cores (three labels of 20 LoRA steps at about 35 s a
step, and their held-out evaluations at about a minute a checkpoint, in step order until
one reaches the target, and the last); each finished seed is kept (``_results.Kept``), so
a series cut short goes on with ``--resume``::

    flock /tmp/rollart-bench.lock python benchmarks/pipeline_real.py --seeds 5 --resume
    python benchmarks/pipeline_real.py --quick     # 1 seed, 2 tiny steps a mode: smoke

RESULT keys: ``pipeline.py``'s paired figures (``speedup_vs_syncplus_paired``,
``wins_vs_syncplus``, ``pairs_vs_syncplus``, ``speedup_vs_areal_paired``, …, each with
``_min``/``_max``; ``inflight_async``, ``inflight_areal``; ``ttt_<label>``,
``tps_<label>``: median time to target and trained trajectories/s), ``heldout_<label>``
(the median last held-out success), ``before``, ``target``, ``seeds``, ``steps``,
``model``. Each run in the record carries its held-out curve and step figures
(``_pipeline_steps.run_figures``). Appends to ``benchmarks/results/pipeline_real.jsonl``.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py, pipeline.py

from _pipeline_steps import run_figures  # noqa: E402
from _results import Kept, Run, add_arguments, fill  # noqa: E402
from pipeline import (LABELS, TARGET_MARGIN, VARIANTS, fmt, run_one,  # noqa: E402
                      same_priorities, score, short, summarise)

MODEL = "smollm2-135m-instruct"
#: sizes fixed before any run: 20 LoRA steps (real_model.py's LoRA runs reach +0.15 on
#: guess_number's training success by step 15-20), a checkpoint every 4, 64 held-out
#: seeds a task (about a minute to evaluate a checkpoint)
FULL = {"graph": "graphs/real.py:lora", "steps": 20, "every": 4, "eval_seeds": 64,
        "seeds": 5, "modes": "sync+,areal,async"}
QUICK = {"graph": "graphs/real.py:smoke", "steps": 2, "every": 1, "eval_seeds": 4,
         "seeds": 1, "modes": "sync+,areal,async"}
#: the record's keys of each run (its rows stay out: they are large)
KEYS = ("label", "seed", "time_to_target_s", "heldout", "curve", "traj_per_s", "wall_s",
        "ckpt_s", "inflight", "suspends", "recompute_tokens", "trainer_wait_s",
        "version_wait_s", "dropped", "aborted", "wasted_share", "rescored_tokens",
        "trainer_rescored_tokens", "steps")


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="one seed, graphs/real.py:smoke's 2 tiny steps a mode, 4 held-out "
                        "seeds (a smoke run)")
    p.add_argument("--graph", default=None, help=f"default {FULL['graph']}")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run")
    p.add_argument("--every", type=int, default=None, help="checkpoint every N steps")
    p.add_argument("--eval-seeds", type=int, default=None, help="held-out seeds per task")
    p.add_argument("--seeds", type=int, default=None, help="seeds 1..N")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated labels of pipeline.py's {LABELS}")
    p.add_argument("--ours", default="async",
                   help=f"the headline's label: async or one of {tuple(VARIANTS)} run "
                        "beside it")
    p.add_argument("--margin", type=float, default=TARGET_MARGIN,
                   help="target = the untrained model's held-out success + this")
    p.add_argument("--resources", default="laptop")
    p.add_argument("--resume", action="store_true",
                   help="go on from the seeds an earlier invocation of the same settings "
                        "finished (runs/bench-pipeline_real/)")
    add_arguments(p)
    a = p.parse_args(argv)
    fill(a, QUICK if a.quick else FULL)
    a.modes = tuple(m for m in a.modes.split(",") if m)
    bad = [m for m in a.modes if m not in LABELS or m.endswith("@r")]
    if bad:
        p.error(f"unknown label(s) {bad}: --modes takes {LABELS}")
    if a.ours != "async" and (a.ours not in VARIANTS or a.ours not in a.modes
                              or "async" not in a.modes):
        p.error(f"--ours {a.ours}: name an async variant of {tuple(VARIANTS)} that "
                "--modes runs beside async itself")
    # what pipeline.label_graph reads beyond these: every mode at the graph's own
    a.groups = a.lr = a.max_in_flight = a.take_window = None
    a.redundancy = 1.0
    return a


def graph_and_tasks(spec: str, a):
    """The base graph (``spec``: ``graphs/real.py:lora``), its groups a step and weight
    update as ``pipeline.label_graph``'s settings, and its conversation options."""
    import rollart

    file, colon, fn = spec.partition(":")
    base, _ = rollart.load_graph(f"{ROOT / file}{colon}{fn}")  # from any folder
    a.groups = base.algo.groups_per_step
    a.weight_update = base.policy.weight_update
    return base, base.policy.conversation_options()


def heldout(model_dir: str, base, seeds, opts) -> dict[str, float]:
    from rollart.observe.evaluate import evaluate

    return evaluate(model_dir, base.tasks, seeds, **opts)


def one_seed(base, model_dir, seed: int, a, target: float, seeds, opts) -> list[dict]:
    """Every label's run of ``seed``, each on a fresh cluster, in a seeded shuffled
    order, each scored against ``target``."""
    from distributed import Client

    import rollart

    order = random.Random(seed).sample(a.modes, len(a.modes))
    print(f"seed {seed}: order {' '.join(order)}", flush=True)
    runs = []
    for label in order:
        t0 = time.time()
        # a cluster of its own a run: none inherits another's worker memory (the rollout
        # worker of one cluster that ran sync+ then async grew to 13 GB and was killed)
        with tempfile.TemporaryDirectory() as tmp:
            with rollart.load_resources(a.resources).make_cluster() as cluster, \
                    Client(cluster) as client:
                same_priorities(client, label, seed)
                run = run_one(client, base, base.tasks, model_dir, label, seed, a,
                              Path(tmp))
            score(run, base.tasks, seeds, target, **opts)  # the cluster gone, off the clock
        run["steps"] = run_figures(run, target)
        run.pop("rows")
        print(f"  {label:9s} time_to_target_s={fmt(run['time_to_target_s'])} "
              f"traj_per_s={fmt(run['traj_per_s'])} wall_s={fmt(run['wall_s'])} "
              f"inflight={fmt(run['inflight'])} s_step={fmt(run['steps']['s_step'])} "
              "curve=" + ",".join(f"{s}:{v:.2f}" for s, v in run["curve"].items())
              + f" ({time.time() - t0:.0f}s)", flush=True)
        runs.append({k: run.get(k) for k in KEYS})
    return runs


def ran_only(figures: dict, labels) -> dict:
    """``pipeline.summarise``'s figures, the paired ones only (no ratio of medians, no
    throughput against sync) and only of the ``labels`` that ran.

    >>> ran_only({"speedup_vs_areal_paired": 1.2, "wins_vs_sync": 0, "speedup_vs_areal": 1.1,
    ...           "inflight_areal_at_async": 2.0, "ttt_async": 9.0, "seeds": 1},
    ...          ("areal", "async"))
    {'speedup_vs_areal_paired': 1.2, 'ttt_async': 9.0, 'seeds': 1}
    """
    ran = {short(m) for m in labels}
    out = {}
    for key, value in figures.items():
        against = re.match(r"(speedup_vs_|wins_vs_|pairs_vs_|inflight_)(.+?)"
                           r"(_paired|_min|_max)?$", key)
        if key.startswith(("throughput_vs_sync", "heldout_")) or (
                against and (against[2] not in ran or (against[1] == "speedup_vs_"
                                                      and not against[3]))):
            continue
        out[key] = value
    return out


def main(argv=None) -> dict:
    a = parse(argv)
    sys.path.insert(0, str(ROOT))  # graphs/
    run = Run("pipeline_real", a, argv)
    from rollart.app.cli import quiet
    from rollart.pretrained import resolve_model
    from rollart.types import EVAL_SEED_BASE

    quiet()
    model_dir = resolve_model(MODEL)
    base, opts = graph_and_tasks(a.graph, a)
    seeds = range(EVAL_SEED_BASE, EVAL_SEED_BASE + a.eval_seeds)
    kept = Kept("pipeline_real", "quick" if a.quick else "full",
                {"graph": a.graph, "steps": a.steps, "every": a.every,
                 "eval_seeds": a.eval_seeds, "modes": list(a.modes), "margin": a.margin,
                 "resources": a.resources}, a.resume)
    before = kept.before(lambda: heldout(model_dir, base, seeds, opts))
    mean = statistics.mean(before.values())
    target = round(mean + a.margin, 4)
    print(f"untrained held-out success {before} (mean {mean:.3f}) on {a.eval_seeds} seeds "
          f"a task: target {target:.3f}", flush=True)
    runs = []
    for seed in range(1, a.seeds + 1):
        runs += kept.seed(seed, lambda _: one_seed(base, model_dir, seed, a, target, seeds,
                                                   opts))
    out = summarise(runs, list(range(1, a.seeds + 1)), a.ours)
    out = ran_only(out, a.modes)
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r["label"], []).append(r["heldout"])
    out.update({f"heldout_{short(k)}": statistics.median(v) for k, v in by.items()})
    out.update(ours=a.ours, before=round(mean, 4), target=target, steps=a.steps,
               every=a.every, eval_seeds=a.eval_seeds, graph=a.graph, model=MODEL,
               **{f"before_{t}": v for t, v in before.items()})
    run.result(out, {"runs": runs, **kept.record()}, fmt=fmt)
    return out


if __name__ == "__main__":
    main()
