"""LoRA against full fine-tuning on the chat graph: held-out gain per task, wall time and
bytes per weight version, side by side on the same seeds.

For each seed, one after the other on this machine: ``graphs/chat.py`` (full
fine-tuning, lr 5e-4) and ``graphs/chat.py:lora`` (LoRA rank 16 on every linear layer,
lr 5e-3, both chosen before the runs: ``graphs/chat.py`` ``LORA_RANK`` / ``LORA_LR``),
each ``python -m rollart train GRAPH --resources laptop --eval-seeds N --seed S``: the same
full-weight format warm-up (the same warm-up policy for both on one seed), then 100 RL
steps, then held-out success on ``N`` seeds per task of the warm-up policy and of the
trained one. A task's gain on a seed is trained − warm-up; its standard error
``sqrt(a(1-a)/N + b(1-b)/N)``. The goal (issue 38): with LoRA every task gains ≥ 2
standard errors on ≥ 2 of 3 seeds.

Each invocation appends one record to ``benchmarks/results/lora_chat.jsonl`` (date,
commit, load average before, command, every run's figures); the table of
docs/benchmarks/lora-chat.md is made from it. Run it alone on an idle machine::

    flock /tmp/rollart-bench.lock python benchmarks/lora_chat.py
    python benchmarks/lora_chat.py --quick      # one seed, a few steps: a smoke run

RESULT keys: ``tasks_ok_<full|lora>`` (tasks gaining ≥ 2 standard errors on ≥ 2 of the
seeds, or on the one seed of ``--quick``), ``median_gain_<task>_<full|lora>``,
``wall_min_<full|lora>`` (median over seeds), ``rl_step_s_<full|lora>`` (median),
``mib_per_version_<full|lora>`` and ``bytes_ratio`` (LoRA's bytes per version ÷ full's),
``seeds``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py

from _results import Run, add_arguments  # noqa: E402
SIDES = {"full": "graphs/chat.py", "lora": "graphs/chat.py:lora"}
QUICK = ["--steps", "3", "--set", "policy.warmup_steps=5",
         "--set", "policy.warmup_bare_tool_steps=0"]


def run_one(graph: str, seed: int, eval_seeds: int, run_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "rollart", "train", graph, "--resources", "laptop",
           "--eval-seeds", str(eval_seeds), "--seed", str(seed), "--run-dir", str(run_dir),
           *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    ev = json.loads((run_dir / "eval.json").read_text())
    timings = json.loads((run_dir / "timings.json").read_text())
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    sent = [r["weights/bytes_published"] for r in rows if "weights/bytes_published" in r]
    n = ev["seeds"]
    tasks = {}
    for task, after in ev["trained"].items():
        before = ev["warmup"][task]
        se = math.sqrt(before * (1 - before) / n + after * (1 - after) / n) or 1 / n
        tasks[task] = {"warmup": before, "trained": after, "gain": after - before,
                       "se": se, "z": (after - before) / se}
    return {"graph": graph, "seed": seed, "command": " ".join(cmd[1:]),
            "wall_s": time.time() - t0, "timings": timings, "tasks": tasks,
            "bytes_per_version": statistics.median(sent) if sent else None,
            "rl_step_s": timings["rl_s"] / max(timings["rl_steps"], 1)}


def summarise(runs: list[dict]) -> dict:
    out = {}
    need = 1 if len({r["seed"] for r in runs}) == 1 else 2
    for side, graph in SIDES.items():
        mine = [r for r in runs if r["graph"] == graph]
        tasks = sorted(mine[0]["tasks"])
        ok = 0
        for task in tasks:
            zs = [r["tasks"][task]["z"] for r in mine]
            ok += sum(z >= 2 for z in zs) >= need
            out[f"median_gain_{task}_{side}"] = statistics.median(
                r["tasks"][task]["gain"] for r in mine)
        out[f"tasks_ok_{side}"] = ok
        out[f"wall_min_{side}"] = statistics.median(r["wall_s"] for r in mine) / 60
        out[f"rl_step_s_{side}"] = statistics.median(r["rl_step_s"] for r in mine)
        out[f"mib_per_version_{side}"] = statistics.median(
            r["bytes_per_version"] for r in mine) / 2**20
    out["bytes_ratio"] = out["mib_per_version_lora"] / out["mib_per_version_full"]
    out["seeds"] = len({r["seed"] for r in runs})
    return out


def table(runs: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in runs})
    lines = ["| task | side | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    tasks = sorted(runs[0]["tasks"])
    for task in tasks:
        for side, graph in SIDES.items():
            cells = []
            for s in seeds:
                r = next(x for x in runs if x["graph"] == graph and x["seed"] == s)
                t = r["tasks"][task]
                cells.append(f"{t['warmup']:.2f} → {t['trained']:.2f} ({t['gain']:+.2f}, "
                             f"{t['z']:.1f} SE)")
            lines.append(f"| {task} | {side} | " + " | ".join(cells) + " |")
    for side, graph in SIDES.items():
        walls = [next(x for x in runs if x["graph"] == graph and x["seed"] == s)["wall_s"]
                 for s in seeds]
        lines.append(f"| wall | {side} | " + " | ".join(f"{w / 60:.1f} min" for w in walls)
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, 3 steps, 8 eval seeds")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--eval-seeds", type=int, default=256)
    add_arguments(p)
    a = p.parse_args(argv)
    run = Run("lora_chat", a, argv)
    seeds = [0] if a.quick else [int(s) for s in a.seeds.split(",")]
    eval_seeds = 8 if a.quick else a.eval_seeds
    extra = QUICK if a.quick else []
    tmp = Path(tempfile.mkdtemp(prefix="rollart-lora-chat-"))
    runs = []
    for seed in seeds:  # the two sides alternate: a drift in the machine's speed hits both
        for side, graph in SIDES.items():
            r = run_one(graph, seed, eval_seeds, tmp / f"{side}-{seed}", extra)
            print(f"seed {seed} {side}: {r['wall_s'] / 60:.1f} min, "
                  + ", ".join(f"{t} {v['warmup']:.2f}->{v['trained']:.2f} ({v['z']:.1f} SE)"
                              for t, v in sorted(r["tasks"].items())), flush=True)
            runs.append(r)
    out = summarise(runs)
    print(table(runs))
    run.result(out, {"eval_seeds": eval_seeds, "runs": runs})
    return out


if __name__ == "__main__":
    main()
