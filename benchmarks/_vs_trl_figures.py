"""The figures of ``benchmarks/vs_trl.py``, apart from its runs: time to the held-out
target, speed-ups against TRL, per-workload ratios and verdicts, medians over seeds, and
the ``--aggregate`` of several runs' RESULT lines. Pure functions of the runs' rows and
held-out curves (no TRL, no cluster); ``vs_trl.py`` imports them, and so do its tests
through it.
"""

from __future__ import annotations

import math
from pathlib import Path

MODES = ("sync+", "sync", "async")  # the rollart modes compared with TRL


def time_to(curve, target: float) -> float:
    """The wall time of the first snapshot at or above ``target`` (inf: never).

    >>> time_to([(0, 0.0, 0.3), (10, 12.5, 0.45), (20, 30.0, 0.55)], 0.5)
    30.0
    """
    return next((t for _, t, v in curve if v >= target), math.inf)


def speedup(t_trl: float, t_mode: float) -> float:
    """TRL's time ÷ the mode's; a runner that missed the target has time inf (both
    missed: nan).

    >>> speedup(60.0, 20.0), speedup(math.inf, 20.0), speedup(60.0, math.inf)
    (3.0, inf, 0.0)
    """
    if math.isinf(t_trl) and math.isinf(t_mode):
        return math.nan
    return t_trl / t_mode


def summarise(rows: list[dict], curve, batch_size: int, target: float) -> dict:
    """Time to the held-out target, held-out success, throughput, wall time."""
    wall = rows[-1]["time"]
    return {"time_to_target_s": time_to(curve, target), "heldout_final": curve[-1][2],
            "heldout_best": max(v for _, _, v in curve),
            "final_reward": sum(r["reward/mean"] for r in rows[-5:]) / len(rows[-5:]),
            "tokens_per_s": rows[-1]["rollout/tokens_generated"] / wall,
            "traj_per_s": len(rows) * batch_size / wall, "wall_s": wall,
            "steps": len(rows), "curve": curve}


def key(runner: str) -> str:
    return runner.replace("+", "plus")


def ratios(runs: dict) -> dict:
    """One workload's figures: each rollart mode against TRL (time: TRL ÷ mode, so > 1
    means rollart reached the target sooner; throughput: mode ÷ TRL), and every
    runner's own time, held-out success and trained trajectories/s (``tps_``)."""
    trl = runs["trl"]
    out = {f"t_{key(r)}": run["time_to_target_s"] for r, run in runs.items()}
    out.update({f"heldout_{key(r)}": run["heldout_final"] for r, run in runs.items()})
    out.update({f"tps_{key(r)}": run["traj_per_s"] for r, run in runs.items()})
    for m in (r for r in runs if r != "trl"):
        out[f"speedup_{key(m)}"] = speedup(trl["time_to_target_s"], runs[m]["time_to_target_s"])
        out[f"throughput_{key(m)}"] = runs[m]["traj_per_s"] / trl["traj_per_s"]
    return out


def verdict(figures: dict, workload: str, modes) -> dict:
    """Which rollart mode reached the target soonest (median times) and which modes TRL
    beat; ``none`` when no mode reached it."""
    times = {m: figures[f"t_{key(m)}_{workload}"] for m in modes}
    reached = {m: t for m, t in times.items() if math.isfinite(t)}
    trl = figures[f"t_trl_{workload}"]
    beat = [key(m) for m, t in times.items() if math.isfinite(trl) and trl < t]
    return {f"best_mode_{workload}": key(min(reached, key=reached.get)) if reached else "none",
            f"trl_faster_than_{workload}": "+".join(beat) or "none"}


def combine(per_seed: list[dict]) -> dict:
    """One figure per key over seeds: the median (nan entries, where both sides missed,
    left out); for the speed-ups and times also each seed's (``_each``, seed order).

    >>> combine([{"speedup_a": 1.0, "x": 2.0}, {"speedup_a": 3.0, "x": 4.0},
    ...          {"speedup_a": 2.0, "x": 9.0}])
    {'speedup_a': 2.0, 'x': 4.0, 'speedup_a_each': '1/3/2'}
    """
    import statistics

    out = {}
    for k in per_seed[0]:
        vals = [d[k] for d in per_seed if not math.isnan(d[k])]
        out[k] = statistics.median(vals) if vals else math.nan
    if len(per_seed) > 1:
        out.update({f"{k}_each": "/".join(f"{d[k]:.3g}" for d in per_seed)
                    for k in per_seed[0] if k.startswith(("speedup_", "t_"))})
    return out


SETTING_KEYS = ("target", "conversation", "eval_every", "eval_seeds", "redundancy",
                "resources", "inference_pools")


def parse_result(line: str) -> dict:
    """A ``RESULT k=v ...`` line as a dict (numbers as floats, ``inf``/``nan`` too).

    >>> parse_result("RESULT t_trl_no_latency=inf heldout_trl_no_latency=0.5 seeds=0")
    {'t_trl_no_latency': inf, 'heldout_trl_no_latency': 0.5, 'seeds': '0'}
    """
    out: dict = {}
    for item in line.split()[1:]:
        k, _, v = item.partition("=")
        try:
            out[k] = v if k == "seeds" else float(v)
        except ValueError:
            out[k] = v
    return out


def aggregate(results: list[dict]) -> dict:
    """Several runs' RESULT figures (one seed each, as ``--seeds 1 --seed N`` prints)
    combined: each per-run figure's median over the runs (nan entries left out, as in
    ``combine``) with its range (``_min``/``_max``), the verdict recomputed from the
    median times, and the seeds joined. Runs whose settings differ (target, held-out
    seeds, steps, ...) are refused: a median over different settings means nothing.
    """
    import statistics

    fixed = [k for k in results[0] if k in SETTING_KEYS or k.startswith("steps_")]
    for k in fixed:
        if len({r.get(k) for r in results}) > 1:
            raise SystemExit(f"runs with different {k} ({[r.get(k) for r in results]}): "
                             "aggregate only runs of the same settings")
    per_run = [k for k, v in results[0].items() if isinstance(v, float) and k not in fixed
               and k not in ("trl_threads", "total_s")]
    out: dict = {}
    for k in per_run:
        vals = [r[k] for r in results if k in r and not math.isnan(r[k])]
        out[k] = statistics.median(vals) if vals else math.nan
        out[f"{k}_min"] = min(vals) if vals else math.nan
        out[f"{k}_max"] = max(vals) if vals else math.nan
    workloads = [k[len("steps_"):] for k in fixed if k.startswith("steps_")]
    for w in workloads:
        modes = [m for m in MODES if f"t_{key(m)}_{w}" in out]
        out.update(verdict(out, w, modes))
    out["seeds"] = "/".join(str(r["seeds"]) for r in results)
    out["trl_threads"] = "/".join(f"{r.get('trl_threads', math.nan):g}" for r in results)
    out.update({k: results[0][k] for k in fixed})
    out["total_s"] = sum(r.get("total_s", 0.0) for r in results)
    return out


def aggregate_files(paths: list[str]) -> dict:
    """``--aggregate``: the RESULT line of each file (a run's saved output), combined
    and printed as one RESULT line."""
    results = []
    for path in paths:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.startswith("RESULT ")]
        if len(lines) != 1:
            raise SystemExit(f"{path}: {len(lines)} RESULT lines; give one run's output per file")
        results.append(parse_result(lines[0]))
    figures = aggregate(results)
    print("RESULT " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in figures.items()))
    return figures
