"""Results as data: every benchmark script prints its RESULT line through
``benchmarks/_results.Run``, which appends a record (date, commit, load, command,
figures) unless the run is a smoke run, and each script's docs page shows its newest
records generated from that log (``<!-- results: SCRIPT -->``, ``docs/gen_reference.py``)."""

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                 if not p.stem.startswith("_"))


@pytest.fixture
def results(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.syspath_prepend(str(ROOT / "docs"))
    mod = importlib.import_module("_results")
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    return mod


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_records_through_run_and_its_page_shows_the_log(script):
    src = (ROOT / "benchmarks" / f"{script}.py").read_text()
    assert f'Run("{script}"' in src, f"benchmarks/{script}.py prints no RESULT through Run"
    assert not re.search(r'print\(\s*"RESULT ', src), \
        f"benchmarks/{script}.py prints a RESULT line of its own (use Run.result)"
    pages = [p for p in (ROOT / "docs/benchmarks").glob("*.md")
             if f"<!-- results: {script} -->" in p.read_text()]
    assert pages, f"no docs/benchmarks page shows benchmarks/{script}.py's records"


def test_a_run_records_unless_quick_or_no_record(results, capsys, monkeypatch):
    monkeypatch.delenv("ROLLART_NO_RECORD", raising=False)  # tests/conftest.py sets it
    run = results.Run("demo", argparse.Namespace(quick=False, no_record=False), ["--x", "1"])
    path = run.result({"ratio": 1.23456, "seeds": 3}, {"per_seed": [1.0, 1.5]})
    assert capsys.readouterr().out.strip() == "RESULT ratio=1.235 seeds=3"
    rec = json.loads(path.read_text())
    assert rec["command"] == "demo.py --x 1" and rec["ratio"] == 1.23456
    assert rec["per_seed"] == [1.0, 1.5] and len(rec["load_before"]) == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", rec["date"])
    assert rec["commit"] != "" and rec["commit"] == results.commit()
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", rec["commit"]), rec["commit"]
    for args in (argparse.Namespace(quick=True, no_record=False),
                 argparse.Namespace(quick=False, no_record=True)):
        assert results.Run("demo", args, []).result({"ratio": 2.0}) is None
    monkeypatch.setenv("ROLLART_NO_RECORD", "1")  # as the test suite runs the scripts
    assert results.Run("demo", argparse.Namespace(quick=False), []).result({"r": 1}) is None
    assert len(path.read_text().splitlines()) == 1


def test_a_page_shows_the_newest_records_from_the_log(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "docs"))
    gen = importlib.import_module("gen_reference")
    (tmp_path / "benchmarks/results").mkdir(parents=True)
    (tmp_path / "benchmarks/trainer_gang.py").write_text("")
    log = tmp_path / "benchmarks/results/trainer_gang.jsonl"
    log.write_text("".join(json.dumps({"date": f"2026-12-0{d}T10:00:00+00:00",
                                       "commit": f"c{d}", "load_before": [0.5, 0.4, 0.3],
                                       "command": "trainer_gang.py", "gang_step_ratio": d / 10,
                                       "steps_s_1": [1.0, 2.0]}) + "\n"
                           for d in (2, 5, 1, 4, 3)))
    monkeypatch.setattr(gen.figures, "ROOT", tmp_path)
    page = gen.on_page_markdown("before\n<!-- results: trainer_gang -->\nafter", None, None,
                                None)
    rows = [line for line in page.splitlines() if line.startswith("| 2026")]
    assert [r.split("|")[2].strip() for r in rows] == ["`c5`", "`c4`", "`c3`"]
    assert "gang_step_ratio=0.5" in rows[0] and "steps_s_1" not in rows[0]
    assert "newest 3 of 5" in page and page.startswith("before\n") and page.endswith("after")
    how_to = type("Page", (), {"file": type("File", (), {"src_uri": "how-to/x.md"})})()
    page = gen.on_page_markdown("<!-- results: trainer_gang -->", how_to, None, None)
    assert "[results log](../benchmarks/results.md)" in page  # the log, from another folder
    (tmp_path / "benchmarks/chaos.py").write_text("")
    assert "No record yet" in gen.latest_records("chaos")
    with pytest.raises(ValueError, match="no benchmarks/nosuch.py"):
        gen.on_page_markdown("<!-- results: nosuch -->", None, None, None)
    sys.modules.pop("gen_reference", None)


def test_the_costs_and_real_model_tables_come_from_the_newest_records(tmp_path, monkeypatch):
    """The reliability page's costs and the real-model how-to's figures: the newest
    record of each kind (an elastic record per pool, size and model; a real-model record
    of each script), never a toy record in the real model's table."""
    monkeypatch.syspath_prepend(str(ROOT / "docs"))
    gen = importlib.import_module("gen_reference")
    (tmp_path / "benchmarks/results").mkdir(parents=True)
    monkeypatch.setattr(gen.figures, "ROOT", tmp_path)
    assert "No record yet" in gen.costs_table()

    def rec(day: int, **figures) -> str:
        return json.dumps({"date": f"2026-12-0{day}T10:00:00+00:00", "commit": f"c{day}",
                           **figures}) + "\n"
    toy = dict(join_to_first_request_s=5.0, step_s_median=0.4, lost=0, duplicated=0)
    (tmp_path / "benchmarks/results/elastic.jsonl").write_text(
        rec(1, **toy, join_in_steps=12.5, shrink_stall_steps=0.3)  # older names
        + rec(2, **toy, join_steps=14.0, scale_down_stall_steps=0.2)
        + rec(3, **toy, join_steps=3.0, scale_down_stall_steps=0.1, pool="env", to=3)
        + rec(4, **{**toy, "step_s_median": 30.0}, join_steps=0.2,
              scale_down_stall_steps=0.05, model="smollm2-135m-instruct"))
    (tmp_path / "benchmarks/results/chaos.jsonl").write_text(
        rec(2, lost=0, duplicated=0, max_recovery_s=7.5, steps=30, failed_frac=0.21,
            restarted_groups=4, killed="CPU_ENV"))
    costs = gen.costs_table()
    rows = [line for line in costs.splitlines() if line.startswith("| ") and "`c" in line]
    assert len(rows) == 4, costs  # three resize kinds (c2 newer than c1), one failure
    assert "smollm2" in rows[0] and "= 0.2 trainer" in rows[0]  # newest first
    assert "`env` 1 → 3 → 1" in rows[1]
    assert "= 14 trainer steps" in rows[2] and "`c2`" in rows[2]
    assert "longest recovery 7.5 s" in rows[3] and "`CPU_ENV`" in rows[3]
    real = gen.real_model_table()
    assert "`join_steps`=0.2" in real and "`join_steps`=14" not in real
    assert real.count("no record on a real model yet") == len(gen.REAL_FIGURES) - 1
    reliability = type("Page", (), {"file": type("File", (), {"src_uri": "concepts/x.md"})})()
    page = gen.on_page_markdown("<!-- costs -->\n<!-- real_model_figures -->", reliability,
                                None, None)
    assert "longest recovery" in page and "`join_steps`=0.2" in page
    sys.modules.pop("gen_reference", None)


def test_kept_seeds_resume_where_an_invocation_stopped(results):
    """``Kept`` (a long benchmark's ``--resume``): its doctests, run as written."""
    import doctest

    assert doctest.testmod(results, optionflags=doctest.ELLIPSIS).failed == 0
