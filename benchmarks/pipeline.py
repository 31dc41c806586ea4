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
run each checkpoint's policy is evaluated on held-out seeds
(``rollart.observe.evaluate.evaluate``, seeds from ``rollart.types.EVAL_SEED_BASE``).

**The clock** is the same for every mode: the training clock, the metrics rows'
``time``: seconds from the start of step 1 (after the actors started and loaded the
warm-up model, which every mode does alike and off the clock) to the end of a step, the
checkpoint writes of earlier steps included (every mode writes the same checkpoints at
the same steps; what a mode does meanwhile, e.g. async rollout going on, is its own).
Held-out evaluation is never on it: it runs after the run, from the checkpoints, for
every mode. A run's *time to target* is the clock at the first checkpoint at or above
the target held-out success, which is fixed before any run: the warm-up policy's
held-out success + ``TARGET_MARGIN``. A run that never gets there counts ``inf``.

**The headline is paired**: per seed, baseline X's time to target ÷ async's on the same
seed (same workload, same group sequence); ``speedup_vs_X_paired`` is the median of
those ratios, ``_min``/``_max`` their range, ``wins_vs_X`` the seeds where async got
there strictly first, of ``pairs_vs_X`` (``paired``: a seed where only async reached the
target is a win, ratio ``inf``; only X, a loss, ratio 0; neither, a tie, ratio 1; none
is dropped; a seed where a run failed is no pair and ``failed_runs`` counts it).

