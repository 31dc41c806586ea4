"""A real pretrained model learns: SmolLM2-135M-Instruct on graphs/real.py, held-out
success before and after async GRPO, per task and per seed, full fine-tuning or LoRA.

One invocation, one method (``--method full``: ``graphs/real.py``; ``--method lora``:
``graphs/real.py:lora``; ``--method warm-lora``: ``graphs/real.py:warm_lora``, LoRA after
a short supervised warm-up on both tasks' demonstrations; their settings were fixed in
that file before any run):

1. ``rollart eval smollm2-135m-instruct graphs/real.py --seeds N``: the untrained model's
   held-out success per task (the same held-out seeds every run is evaluated on: the
   pairs are per seed of the held-out set);
2. for each run seed S: ``rollart train GRAPH --seed S --steps K --eval-seeds N``, each
   run's own held-out evaluation of its final model (and, with a warm-up, of the model
   the warm-up left: its own row);
3. per task and seed, gain = after − before; the headline is the median over run seeds,
   ``gain_min`` the smallest of those medians over the tasks (the goal: ≥ +0.15 on every
   task within 60 minutes on two cores), with each gain's standard error
   ``sqrt(a(1-a)/N + b(1-b)/N)`` in the record.

``--engine vllm`` runs the same on the vLLM engine (``Policy.engine``; the script run by
the vLLM venv's python, its seeds kept apart as ``METHOD-vllm``); held-out evaluation is
the torch engine's for both.

Run it alone on an idle machine; each run takes about ``K`` minutes on two cores::

    flock /tmp/rollart-bench.lock python benchmarks/real_model.py --method lora
    python benchmarks/real_model.py --quick      # one seed, two tiny LoRA steps: a smoke run

``--plot`` draws the newest full record of each method into
``benchmarks/figures/real_model_curve.png`` (the how-to's curve).

Appends one record per invocation to ``benchmarks/results/real_model.jsonl`` (date,
commit, load average before, command, every run's figures and per-step rewards).

RESULT keys: ``gain_min``, ``gain_<task>`` (median over seeds), ``heldout_before_<task>``,
``heldout_after_<task>`` (median over seeds), ``seeds``, ``wall_s`` (median wall time of
a run: start-up, RL steps, evaluation), ``rl_step_s`` (median), ``method``, ``engine``; with a
warm-up also ``heldout_warm_<task>`` (median after the warm-up, before RL) and
``gain_rl_<task>`` (median over seeds of after − warm: RL's own share of the gain).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py

from _results import Kept, Run, add_arguments  # noqa: E402

GRAPHS = {"full": "graphs/real.py", "lora": "graphs/real.py:lora",
          "warm-lora": "graphs/real.py:warm_lora"}
#: --quick's graph per method: two tiny LoRA steps (after two demonstration steps)
QUICK = {"full": "graphs/real.py:smoke", "lora": "graphs/real.py:smoke",
         "warm-lora": "graphs/real.py:warm_smoke"}
MODEL = "smollm2-135m-instruct"


def _rollart(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rollart", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def before(graph: str, eval_seeds: int) -> dict:
    """The untrained model's held-out success per task."""
    proc = _rollart(["eval", MODEL, graph, "--seeds", str(eval_seeds), "--json"])
    return json.loads(proc.stdout)["trained"]


def train_one(graph: str, seed: int, steps: int, eval_seeds: int, run_dir: Path,
              extra: list[str]) -> dict:
    t0 = time.time()
    _rollart(["train", graph, "--model", MODEL, "--seed", str(seed), "--steps", str(steps),
              "--eval-seeds", str(eval_seeds), "--run-dir", str(run_dir), "--no-progress",
              *extra])
    ev = json.loads((run_dir / "eval.json").read_text())
    timings = json.loads((run_dir / "timings.json").read_text())
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    warm = {"warm": ev["warmup"]} if "warmup" in ev else {}
    return {"seed": seed, "after": ev["trained"], **warm, "wall_s": time.time() - t0,
            "rl_step_s": timings["rl_s"] / max(timings["rl_steps"], 1),
            "timings": timings,
            "reward": {k: [r.get(k) for r in rows] for k in rows[0] if k.startswith(
                ("reward/", "success/"))} if rows else {}}


def stderr(a: float, b: float, n: int) -> float:
    return math.sqrt(a * (1 - a) / n + b * (1 - b) / n)


CURVE = ROOT / "benchmarks" / "figures" / "real_model_curve.png"
RECORDS = ROOT / "benchmarks" / "results" / "real_model.jsonl"


