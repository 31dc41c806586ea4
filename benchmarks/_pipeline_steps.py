"""Step by step: where one mode of ``pipeline.py`` gains on another, from its kept rows.

Reads the folder ``pipeline.py --keep-rows DIR`` wrote (``<label>-seed<N>.json``: a
run's metrics rows and its held-out success at every checkpoint) and prints, per label,
the median over its seeds of:

* speed: seconds a step (``s_step``), of those the trainer waiting for its batch
  (``wait_step``), the engine's busy share of the run (``engine_busy``), the mean
  in-flight limit in groups (``limit``) and the groups dropped as stale (``dropped``);
* learning per step: the first checkpoint step at or above the target
  (``steps_to_target``; the target is ``--target``, the warm-up's + 0.10 as
  ``pipeline.py`` printed it) and the clock then (``time_to_target_s``, as
  ``pipeline.py`` scored it), the held-out success at the last one (``final``);
* how far each step moves the policy early (steps ``--early``): the KL to the
  reference (``kl_early``), the share of tokens the PPO clip held (``clip_early``), the
  staleness (``stale_early``);
* what the batches could teach: per task, the share of its groups with unequal
  rewards over steps 3–15 (``trainable_<task>``) and the sampled tokens' entropy
  estimate over those steps (``entropy_<task>``, ``trainer/entropy``'s per-task key).

A script, not a test; it reads kept rows and measures nothing itself::

    python benchmarks/pipeline.py --redundant '' --eval-seeds 128 --modes areal,async \\
        --seeds 5 --keep-rows runs/pipeline-rows --no-record
    python benchmarks/_pipeline_steps.py runs/pipeline-rows --target 0.397

Ends with ``RESULT <key>_<label>=… …`` for every key above (labels as ``pipeline.py``
names them: ``async_at_keep`` for ``async@keep``). ``--save "COMMAND"`` appends them,
each seed's own figures beside, to ``benchmarks/results/pipeline_steps.jsonl`` as data:
COMMAND is the ``pipeline.py`` command that wrote the rows, ``--at`` the commit it ran
(default HEAD) and the record's date the newest kept file's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

EARLY = (2, 6)  # trainer steps, inclusive: the first updates after the untrained batch
TRAINABLE = (3, 15)  # trainer steps, inclusive: batches drawn from policies already moved


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def _within(rows: list[dict], span: tuple[int, int]) -> list[dict]:
    return [r for r in rows if span[0] <= r["step"] <= span[1]]


def run_figures(run: dict, target: float, early=EARLY) -> dict:
    """One kept run's figures (module docstring)."""
    rows = run["rows"]
    last = rows[-1]
    curve = {int(k): v for k, v in run["curve"].items()}
    reached = [s for s in sorted(curve) if curve[s] >= target]
    out = {"s_step": last["time"] / last["step"],
           "wait_step": _mean(r.get("trainer/wait_s") for r in rows),
           "engine_busy": (last.get("rollout/engine_busy_s") or 0) / last["time"],
           "limit": _mean(r.get("rollout/inflight_limit") for r in rows),
           "dropped": last.get("traj/dropped", 0) or 0,
           "steps_to_target": reached[0] if reached else math.inf,
           "time_to_target_s": run.get("time_to_target_s", math.nan),
           "final": curve[max(curve)]}
    first = _within(rows, early)
    for key, name in (("trainer/kl", "kl_early"), ("trainer/clip_frac", "clip_early"),
                      ("trainer/staleness_mean", "stale_early")):
        out[name] = _mean(r.get(key) for r in first)
    window = _within(rows, TRAINABLE)
    tasks = sorted(k.split("/", 2)[2] for k in last if k.startswith("trainer/rows/"))
    for task in tasks:
        groups = sum((r.get(f"trainer/rows/{task}") or 0) for r in window)
        trainable = sum((r.get(f"trainer/trainable_groups/{task}") or 0) for r in window)
        size = run.get("group_size", 8)
        out[f"trainable_{task}"] = trainable / (groups / size) if groups else math.nan
        out[f"entropy_{task}"] = _mean(r.get(f"entropy/{task}") for r in window)
    return out


def per_seed(folder: Path, target: float, early=EARLY) -> dict[str, dict[int, dict]]:
    """label -> seed -> that run's figures (``run_figures``)."""
    per: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in sorted(folder.glob("*-seed*.json")):
        label, seed = path.stem.rsplit("-seed", 1)
        per[label][int(seed)] = run_figures(json.loads(path.read_text()), target, early)
    if not per:
        raise SystemExit(f"{folder}: no <label>-seed<N>.json files (write them with "
                         "pipeline.py --keep-rows)")
    return dict(sorted(per.items()))


def summarise(folder: Path, target: float, early=EARLY) -> dict[str, dict]:
    """label -> key -> the median over the label's seeds (module docstring)."""
    return {label: {k: statistics.median(f[k] for f in runs.values())
                    for k in next(iter(runs.values()))}
            for label, runs in per_seed(folder, target, early).items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="the folder pipeline.py --keep-rows wrote")
    p.add_argument("--target", type=float, required=True,
                   help="held-out success a run must reach (pipeline.py prints it: "
                   "'warm-up held-out success … -> target …')")
    p.add_argument("--early", default=f"{EARLY[0]}-{EARLY[1]}",
                   help="trainer steps FIRST-LAST of the early figures")
    p.add_argument("--save", metavar="COMMAND", default=None,
                   help="append the figures to benchmarks/results/pipeline_steps.jsonl, "
                   "COMMAND being the pipeline.py command that kept the rows")
    p.add_argument("--at", default=None, help="the commit that command ran (with --save)")
    a = p.parse_args(argv)
    early = tuple(int(x) for x in a.early.split("-"))
    out = summarise(Path(a.folder), a.target, early)
    if a.save:
        save(Path(a.folder), a, early, out, argv)
    keys = list(next(iter(out.values())))
    print("key".ljust(18) + "".join(label.rjust(14) for label in out))
    for k in keys:
        print(k.ljust(18) + "".join(f"{out[label][k]:14.3f}" for label in out))
    flat = {f"{k}_{label}": round(v, 4) for label, figs in out.items() for k, v in figs.items()}
    print("RESULT " + " ".join(f"{k}={v}" for k, v in flat.items()) +
          f" target={a.target} early={a.early}")
    return out


def save(folder: Path, a, early, medians: dict, argv) -> Path:
    """Append the figures (the medians and each seed's) to
    ``benchmarks/results/pipeline_steps.jsonl`` (``_results.record``)."""
    from _results import record  # beside this file: on sys.path as the script's folder

    newest = max(p.stat().st_mtime for p in folder.glob("*-seed*.json"))
    date = datetime.datetime.fromtimestamp(newest, datetime.timezone.utc)
    runs = per_seed(folder, a.target, early)
    fields = {"rows_command": a.save, "target": a.target, "early": list(early),
              "medians": medians,
              "runs": [dict(label=label, seed=seed, **figs)
                       for label, seeds in runs.items() for seed, figs in seeds.items()]}
    return record("pipeline_steps", date.isoformat(timespec="seconds"), None, fields,
                  argv=[str(folder), "--target", str(a.target)], at=a.at)


if __name__ == "__main__":
    main()
