"""Learning with more work in flight: does two steps' worth hurt a task, and does start
order give it back?

``--graph default`` (the default) runs the default graph (``graphs/multitask.py``:
gridnav, guess, boxpush) as the CI learning test runs it (``tests/test_e2e.py``: 80 async
steps on ``resources/local.py``, in-process) from the warmed-up model the pipeline
benchmark caches (one warm-up for every seed: the seeds vary the RL run only).

``--graph chat`` runs the chat graph (``graphs/chat.py``: the three games and the
tool-calling calc in ChatML) as its CI learning test does (100 async steps on
``resources/laptop.py``, in-process): per seed, the graph's own two-stage format warm-up
on that seed (a run of one step, kept in ``RUN/warmup_model``), then every setting's RL
run from that warm-up model, so a seed's settings share their warm-up policy.

The settings (``--settings``): ``Rollout.max_in_flight`` one step's worth with stale
members aborted (``one``: async's default before ``new``), two steps' worth in completion
order, two and three steps' worth in start order (``take_window`` one step's worth); the
parts of async's default: ``auto`` (``max_in_flight="auto"``, start order), ``rescore``
(``Rollout.stale_members="rescore"``); and ``new``, both: async's default (the graph's
``Rollout`` left unset, ``Graph.max_in_flight`` and ``Graph.stale_members``), as
``pipeline.py``'s ``async`` runs it; ``keep`` and ``completion_keep``, the default keeping
a complete group that went too stale waiting for its take, its old tokens re-scored by
the trainer (``GRPO.stale_groups="rescore"``), the second taking in completion order
(``pipeline.py``'s ``async@keep`` and ``async@completion_keep``); ``completion_clip``,
completion order with the kept group trained as it is, its true behaviour log-probs under
the PPO clip (``GRPO.stale_groups="clip"``, ``pipeline.py``'s ``async@completion_clip``);
on each of ``--seeds`` seeds (the order of the settings shuffled per seed). The warm-up policy and each trained policy are evaluated on
the same held-out seeds (paired per seed). Ends with

    RESULT gain_<setting>=… <task>_<setting>=… worst_<setting>=… seeds=… steps=…
           eval_seeds=… graph=…

``gain_*`` = the median over seeds of the mean held-out gain over the tasks, ``<task>_*``
each task's median gain, ``worst_*`` the median of each run's smallest task gain (with
``_min``/``_max`` over the seeds for gains). A script, not a test.

    flock /tmp/rollart-bench.lock python benchmarks/inflight_learning.py
    flock /tmp/rollart-bench.lock python benchmarks/inflight_learning.py --graph chat
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py, pipeline.py

from _results import Run, add_arguments  # noqa: E402

#: setting -> (Rollout.max_in_flight, Rollout.take_window, Rollout.stale_members,
#: GRPO.stale_groups)
SETTINGS = {"one": (1.0, None, "abort", "drop"), "two": (2.0, None, "abort", "drop"),
            "two_start": (2.0, 1.0, "abort", "drop"),
            "three_start": (3.0, 1.0, "abort", "drop"),
            "auto": ("auto", None, "abort", "drop"),
            "rescore": (1.0, None, "rescore", "drop"),
            "new": (None, None, None, "drop"),
            # the default keeping stale complete groups, re-scored by the trainer
            # (GRPO.stale_groups), alone and taking in completion order
            "keep": (None, None, None, "rescore"),
            "completion_keep": (None, math.inf, None, "rescore"),
            # completion order, the kept group trained as it is (its true behaviour
            # log-probs under the PPO clip: GRPO.stale_groups="clip"), not re-scored
            "completion_clip": (None, math.inf, None, "clip")}
#: per graph: the graph, its resources, the settings run by default, and the
#: full and --quick sizes (seeds, steps, held-out seeds per task)
GRAPHS = {
    "default": {"graph": None, "resources": None,
                "settings": ("one", "two", "two_start"),
                "full": (3, 80, 128), "quick": (1, 4, 8)},
    "chat": {"graph": "chat", "resources": "laptop",
             "settings": ("one", "two", "two_start", "three_start"),
             "full": (3, 100, 256), "quick": (1, 3, 8)},
}
#: the chat graph's --quick warm-up: a few format steps, no tool-only first stage
CHAT_QUICK_WARMUP = 5


def parse(argv):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="a smoke run (minutes)")
    p.add_argument("--graph", choices=list(GRAPHS), default="default",
                   help="the default graph (graphs/multitask.py) or graphs/chat.py")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0, 1, … (default 3)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: default graph 80, "
                   "chat 100)")
    p.add_argument("--eval-seeds", type=int, default=None,
                   help="held-out seeds per task (default: default graph "
                   "128, chat 256)")
    p.add_argument("--settings", default=None, help="comma-separated, of "
                   + ", ".join(SETTINGS) + " (default: the graph's, "
                   + "; ".join(f"{g}: {','.join(v['settings'])}" for g, v in GRAPHS.items())
                   + ")")
    add_arguments(p)
    a = p.parse_args(argv)
    sizes = GRAPHS[a.graph]["quick" if a.quick else "full"]
    for k, v in zip(("seeds", "steps", "eval_seeds"), sizes):
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.settings = (GRAPHS[a.graph]["settings"] if a.settings is None
                  else tuple(s for s in a.settings.split(",") if s))
    bad = [s for s in a.settings if s not in SETTINGS]
    if bad:
        p.error(f"unknown setting(s) {bad}: use {list(SETTINGS)}")
    return a


def run_one(base, model: str, warm: dict, setting: str, seed: int, a, tmp: Path) -> dict:
    """One RL run of ``setting`` on ``seed`` from the warm-up ``model``: its held-out gain
    per task over the warm-up policy's ``warm`` (the same held-out seeds)."""
    in_flight, window, members, groups = SETTINGS[setting]
    graph = replace(base, steps=a.steps, seed=seed,
                    policy=replace(base.policy, model=model, warmup_steps=0,
                                   warmup_bare_tool_steps=0),
                    algo=replace(base.algo, stale_groups=groups),
                    rollout=replace(base.rollout, max_in_flight=in_flight,
                                    take_window=window, stale_members=members))
    t0 = time.time()
    result = _train(graph, a, tmp / f"{setting}-{seed}", a.eval_seeds)
    trained = result.evaluation["trained"]
    gains = {t.name: trained[t.name] - warm[t.name] for t in base.tasks}
    print(f"  {setting:11s} seed {seed}: gains " + " ".join(f"{t}={g:+.3f}" for t, g in
                                                             gains.items())
          + f" ({time.time() - t0:.0f}s)", flush=True)
    return gains


