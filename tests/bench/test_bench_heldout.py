"""benchmarks/cluster_sim.py --heldout's own parts (benchmarks/_heldout.py): the frozen
simulator check on a real git repository, the invocations' loop and the RESULT line,
with the held-out calibration itself replaced by planted errors (its tiny real run is
tests/sim/test_heldout.py::test_cluster_sim_heldout_tiny)."""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("ROLLART_NO_RECORD", "1")
    return importlib.import_module("_heldout")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> tuple[Path, str]:
    """A git repository with a committed rollart/sim and a file beside it."""
    (tmp_path / "rollart" / "sim").mkdir(parents=True)
    (tmp_path / "rollart" / "sim" / "cluster.py").write_text("A = 1\n")
    (tmp_path / "rollart" / "other.py").write_text("B = 1\n")
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "frozen")
    return tmp_path, _git(tmp_path, "rev-parse", "HEAD")


def test_a_clean_simulator_passes_the_frozen_check(bench, repo):
    root, commit = repo
    assert bench.frozen_problem(commit, root) is None
    assert bench.frozen_problem(commit[:7], root) is None
    assert bench.frozen_commit(commit[:7], root) == commit
    (root / "rollart" / "other.py").write_text("B = 2\n")  # outside the simulator
    (root / "rollart" / "sim" / "__pycache__").mkdir()  # ignored
    (root / "rollart" / "sim" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert bench.frozen_problem(commit, root) is None
    _git(root, "commit", "-qam", "later, outside rollart/sim")
    assert bench.frozen_problem(commit, root) is None  # HEAD moved, the simulator did not


@pytest.mark.parametrize("change", ["edit", "staged", "committed", "untracked", "deleted"])
def test_a_changed_simulator_is_refused_naming_its_files(bench, repo, change):
    root, commit = repo
    sim = root / "rollart" / "sim"
    if change == "untracked":
        (sim / "new.py").write_text("C = 1\n")
        name = "rollart/sim/new.py"
    elif change == "deleted":
        (sim / "cluster.py").unlink()
        name = "rollart/sim/cluster.py"
    else:
        (sim / "cluster.py").write_text("A = 2\n")
        name = "rollart/sim/cluster.py"
        if change in ("staged", "committed"):
            _git(root, "add", ".")
        if change == "committed":
            _git(root, "commit", "-qm", "simulator changed")
    problem = bench.frozen_problem(commit, root)
    assert problem is not None and "\n" not in problem
    assert f"frozen at {commit}" in problem and problem.endswith(
        "or freeze it again at a new commit") and name in problem, problem


def test_an_unknown_commit_is_refused(bench, repo):
    root, _ = repo
    assert "not a commit" in bench.frozen_problem("0" * 40, root)
    with pytest.raises(ValueError, match="not a commit"):
        bench.frozen_commit("nope", root)


def _planted(errors_by_invocation):
    """A stand-in for ``heldout_calibration``: the planted errors, one call each."""
    calls = []

    def fake(model, steps, groups, seeds, settings, fit_seed, log=print):
        errs = errors_by_invocation[len(calls)]
        calls.append({"seeds": seeds, "fit_seed": fit_seed,
                      "settings": [s.name for s in settings]})
        real = {n: {s: 10.0 for s in seeds} for n in errs}
        return {"real": real, "sim": real, "errors": errs, "seeds": list(seeds),
                "fit_seed": fit_seed, "wall_s": 5.0}
    return fake, calls


def test_every_invocation_fits_and_runs_on_its_own_seeds(bench, monkeypatch):
    import pipeline

    from rollart.sim import heldout

    names = [s.name for s in heldout.HELDOUT]
    errs = [{"fit": 0.01, **{n: 0.05 for n in names}},
            {"fit": 0.02, **{n: 0.05 for n in names}, "pd": 0.3, "sync": 0.2}]
    fake, calls = _planted(errs)
    monkeypatch.setattr(heldout, "heldout_calibration", fake)
    monkeypatch.setattr(pipeline, "cached_warm_model", lambda *a: ("model", True))
    out, details = bench.run_heldout("full", invocations=2, log=lambda *_: None)
    assert [c["seeds"] for c in calls] == [(1, 2, 3), (101, 102, 103)]
    assert [c["fit_seed"] for c in calls] == [heldout.FIT_SEED, heldout.FIT_SEED + 100]
    assert all(c["settings"] == names for c in calls) and len(names) == 11
    assert (out["heldout_within_015"], out["heldout_worst"], out["invocations"],
            out["heldout_configs"]) == (9, 0.3, 2, 11)
    assert out["heldout_missed_1"] == "none" and out["heldout_missed_2"] == "sync,pd"
    assert (out["steps"], out["groups"], out["seeds"], out["heldout_wall_s"]) == \
        (10, 12, 3, 10)
    runs = details["heldout_invocations"]
    assert [r["errors"] for r in runs] == errs and runs[1]["seeds"] == [101, 102, 103]
    with pytest.raises(ValueError, match="--invocations"):
        bench.run_heldout("full", invocations=0)


def test_the_result_line_names_the_frozen_commit_or_none(bench, monkeypatch, capsys,
                                                          repo):
    import cluster_sim

    root, commit = repo
    planted = ({"heldout_within_015": 1, "heldout_worst": 0.2, "invocations": 1,
                "heldout_configs": 2, "heldout_within_015_1": 1, "heldout_worst_1": 0.2,
                "heldout_missed_1": "pd"}, {})
    sizes = []
    monkeypatch.setattr(bench, "run_heldout", lambda size, n: sizes.append((size, n))
                        or (dict(planted[0]), planted[1]))
    monkeypatch.setattr(bench, "ROOT", root)
    got = cluster_sim.main(["--heldout", "--tiny", "--invocations", "2"])
    assert got["frozen"] == "none" and sizes == [("tiny", 2)]
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT"))
    assert "heldout_missed_1=pd" in line and line.endswith("frozen=none")
    got = cluster_sim.main(["--heldout", "--quick", "--frozen", commit[:8]])
    assert got["frozen"] == commit[:12] and sizes[-1] == ("quick", None)
    (root / "rollart" / "sim" / "cluster.py").write_text("A = 3\n")
    with pytest.raises(SystemExit, match="rollart/sim/cluster.py"):
        cluster_sim.main(["--heldout", "--frozen", commit])
    assert len(sizes) == 2  # refused before anything ran
    with pytest.raises(SystemExit):
        cluster_sim.main(["--scale-only", "--tiny", "--invocations", "2"])
    assert "add --heldout" in capsys.readouterr().err
