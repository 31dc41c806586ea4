"""benchmarks/_pipeline_steps.py reads kept runs and gives each label's medians."""

import importlib
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _steps(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("_pipeline_steps")


def _run(kl: float, clip: float, trainable: int, entropy: float, curve: dict) -> dict:
    rows = []
    for step in range(1, 16):
        rows.append({"step": step, "time": 2.0 * step, "trainer/wait_s": 0.5,
                     "rollout/engine_busy_s": 0.8 * step, "rollout/inflight_limit": 12,
                     "traj/dropped": 0, "trainer/kl": kl if step > 1 else 0.0,
                     "trainer/clip_frac": clip, "trainer/staleness_mean": 1.0,
                     "trainer/rows/box": 16, "trainer/trainable_groups/box": trainable,
                     "entropy/box": entropy})
    return {"rows": rows, "curve": curve}


def test_medians_per_label_from_kept_runs(monkeypatch, tmp_path):
    steps = _steps(monkeypatch)
    runs = {"areal-seed1": _run(0.02, 0.2, 2, 0.9, {"3": 0.3, "6": 0.5, "9": 0.4}),
            "areal-seed2": _run(0.04, 0.1, 2, 0.7, {"3": 0.45, "6": 0.5, "9": 0.6}),
            "areal-seed3": _run(0.03, 0.3, 1, 0.8, {"3": 0.2, "6": 0.3, "9": 0.5}),
            "async_at_keep-seed1": _run(0.2, 0.0, 0, 0.1, {"3": 0.3, "6": 0.3})}
    for name, run in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    out = steps.summarise(tmp_path, target=0.4)
    assert set(out) == {"areal", "async_at_keep"}
    a, k = out["areal"], out["async_at_keep"]
    # the first step at or above the target: 6, 3, 9 -> 6; never -> inf
    assert a["steps_to_target"] == 6 and math.isinf(k["steps_to_target"])
    assert a["final"] == 0.5 and k["final"] == 0.3  # the last checkpoint: .4 .6 .5
    assert a["kl_early"] == pytest.approx(0.03) and a["clip_early"] == pytest.approx(0.2)
    assert a["trainable_box"] == 1.0 and k["trainable_box"] == 0.0  # of 2 groups a step
    assert a["entropy_box"] == pytest.approx(0.8) and k["entropy_box"] == pytest.approx(0.1)
    assert a["s_step"] == 2.0 and a["engine_busy"] == pytest.approx(0.4)


def test_an_empty_folder_names_the_fix(monkeypatch, tmp_path):
    steps = _steps(monkeypatch)
    with pytest.raises(SystemExit, match="--keep-rows"):
        steps.summarise(tmp_path, target=0.4)


def test_saved_figures_are_a_record_with_each_seeds_own(monkeypatch, tmp_path):
    steps = _steps(monkeypatch)
    results = importlib.import_module("_results")
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    kept = tmp_path / "kept"
    kept.mkdir()
    for seed, kl in ((1, 0.02), (2, 0.06)):
        (kept / f"async-seed{seed}.json").write_text(
            json.dumps(_run(kl, 0.1, 1, 0.5, {"3": 0.2, "6": 0.5})))
    steps.main([str(kept), "--target", "0.4", "--save", "pipeline.py --keep-rows x",
                "--at", "abc1234"])
    line = json.loads((tmp_path / "results" / "pipeline_steps.jsonl").read_text())
    assert (line["commit"], line["rows_command"], line["target"]) == \
        ("abc1234", "pipeline.py --keep-rows x", 0.4)
    assert line["medians"]["async"]["kl_early"] == pytest.approx(0.04)
    assert [(r["label"], r["seed"], r["kl_early"]) for r in line["runs"]] == \
        [("async", 1, pytest.approx(0.02)), ("async", 2, pytest.approx(0.06))]
    assert line["runs"][0]["steps_to_target"] == 6