def _train(graph, a, run_dir: Path, eval_seeds: int):
    """``rollart.train`` on the graph's resources, in process (as its CI learning test)."""
    from distributed import Client

    import rollart
    from rollart.runtime.resources import load_resources

    res = replace(load_resources(GRAPHS[a.graph]["resources"]), processes=False,
                  dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        return rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                             eval_seeds=eval_seeds)


def _heldout(model: str, base, a) -> dict:
    from rollart.observe.evaluate import evaluate
    from rollart.types import EVAL_SEED_BASE

    seeds = range(EVAL_SEED_BASE, EVAL_SEED_BASE + a.eval_seeds)
    return evaluate(model, base.tasks, seeds, **base.policy.conversation_options())


def warm_up(a, base, tmp: str, seed: int) -> dict:
    """The warm-up model and its held-out success. The default graph: the pipeline
    benchmark's cached one (``--quick``: a short warm-up of its own in ``tmp``), the same
    for every seed. The chat graph: its own two-stage warm-up on ``seed`` (a one-step
    run whose ``warmup_model`` is kept; ``--quick``: a few format steps)."""
    if a.graph == "chat":
        graph = replace(base, steps=1, seed=seed)
        if a.quick:
            graph = replace(graph, policy=replace(base.policy, warmup_steps=CHAT_QUICK_WARMUP,
                                                  warmup_bare_tool_steps=0))
        t0 = time.time()
        model = _train(graph, a, Path(tmp) / f"warmup-{seed}", 0).warmup_model_dir
        how = f"warmed up on seed {seed} in {time.time() - t0:.0f}s"
    else:
        from pipeline import WARM_CACHE, cached_warm_model

        model, reused = cached_warm_model(tmp if a.quick else WARM_CACHE, base.tasks,
                                          20 if a.quick else base.policy.warmup_steps)
        how = "reused" if reused else "built"
    heldout = _heldout(model, base, a)
    print(f"warm-up model {model} ({how}): held-out {heldout}", flush=True)
    return {"model": model, "heldout": heldout}


def summarise(runs: dict, tasks) -> dict:
    """``{setting: [gains per task, one dict per seed]}`` -> the RESULT figures."""
    out = {}
    for s, per_seed in runs.items():
        if not per_seed:
            continue
        means = [sum(g.values()) / len(g) for g in per_seed]
        out[f"gain_{s}"] = statistics.median(means)
        out[f"gain_{s}_min"], out[f"gain_{s}_max"] = min(means), max(means)
        for t in tasks:
            out[f"{t}_{s}"] = statistics.median(g[t] for g in per_seed)
        out[f"worst_{s}"] = statistics.median(min(g.values()) for g in per_seed)
    return out


def main(argv=None) -> dict:
    a = parse(argv)
    run = Run("inflight_learning", a, argv)
    import rollart
    from rollart.app.cli import quiet

    quiet()
    spec = GRAPHS[a.graph]
    base, _ = rollart.load_graph(spec["graph"])
    tasks = [t.name for t in base.tasks]
    t_all = time.time()
    runs: dict = {s: [] for s in a.settings}
    warms: list = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            if a.graph == "chat" or not warms:
                warms.append(warm_up(a, base, tmp, seed))
            warm = warms[-1]
            order = random.Random(seed).sample(list(a.settings), len(a.settings))
            print(f"seed {seed}: order {' '.join(order)}", flush=True)
            for s in order:
                runs[s].append(run_one(base, warm["model"], warm["heldout"], s, seed, a,
                                       Path(tmp)))
            part = summarise(runs, tasks)
            print("PARTIAL " + " ".join(f"{k}={v:.3f}" for k, v in part.items()), flush=True)
    out = summarise(runs, tasks)
    # the warm-up policy's held-out success (the median over seeds' warm-ups for chat)
    out.update(seeds=a.seeds, steps=a.steps, eval_seeds=a.eval_seeds, graph=a.graph,
               **{f"warm_{t}": statistics.median(w["heldout"][t] for w in warms)
                  for t in tasks},
               total_s=round(time.time() - t_all))
    run.result(out, {"runs": runs, "warmup": [w["heldout"] for w in warms]})
    return out


if __name__ == "__main__":
    main()
