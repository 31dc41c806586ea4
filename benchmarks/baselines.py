"""Scripted-policy baselines: the held-out success of a random valid action, a fixed
heuristic and the optimal policy on every built-in task (``rollart.env.scripted``).

These are the context of every success figure rollart reports: the same held-out seeds
``rollart train`` evaluates on (``rollart.types.EVAL_SEED_BASE`` on, 64 per task as
its default ``--eval-seeds``), played by scripted players instead of a model. No model
and no cluster: it runs in seconds. Ends with one line

    RESULT gridnav_random=… gridnav_heuristic=… gridnav_optimal=… guess_random=… …

(``task_policy`` = share of the held-out seeds won).

    python benchmarks/baselines.py --quick      # 64 seeds per task
    python benchmarks/baselines.py              # 512 seeds per task
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py
from _results import Run, add_arguments  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="64 held-out seeds per task")
    p.add_argument("--seeds", type=int, default=None,
                   help="held-out seeds per task (default 512; 64 with --quick)")
    p.add_argument("--tasks", default="gridnav,guess,boxpush,calc")
    add_arguments(p)
    a = p.parse_args(argv)
    run = Run("baselines", a, argv)
    n = a.seeds or (64 if a.quick else 512)

    from rollart.env.scripted import POLICIES, baselines

    t0 = time.time()
    table = baselines(tasks=[t for t in a.tasks.split(",") if t], n_seeds=n)
    print(f"{'task':8s} " + " ".join(f"{p:>9s}" for p in POLICIES)
          + f"   ({n} held-out seeds each)")
    for task, row in table.items():
        print(f"{task:8s} " + " ".join(f"{row[p]:9.3f}" for p in POLICIES))
    figures = {f"{t}_{p}": round(v, 3) for t, row in table.items() for p, v in row.items()}
    figures.update({"seeds": n, "total_s": round(time.time() - t0, 1)})
    run.result(figures)
    return table


if __name__ == "__main__":
    main()