**In-flight budgets.** ``areal`` runs at its own default (AReaL's start bound, about two
steps' worth of groups) and ``areal@async`` with ``Rollout.max_in_flight`` set to
async's budget (``async_budget``: ``slot_capacity`` in steps' worth), so both the
default-vs-default and the equal-budget ratios are printed. ``inflight_<mode>`` is the
groups each run actually held in flight or buffered, averaged over its time
(``rollout/slots_held_s`` ÷ ``rollout/slots_open_s`` of its last row, in steps' worth),
median over seeds.

**Other settings of async** run beside its default as labels (``VARIANTS``). The default
(``Rollout.max_in_flight`` and ``stale_members`` unset: ``Graph.max_in_flight`` "auto",
``Graph.stale_members`` "rescore") is ``async``; ``async@one`` is the earlier default
(one step's worth of groups, stale members aborted), ``async@auto`` the adaptive limit
with stale members aborted, ``async@rescore`` one step's worth with them re-scored,
``async@completion`` the default taking complete groups in the order they complete
(``Rollout.take_window=math.inf``, as areal does) instead of the order they started,
``async@window15`` the default taking any complete group among the oldest one and a half
steps' worth (``Rollout.take_window=1.5``), ``async@keep`` the default keeping a complete
group that went too stale waiting for its take, its old tokens re-scored by the trainer
(``GRPO.stale_groups="rescore"``), instead of dropping it, ``async@completion_keep``
both: completion order, no group dropped as too stale; ``async@completion_clip`` the
same with the kept group trained as it is (``GRPO.stale_groups="clip"``: its true
behaviour log-probs under the PPO clip, as areal trains it) instead of re-scored.
``--ours LABEL`` makes one of them the headline: every paired ratio is then against it,
the default async included (``speedup_vs_async_paired``), and the RESULT line says
``ours=LABEL``::

    python benchmarks/pipeline.py --redundant '' --eval-seeds 128 \
        --modes async,async@one,sync+,areal,areal@async

The headline runs have no redundant members (every mode alike); the modes that can use
redundancy (``REDUNDANT_MODES``: their groups run on their own; ``sync`` and ``one-off``
move a batch turn by turn) also run with ``--redundancy`` extras per group, reported
beside them as ``<mode>@r`` (``--redundant``; the full run does all three, ``--quick``
none, to fit its time). Ends with

    RESULT speedup_vs_syncplus_paired=… wins_vs_syncplus=… pairs_vs_syncplus=…
           speedup_vs_areal_paired=… wins_vs_areal=… … inflight_async=… inflight_areal=…
           speedup_vs_syncplus=… speedup_vs_sync=… … seeds=… target=… …

Each run in the record also carries ``steps``: where its time and learning went, step
by step (``benchmarks/_pipeline_steps.run_figures``: seconds a step and the trainer's
wait, the engine's busy share, steps to the target, early staleness, clip share and KL,
trainable groups and entropy per task). ``--keep-rows DIR`` keeps the rows themselves.

The other figures are kept from before the paired figures (old records render with
them): ``speedup_vs_X`` = X's median time to target ÷ async's (a ratio of medians);
``throughput_vs_sync`` = async's median trained trajectories/s ÷ sync's; ``heldout_*``
= the median held-out success of each mode's last checkpoint. A script, not a test.

    python benchmarks/pipeline.py --quick
    python benchmarks/pipeline.py --redundant '' --eval-seeds 128   # the headline
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

from _pipeline_steps import run_figures  # noqa: E402
from _results import Run, add_arguments, fill  # noqa: E402

MODES = ("sync", "sync+", "one-off", "areal", "async")
AT_ASYNC = "areal@async"  # areal with Rollout.max_in_flight at async's budget
#: async with settings other than its default, run beside it (``--modes async,async@one,…``)
#: and made the headline with ``--ours``: the earlier default (``one``) and each half of
#: the present one (an adaptive limit: ``auto``; stale members re-scored: ``rescore``)
VARIANTS = {"async@one": {"max_in_flight": 1.0, "stale_members": "abort"},
            "async@auto": {"max_in_flight": "auto", "stale_members": "abort"},
            "async@rescore": {"max_in_flight": 1.0, "stale_members": "rescore"},
            # the default taking complete groups as they complete, as areal does
            "async@completion": {"take_window": math.inf},
            # the default taking any of the oldest one and a half steps' worth
            "async@window15": {"take_window": 1.5},
            # the default keeping a complete group that went too stale waiting for its
            # take, its old tokens re-scored by the trainer (GRPO.stale_groups), not
            # dropped and run again; alone, and taking in completion order
            "async@keep": {"algo": {"stale_groups": "rescore"}},
            "async@completion_keep": {"take_window": math.inf,
                                      "algo": {"stale_groups": "rescore"}},
            # completion order, the kept group trained as it is (its true behaviour
            # log-probs under the PPO clip, as areal trains it), not re-scored
            "async@completion_clip": {"take_window": math.inf,
                                      "algo": {"stale_groups": "clip"}}}
LABELS = MODES + (AT_ASYNC,) + tuple(VARIANTS)
REDUNDANT_MODES = ("sync+", "areal", "async")  # the modes whose groups run on their own
TARGET_MARGIN = 0.10  # target = warm-up held-out success + this (fixed before any run)
BASELINES = {"syncplus": "sync+", "sync": "sync", "oneoff": "one-off", "areal": "areal"}
# the paired comparisons, headline first: key -> the label async is compared with
PAIRED = {"syncplus": "sync+", "areal": "areal", "areal_at_async": AT_ASYNC,
          "sync": "sync", "oneoff": "one-off"}
# sized (before any measurement) so that --quick fits ~13 minutes of a 2-core machine
QUICK = {"steps": 10, "every": 2, "groups": 6, "eval_seeds": 32, "seeds": 3,
         "redundant": "", "modes": ",".join(MODES)}
FULL = {"steps": 30, "every": 3, "groups": 12, "eval_seeds": 64, "seeds": 5,
        "redundant": ",".join(REDUNDANT_MODES), "modes": ",".join(MODES + (AT_ASYNC,))}
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
    seconds; reported as ``ckpt_s``, and on the clock of every mode alike: module doc).
    The real ``save`` runs unchanged."""
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


def clock(rows: list[dict]) -> dict[int, float]:
    """Step -> the training clock when the step finished: the row's ``time``, the same
    for every mode (module doc: start-up off it, earlier checkpoint writes on it)."""
    return {r["step"]: r["time"] for r in rows}


def in_flight(row: dict, groups: int) -> float:
    """The groups a run held in flight or buffered, averaged over the time its slots
    were open, in steps' worth (``groups`` per step), from its last metrics ``row``;
    nan for a lockstep mode (no slots)."""
    open_s = row.get("rollout/slots_open_s") or 0
    return row.get("rollout/slots_held_s", 0) / open_s / groups if open_s else math.nan


def async_budget(graph) -> float | str:
    """Async's in-flight budget for ``graph`` (``areal@async``'s ``max_in_flight``):
    ``"auto"`` when async adapts it (its default: areal's limit then adapts by the same
    rule under its own start bound), else its slots in steps' worth of groups
    (``rollart.policy.admission.slot_capacity``)."""
    from rollart.policy.admission import AUTO, slot_capacity

    g = replace(graph, mode="async")
    if g.max_in_flight == AUTO:
        return AUTO
    return slot_capacity(g.algo, g.max_in_flight) / g.algo.groups_per_step


def label_graph(base, tasks, model: str, label: str, seed: int, a):
    """The graph of run ``label``: a mode, ``<mode>@r`` (with redundancy),
    ``areal@async`` (areal at async's in-flight budget) or an async variant
    (``VARIANTS``: its ``Rollout`` settings, and ``GRPO``'s under ``"algo"``, over the
    run's)."""
    mode, _, tag = label.partition("@")
    graph = replace(base, tasks=tasks, mode=mode, steps=a.steps, seed=seed,
                    checkpoint_every=a.every,
                    policy=replace(base.policy, model=model, weight_update=a.weight_update),
                    algo=replace(base.algo, groups_per_step=a.groups, alpha=None,
                                 lr=base.algo.lr if a.lr is None else a.lr),
                    rollout=replace(base.rollout,
                                    redundancy=a.redundancy if tag == "r" else 1.0,
                                    max_in_flight=a.max_in_flight,
                                    take_window=a.take_window))
    if tag == "async":
        graph = replace(graph, rollout=replace(graph.rollout,
                                               max_in_flight=async_budget(graph)))
    if label in VARIANTS:
        variant = dict(VARIANTS[label])
        algo = variant.pop("algo", None)  # GRPO fields; the rest are Rollout's
        graph = replace(graph, rollout=replace(graph.rollout, **variant))
        if algo:
            graph = replace(graph, algo=replace(graph.algo, alpha=None, **algo))
    return graph


def run_one(client, base, tasks, model: str, label: str, seed: int, a, out: Path) -> dict:
    """Train one run (``label_graph``) from ``model``; returns its clock and checkpoints."""
    import rollart
    from rollart.chaos.workload import drain_pools, pool_stats

    graph = label_graph(base, tasks, model, label, seed, a)
    client.run(drain_pools, on_error="return")  # no run inherits another's warm sandboxes
    ckpt_s: dict[int, float] = {}
    run_dir = out / f"{short(label)}-seed{seed}"
    with timed_checkpoints(ckpt_s):
        result = rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                               eval_seeds=0)
    env = _sum_stats(client.run(pool_stats, on_error="return"))
    rows = result.metrics
    t = clock(rows)
    last = rows[-1]
    snaps = sorted((int(p.name.split("-")[1]), str(p / "model"))
                   for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    return {"label": label, "seed": seed, "clock": t, "snapshots": snaps,
            "traj_per_s": last["traj/trained"] / t[last["step"]],
            "wall_s": t[last["step"]], "ckpt_s": sum(ckpt_s.values()),
            "inflight": in_flight(last, a.groups),
            "fail_per_step": env.get("reset_failures", 0) / max(env.get("steps", 0), 1),
            "reuse": env.get("reused", 0) / max(env.get("resets", 0), 1),
            # weight swaps that met rows generating, and the tokens re-prefilled after them
            "suspends": last.get("rollout/suspends", 0),
            "recompute_tokens": last.get("rollout/recompute_tokens", 0),
            # where the time went: the trainer waiting for a batch, the take waiting for
            # a version; and the work thrown away or re-scored
            "trainer_wait_s": sum(r.get("trainer/wait_s", 0) or 0 for r in rows),
            "version_wait_s": sum(r.get("rollout/version_wait_s", 0) or 0 for r in rows),
            "dropped": last.get("traj/dropped", 0), "aborted": last.get("traj/aborted", 0),
            "wasted_share": last.get("rollout/wasted_share", 0),
            "rescored_tokens": last.get("rollout/rescored_tokens", 0),
            # tokens of complete groups kept past the bound, re-scored by the trainer
            "trainer_rescored_tokens": sum(r.get("trainer/rescored_tokens", 0) or 0
                                           for r in rows),
            "run_dir": str(run_dir), "rows": rows}


def keep_rows(folder: str | None, run: dict) -> None:
    """With ``--keep-rows``: the run's metrics rows, clock and whole held-out curve as
    ``folder/<label>-seed<N>.json``, to compare modes step by step."""
    rows = run.pop("rows")
    if not folder:
        return
    import json

    path = Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in run.items() if k not in ("snapshots", "run_dir")}
    (path / f"{short(run['label'])}-seed{run['seed']}.json").write_text(
        json.dumps(dict(keep, rows=rows), default=str))


def _sum_stats(per_worker: dict) -> dict:
    out: dict[str, float] = {}
    for stats in per_worker.values():
        if isinstance(stats, BaseException):
            continue  # a worker that was gone
        for k, v in stats.items():
            out[k] = out.get(k, 0) + v
    return out


def score(run: dict, tasks, seeds, target: float, whole: bool = False, **opts) -> dict:
    """Evaluate the run's checkpoints in step order until one reaches ``target`` (every
    one with ``whole``), and its last one; time to target (inf if none did) and the
    last held-out success (the mean over ``tasks``; ``opts``: ``evaluate``'s
    conversation options, a real model's chat template)."""
    from rollart.observe.evaluate import evaluate

    def heldout(path):
        success = evaluate(path, tasks, seeds, **opts)
        return sum(success.values()) / len(success)

    run["time_to_target_s"], run["curve"] = math.inf, {}
    for step, path in run["snapshots"]:
        run["curve"][step] = heldout(path)
        if run["curve"][step] >= target and math.isinf(run["time_to_target_s"]):
            run["time_to_target_s"] = run["clock"][step]
        if not math.isinf(run["time_to_target_s"]) and not whole:
            break
    last_step, last_path = run["snapshots"][-1]
    if last_step not in run["curve"]:
        run["curve"][last_step] = heldout(last_path)
    run["heldout"] = run["curve"][last_step]
    shutil.rmtree(run["run_dir"], ignore_errors=True)  # checkpoints are large
    return run


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def short(label: str) -> str:
    """A label as a key: ``sync+`` -> ``syncplus``, ``one-off`` -> ``oneoff``, ``async@r``
    -> ``async_r``, ``areal@async`` -> ``areal_at_async``."""
    mode, _, tag = label.partition("@")
    mode = mode.replace("+", "plus").replace("-", "")
    return mode + {"": "", "r": "_r"}.get(tag, f"_at_{tag}")


def paired(theirs: dict, ours: dict) -> dict:
    """Time to target, seed by seed (``theirs``: a baseline's, ``ours``: async's; seed ->
    seconds, ``inf`` where the run never reached the target), on the seeds both ran:
    the median, least and greatest of the ratios theirs ÷ ours, the ``wins`` (seeds
    where async got there strictly first) and the ``pairs``. Where only async reached
    the target the ratio is ``inf`` (a win); only the baseline, 0 (a loss); neither, 1
    (a tie: neither got there within the run). No pair is dropped.

    >>> p = paired({1: 20.0, 2: 30.0, 3: float("inf"), 4: 5.0},
    ...            {1: 10.0, 2: 40.0, 3: 9.0, 4: float("inf")})
    >>> p["ratios"], p["median"], p["wins"], p["pairs"]
    ([2.0, 0.75, inf, 0.0], 1.375, 2, 4)
    """
    ratios = []
    for seed in sorted(set(theirs) & set(ours)):
        t, o = theirs[seed], ours[seed]
        ratios.append(1.0 if math.isinf(t) and math.isinf(o) else
                      math.inf if math.isinf(t) else t / o)
    lo, hi = (min(ratios), max(ratios)) if ratios else (math.nan, math.nan)
    return {"ratios": ratios, "median": _median(ratios), "min": lo, "max": hi,
            "wins": sum(r > 1 for r in ratios), "pairs": len(ratios)}


def summarise(runs: list[dict], seeds: list[int], ours: str = "async") -> dict:
    """The RESULT figures from every scored run (module doc); the paired ratios are
    the other runs' times ÷ ``ours``' (``--ours``: async's default, or a variant): the
    baselines', then those of async (when a variant is ``ours``) and of each variant
    that ran (``speedup_vs_async_at_one_paired`` > 1: ``ours`` got there first)."""
    by = {}
    for r in runs:
        by.setdefault(r["label"], {})[r["seed"]] = r

    def med(label, key):
        return _median([r[key] for r in by.get(label, {}).values()])

    def per_seed(label, key) -> dict:
        return {s: r[key] for s, r in by.get(label, {}).items() if s in seeds}

    def ratios(num: str, den: str, key: str) -> list[float]:
        return [_ratio(by[num][s][key], by[den][s][key]) for s in seeds
                if s in by.get(num, {}) and s in by.get(den, {})]

    out, pairs = {}, {}
    # the baselines, then the default and the variants that ran beside ``ours``
    against = dict(PAIRED, **{short(v): v for v in ("async",) + tuple(VARIANTS)
                              if v != ours and v in by})
    for key, label in against.items():
        p = pairs[key] = paired(per_seed(label, "time_to_target_s"),
                                per_seed(ours, "time_to_target_s"))
        out[f"speedup_vs_{key}_paired"] = p["median"]
        out[f"wins_vs_{key}"], out[f"pairs_vs_{key}"] = p["wins"], p["pairs"]
    for label in dict.fromkeys(("async", ours, "areal", AT_ASYNC)):
        out[f"inflight_{short(label)}"] = med(label, "inflight") if label in by else math.nan
    for short_name, mode in BASELINES.items():
        out[f"speedup_vs_{short_name}"] = _ratio(med(mode, "time_to_target_s"),
                                                 med("async", "time_to_target_s"))
    out["throughput_vs_sync"] = med("async", "traj_per_s") / med("sync", "traj_per_s")
    out["heldout_async"] = med("async", "heldout")
    out["heldout_syncplus"] = med("sync+", "heldout")
    out["seeds"] = len(seeds)
    out["target"] = math.nan  # set by main (kept here for the key order)
    for key in against:  # the paired ratios' range
        out[f"speedup_vs_{key}_min"] = pairs[key]["min"]
        out[f"speedup_vs_{key}_max"] = pairs[key]["max"]
    per = ratios("async", "sync", "traj_per_s")
    out["throughput_vs_sync_min"], out["throughput_vs_sync_max"] = _range(per)
    for label in by:
        out[f"ttt_{short(label)}"] = med(label, "time_to_target_s")
        out[f"tps_{short(label)}"] = med(label, "traj_per_s")
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
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, of {LABELS} (default: {MODES + (AT_ASYNC,)}; "
                        f"--quick: all but {AT_ASYNC})")
    p.add_argument("--resources", default="laptop",
                   help="the layout (resources/NAME.py): laptop (rollout, envs and "
                        "rewards in one worker) or laptop_engine (the engine in a worker "
                        "of its own)")
    p.add_argument("--ours", default="async",
                   help="the run whose paired ratios are the headline: async (its "
                        f"default) or a variant among --modes, of {tuple(VARIANTS)}")
    p.add_argument("--redundant", default=None,
                   help="modes also run with redundancy (of REDUNDANT_MODES; '' = none)")
    p.add_argument("--max-in-flight", type=float, default=None,
                   help="Rollout.max_in_flight for async and areal (steps' worth of groups "
                        "in flight at once; default: async max(alpha, 1), areal its start "
                        "bound)")
    p.add_argument("--take-window", type=float, default=None,
                   help="Rollout.take_window for async and areal: take groups in start "
                        "order within this many steps' worth (default: each mode's own: "
                        "async's one step's worth under \"auto\", areal completion order)")
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
    p.add_argument("--lr", type=float, default=None,
                   help="GRPO.lr for every mode alike (default: the graph's; a diagnostic "
                   "setting, printed as lr= in the RESULT line)")
    p.add_argument("--keep-rows", default=None, metavar="DIR",
                   help="write each run's metrics rows and its held-out success at every "
                   "checkpoint to DIR/<label>-seed<N>.json (evaluates every checkpoint, "
                   "not only until the target)")
    add_arguments(p)
    a = p.parse_args(argv)
    fill(a, QUICK if a.quick else FULL)
    a.modes = tuple(m for m in a.modes.split(",") if m)
    a.redundant = tuple(m for m in a.redundant.split(",") if m)
    bad = [m for m in a.modes if m not in LABELS] + \
        [m for m in a.redundant if m not in REDUNDANT_MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}: --modes takes {LABELS}, --redundant "
                f"{REDUNDANT_MODES}")
    if a.ours != "async" and (a.ours not in VARIANTS or a.ours not in a.modes
                              or "async" not in a.modes):
        p.error(f"--ours {a.ours}: name an async variant of {tuple(VARIANTS)} that "
                f"--modes runs beside async itself")
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


