"""How long the README's two set-up commands take on this machine: the main job and each
step of ``.ci/run``'s tests, recorded so the times the docs state come from a record.

Each step is the command ``.ci/run`` (or the README) runs, timed from start to end, with
its exit status and pytest's pass count (the suite without the one test that compares the
pages with these records, which cannot pass before the first of them):

==========  ==================================================================
``main``    ``python -m rollart train`` (the README's main job, in a fresh run
            folder): its wall time, and the held-out success per task of the
            warm-up policy and of the trained one (``eval.json``)
``suite``   ``python -m pytest`` (the README's test command, without install)
``slow``    the end-to-end runs on in-process clusters (``-m slow ...``)
``bench``   the benchmark scripts' smoke runs (``-m bench`` over ``.ci/run``'s files)
``matrix``  the kill matrix (``-m matrix``)
``learning`` the learning runs (``-m learning tests/test_e2e.py``)
==========  ==================================================================

``tests/docs/test_times.py`` checks that every step's command is still in ``.ci/run``
(or the README), and that the times on ``README.md`` and ``docs/quickstart.md`` are those
of the newest record holding them (``docs/gen_reference.py --times`` writes them in).
Measure on a quiet machine: nothing else running.

    flock /tmp/rollart-bench.lock python benchmarks/setup_times.py        # main, suite, slow
    flock /tmp/rollart-bench.lock python benchmarks/setup_times.py --steps main,suite,slow,bench,matrix
    python benchmarks/setup_times.py --quick    # a 2-step main job and the docs' README test

Ends with ``RESULT main_s=… suite_s=… … failed=…`` (``failed``: steps whose command did
not exit 0; a failed step's time is recorded, and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Run, add_arguments  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_FILES = ("tests/bench/test_bench_others.py tests/bench/test_bench_pipeline.py "
               "tests/chat/test_conversation.py tests/faults/test_recovery.py "
               "tests/env/test_scripted.py tests/sim/test_sim.py tests/sim/test_heldout.py "
               "tests/bench/test_vs_trl.py tests/bench/test_bench_lora.py")
#: step -> the command, as ``.ci/run`` (or the README) writes it
STEPS = {
    "main": "python -m rollart train",
    "suite": "python -m pytest",
    "slow": 'python -m pytest -p no:cacheprovider -m "slow and not learning and not bench '
            'and not matrix and not real"',
    "bench": f"python -m pytest -m bench {BENCH_FILES}",
    "matrix": "python -m pytest -m matrix tests/faults/test_kill_matrix.py "
              "tests/faults/test_scale_matrix.py",
    "learning": "python -m pytest -m learning tests/test_e2e.py",
}
PAGES_CHECK = "tests/docs/test_times.py::test_the_times_a_page_states_are_the_records"
QUICK = {"main": "python -m rollart train --steps 2 --set policy.warmup_steps=20 "
                 "--eval-seeds 8",
         "suite": "python -m pytest -p no:cacheprovider tests/docs/test_readme.py"}


def passed(output: str) -> int | None:
    """pytest's pass count from its summary line (None: no summary)."""
    found = re.findall(r"(\d+) passed", output)
    return int(found[-1]) if found else None


def run_step(name: str, command: str, run_dir: Path) -> dict:
    """Run ``command`` (a shell line) from the repository root; its time and outcome."""
    if name == "main":
        command += f" --run-dir {run_dir} --overwrite --no-progress"
    elif name == "suite":  # the check of the pages' times against these very records
        command += f" --deselect {PAGES_CHECK}"  # cannot pass before they exist
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
           "ROLLART_NO_RECORD": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = {f"{name}_s": round(time.perf_counter() - t0, 1), f"{name}_rc": done.returncode}
    print(f"{name}: {out[f'{name}_s']:.0f} s, exit {done.returncode}", flush=True)
    if done.returncode:
        print(done.stdout[-4000:], flush=True)
    if name == "main":
        evaluation = json.loads((run_dir / "eval.json").read_text()) \
            if (run_dir / "eval.json").exists() else {}
        for which, key in (("warmup", "heldout_warm"), ("trained", "heldout_after")):
            for task, success in (evaluation.get(which) or {}).items():
                out[f"{key}_{task}"] = success
    else:
        out[f"{name}_passed"] = passed(done.stdout)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", default="main,suite,slow",
                   help=f"comma-separated, of {', '.join(STEPS)} (default: main,suite,slow)")
    p.add_argument("--quick", action="store_true",
                   help="a 2-step main job and the README's doc test (records nothing)")
    add_arguments(p)
    args = p.parse_args(argv)
    names = ["main", "suite"] if args.quick else [s for s in args.steps.split(",") if s]
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}: choose from {', '.join(STEPS)}")
    run = Run("setup_times", args, argv)
    figures, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="rollart-setup-times-") as tmp:
        for name in names:
            out = run_step(name, (QUICK if args.quick else STEPS)[name], Path(tmp) / "run")
            figures.update(out)
            if out[f"{name}_rc"]:
                failed.append(name)
    figures["cores"] = os.cpu_count()
    figures["failed"] = ",".join(failed) or "none"
    run.result(figures)
    return figures


if __name__ == "__main__":
    main()