def plot(out: Path = CURVE, records: Path = RECORDS) -> Path:
    """The learning curve of the newest record of each method in
    ``benchmarks/results/real_model.jsonl`` (a full run, not ``--quick``'s): per task,
    each seed's training success per RL step (thin) and their median (thick, a running
    mean over 5 steps), and the
    held-out success before (dashed) and after (dots at the last step) training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest: dict[str, dict] = {}
    for line in open(records):
        rec = json.loads(line)
        if "--quick" not in rec.get("command", "") and rec.get("runs"):
            engine = rec.get("engine", "torch")
            newest[rec["method"] + ("" if engine == "torch" else f" ({engine})")] = rec
    if not newest:
        raise SystemExit("no full record in benchmarks/results/real_model.jsonl to plot")
    tasks = sorted(next(iter(newest.values()))["before"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for c, (method, rec) in enumerate(sorted(newest.items())):
            color = f"C{c}"
            curves = [r["reward"].get(f"success/{task}") or [] for r in rec["runs"]]
            for cur in curves:
                ax.plot(range(1, len(cur) + 1), [math.nan if v is None else v for v in cur],
                        color=color, alpha=0.25, lw=0.8)
            steps = min(map(len, curves))
            med = [statistics.median(c[i] for c in curves if c[i] is not None)
                   for i in range(steps)]
            smooth = [statistics.mean(med[max(0, i - 4):i + 1]) for i in range(steps)]
            ax.plot(range(1, steps + 1), smooth, color=color, lw=2,
                    label=f"{method}: training success (median of {len(curves)} seeds, "
                          "mean of 5 steps)")
            ax.axhline(rec["before"][task], color=color, ls="--", lw=1)
            ax.plot([steps] * len(rec["runs"]), [r["after"][task] for r in rec["runs"]],
                    "o", color=color, label=f"{method}: held-out after "
                    f"({rec['eval_seeds']} seeds; dashed: before)")
        ax.set_title(task)
        ax.set_xlabel("RL step")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("success")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle("SmolLM2-135M-Instruct, graphs/real.py, async GRPO on 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=sorted(GRAPHS), default="lora")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                   help="the rollout engine (Policy.engine); vllm: run this script with the "
                        "vLLM venv's python (.ci/run builds it), PYTHONPATH=. (held-out "
                        "evaluation stays on the torch engine, the same for both)")
    p.add_argument("--seeds", type=int, default=3, help="run seeds 0..N-1")
    p.add_argument("--steps", type=int, default=40, help="RL steps per run")
    p.add_argument("--eval-seeds", type=int, default=128, help="held-out seeds per task")
    p.add_argument("--quick", action="store_true",
                   help="one seed, graphs/real.py:smoke's two tiny LoRA steps (warm-lora: "
                        "warm_smoke's), 4 held-out seeds (a smoke run: records nothing)")
    p.add_argument("--resume", action="store_true",
                   help="go on from the seeds an earlier invocation of the same settings "
                        "finished (runs/bench-real_model/METHOD); without that folder, from "
                        "the newest record of the same settings)")
    p.add_argument("--plot", action="store_true",
                   help=f"draw the newest records' curves into {CURVE.relative_to(ROOT)} "
                        "and exit")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.plot:
        print(f"curve: {plot()}")
        return
    run = Run("real_model", args, argv)
    graph, extra = GRAPHS[args.method], []
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"--engine vllm: vllm does not import in {sys.executable} "
                             f"({e}); run this script with the vLLM venv's python "
                             "(~/.cache/rollart/vllm-venv/bin/python, built by .ci/run) and "
                             "PYTHONPATH=.") from None
        extra = ["--set", "policy.engine=vllm"]
    if args.quick:
        graph, args.seeds, args.steps, args.eval_seeds = QUICK[args.method], 1, 2, 4
        args.method = "lora" if args.method == "full" else args.method  # smoke: LoRA
    # each seed's run is kept (``_results.Kept``): one cut short goes on with --resume
    name = f"quick-{args.method}" if args.quick else args.method
    settings = {"graph": graph, "steps": args.steps, "eval_seeds": args.eval_seeds}
    if args.engine != "torch":  # the torch engine's settings as they always were
        name, settings["engine"] = f"{name}-{args.engine}", args.engine
    kept = Kept("real_model", name, settings, args.resume)
    base = kept.before(lambda: before(graph, args.eval_seeds))
    runs = []
    for seed in range(args.seeds):
        one = kept.seed(seed, lambda folder: train_one(graph, seed, args.steps,
                                                       args.eval_seeds, folder, extra))
        one["gain"] = {t: one["after"][t] - base[t] for t in base}
        one["stderr"] = {t: stderr(base[t], one["after"][t], args.eval_seeds)
                         for t in base}
        warm = one.get("warm")
        print(f"seed {seed}: " + " ".join(
            f"{t} {base[t]:.2f}->" + (f"{warm[t]:.2f} (warm-up)->" if warm else "")
            + f"{one['after'][t]:.2f}" for t in base), flush=True)
        runs.append(one)
    gains = {t: statistics.median(r["gain"][t] for r in runs) for t in base}
    figures = {"gain_min": min(gains.values()),
               **{f"gain_{t}": g for t, g in gains.items()},
               **{f"heldout_before_{t}": base[t] for t in base},
               **{f"heldout_after_{t}": statistics.median(r["after"][t] for r in runs)
                  for t in base},
               "seeds": args.seeds, "steps": args.steps, "eval_seeds": args.eval_seeds,
               "wall_s": statistics.median(r["wall_s"] for r in runs),
               "rl_step_s": statistics.median(r["rl_step_s"] for r in runs),
               "method": args.method, "engine": args.engine}
    if all("warm" in r for r in runs):  # the warm-up's own row, and RL's share
        figures.update({f"heldout_warm_{t}": statistics.median(r["warm"][t] for r in runs)
                        for t in base})
        figures.update({f"gain_rl_{t}": statistics.median(r["after"][t] - r["warm"][t]
                                                           for r in runs) for t in base})
        figures["warmup_s"] = statistics.median(r["timings"]["warmup_s"] for r in runs)
    run.result(figures, {"before": base, "runs": runs, "graph": graph, **kept.record()})


if __name__ == "__main__":
    main()