def same_priorities(client, label: str, seed: int) -> None:
    """Every run starts from the cluster's own priorities (an asynchronous run nices its
    rollout workers and gives it back at its end: ``rollart.runtime.priority``); raise
    naming the workers that were left otherwise."""
    from rollart.runtime.priority import thread_nices

    mine = [os.getpriority(os.PRIO_PROCESS, 0)]  # the workers' own, inherited
    nices = {w: sorted(set(n)) for w, n in client.run(thread_nices).items()}
    if any(n != mine for n in nices.values()):
        raise RuntimeError(f"before {label}/{seed}: worker priorities are not the "
                           f"cluster's start (nice {mine[0]}): {nices}")


def run_seed(client, base, model, labels, seed, a, tmp, heldout_seeds, target,
             runs: list, failed: list) -> None:
    """Every run of one seed, in an order shuffled by ``random.Random(seed)``."""
    from rollart.chaos.workload import Workload, with_workload

    order = random.Random(seed).sample(labels, len(labels))
    print(f"seed {seed}: order {' '.join(order)}", flush=True)
    tasks = tuple(with_workload(t, Workload(seed=seed)) for t in base.tasks)
    for label in order:
        t0 = time.time()
        same_priorities(client, label, seed)
        try:
            run = run_one(client, base, tasks, model, label, seed, a, Path(tmp))
        except Exception as e:  # noqa: BLE001 - reported, counted, the rest go on
            print(f"  {label:9s} FAILED: {type(e).__name__}: {e}"[:2000], flush=True)
            failed.append(f"{label}/{seed}")
            continue
        runs.append(score(run, base.tasks, heldout_seeds, target, whole=bool(a.keep_rows)))
        # where the run's time and learning went, step by step (benchmarks/_pipeline_steps)
        run["steps"] = run_figures(run, target)
        keep_rows(a.keep_rows, run)
        print(f"  {label:9s} time_to_target_s={fmt(run['time_to_target_s'])} "
              f"traj_per_s={fmt(run['traj_per_s'])} heldout={fmt(run['heldout'])} "
              f"wall_s={fmt(run['wall_s'])} ckpt_s={fmt(run['ckpt_s'])} "
              f"inflight={fmt(run['inflight'])} "
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
            rollart.load_resources(a.resources).make_cluster() as cluster, \
            Client(cluster) as client:
        model, warm, target = warm_up(a, base.tasks, heldout_seeds, tmp)
        for i, seed in enumerate(seeds):
            run_seed(client, base, model, labels, seed, a, tmp, heldout_seeds, target,
                     runs, failed)
            if i + 1 < len(seeds):  # figures so far, in case the run is cut short
                part = summarise(runs, seeds[:i + 1], a.ours)
                print("PARTIAL " + " ".join(f"{k}={fmt(v)}" for k, v in part.items()
                                            if k != "target"), flush=True)
    out = summarise(runs, seeds, a.ours)
    out.update(ours=a.ours, resources=a.resources,
               inflight=a.max_in_flight if a.max_in_flight is not None else "mode",
               budget_areal_at_async=async_budget(label_graph(base, base.tasks, model, "async",
                                                              1, a)),
               # None: each mode's own (async under "auto": start order, one step's
               # worth; areal: completion order)
               order="mode" if a.take_window is None else f"start{a.take_window:g}",
               weight_update=a.weight_update,
               lr=a.lr if a.lr is not None else base.algo.lr,
               target=target, failed_runs=len(failed),
               heldout_warm=warm, margin=a.margin,
               steps=a.steps, groups=a.groups, eval_seeds=a.eval_seeds,
               total_s=round(time.time() - t_all))
    keys = ("label", "seed", "time_to_target_s", "heldout", "traj_per_s", "wall_s",
            "ckpt_s", "inflight", "suspends", "recompute_tokens", "trainer_wait_s",
            "version_wait_s", "dropped", "aborted", "wasted_share", "rescored_tokens",
            "trainer_rescored_tokens", "steps")
    run.result(out, {"runs": [{k: r.get(k) for k in keys} for r in runs]}, fmt=fmt)
    return out


if __name__ == "__main__":
    main()
