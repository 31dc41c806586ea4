"""``benchmarks/cluster_sim.py --heldout``: the held-out calibration over several
invocations, and the check that the simulator is the one frozen before it.

Consumes ``rollart.sim.heldout`` (one invocation: its own fit, real runs and
predictions; ``summarise``: the per-invocation figures) and the pipeline benchmark's
warmed-up model (``benchmarks/pipeline.py``'s cache); produces the RESULT figures
(``heldout_within_015`` …, ``frozen``) and the record's details (every configuration's
real and simulated trajectories/s per seed and its error, per invocation).

``frozen_problem(commit)``: why the run must not start when the simulator
(``rollart/sim``: tracked files that differ from ``commit``, in the index or the work
tree, and untracked files there) is not the one frozen at ``commit``; ``None`` when it
is. Called by ``cluster_sim.main`` before anything runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM = "rollart/sim"  # the simulator's code: what --frozen holds to its commit

SIZES = {"full": {"steps": 10, "groups": 12, "seeds": (1, 2, 3), "invocations": 3},
         "quick": {"steps": 6, "groups": 6, "seeds": (1, 2, 3), "invocations": 2},
         "tiny": {"steps": 2, "groups": 2, "seeds": (1,), "invocations": 1}}
TINY_SETTINGS = ("env_x2", "pd")  # the smoke run's held-out configurations


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, text=True, capture_output=True)


def frozen_commit(commit: str, root: Path | None = None) -> str:
    """``commit``'s full hash; ``ValueError`` when it names no commit of ``root``
    (default: this repository)."""
    root = root or ROOT
    out = _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if out.returncode != 0 or not out.stdout.strip():
        raise ValueError(f"--frozen {commit}: not a commit of the repository at {root}; "
                         f"give the commit the simulator was frozen at (git log -- {SIM})")
    return out.stdout.strip()


def frozen_problem(commit: str, root: Path | None = None, paths=(SIM,)) -> str | None:
    """One line naming the files of ``paths`` that differ from ``commit`` (``git diff
    COMMIT``: the work tree and the index against it) or are untracked there, or
    ``None`` when there are none (the simulator is the one frozen at ``commit``)."""
    root = root or ROOT
    try:
        full = frozen_commit(commit, root)
    except ValueError as e:
        return str(e)
    diff = _git(root, "diff", "--name-only", full, "--", *paths)
    new = _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths)
    if diff.returncode or new.returncode:
        return f"--frozen {commit}: git failed: {(diff.stderr or new.stderr).strip()}"
    files = sorted(set(diff.stdout.split()) | set(new.stdout.split()))
    if not files:
        return None
    return (f"the simulator changed since it was frozen at {commit} ({len(files)} file(s) "
            f"of {', '.join(paths)} differ): {' '.join(files)}; run the held-out "
            f"calibration on {commit}'s simulator, or freeze it again at a new commit")


def run_heldout(size: str, invocations: int | None = None, log=print) -> tuple[dict, dict]:
    """``invocations`` (default: the size's) independent invocations of
    ``rollart.sim.heldout.heldout_calibration`` (invocation ``i``'s seeds:
    ``heldout.invocation_seeds``) at ``SIZES[size]`` from the pipeline benchmark's
    warmed-up model (``tiny``: a short warm-up in a temporary folder and
    ``TINY_SETTINGS`` only): the RESULT figures (``heldout.summarise``; steps, groups,
    seeds, wall time) and the details (per invocation: seeds, real, sim, errors)."""
    import tempfile

    from pipeline import WARM_CACHE, cached_warm_model

    from rollart.app.cli import quiet
    from rollart.sim.heldout import (HELDOUT, base_graph, heldout_calibration,
                                     invocation_seeds, summarise)

    quiet()
    sz = SIZES[size]
    n = sz["invocations"] if invocations is None else invocations
    if n < 1:
        raise ValueError(f"--invocations must be ≥ 1, got {n}")
    settings = tuple(s for s in HELDOUT if s.name in TINY_SETTINGS) if size == "tiny" \
        else HELDOUT
    base, runs = base_graph(), []
    with tempfile.TemporaryDirectory() as tmp:
        model, reused = cached_warm_model(tmp if size == "tiny" else WARM_CACHE, base.tasks,
                                          20 if size == "tiny" else base.policy.warmup_steps)
        log(f"warm-up model {model} ({'reused' if reused else 'built'})")
        for i in range(n):
            seeds, fit_seed = invocation_seeds(i, sz["seeds"])
            log(f"invocation {i + 1} of {n}: fit seeds {fit_seed}…, real seeds {seeds}")
            runs.append(heldout_calibration(model, sz["steps"], sz["groups"], seeds,
                                            settings, fit_seed, log=log))
    out = summarise([r["errors"] for r in runs], [s.name for s in settings])
    for i, r in enumerate(runs, 1):
        log(f"invocation {i}: " + " ".join(f"{k}={v:.3f}" for k, v in r["errors"].items()))
    out.update(steps=sz["steps"], groups=sz["groups"], seeds=len(sz["seeds"]),
               heldout_wall_s=round(sum(r["wall_s"] for r in runs)))
    keep = ("seeds", "fit_seed", "real", "sim", "errors", "wall_s")
    return out, {"heldout_invocations": [{k: r[k] for k in keep} for r in runs]}
