"""The set-up times and the default run's held-out table that README.md and
docs/quickstart.md state are those of ``benchmarks/setup_times.py``'s newest records
(``docs/gen_reference.py --times`` writes them in), and each step that script times is
still the command ``.ci/run`` (or the README) runs."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


gen = _load(ROOT / "docs" / "gen_reference.py", "gen_reference")


@pytest.mark.parametrize("page", gen.TIMED_PAGES)
def test_the_times_a_page_states_are_the_records(page):
    text = (ROOT / page).read_text()
    assert gen.SETUP_TIMES.search(text), f"{page} states no recorded time"
    assert text == gen.fill_times(text), (
        f"{page}'s times differ from benchmarks/results/setup_times.jsonl's newest records:"
        " run python docs/gen_reference.py --times")


def test_each_timed_step_is_the_command_ci_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    setup = _load(ROOT / "benchmarks" / "setup_times.py", "setup_times")
    ci = " ".join((ROOT / ".ci" / "run").read_text().replace("\\\n", " ").split())
    readme = (ROOT / "README.md").read_text()
    for name, command in setup.STEPS.items():
        where = readme if name == "main" else ci
        assert " ".join(command.split()) in where, (name, command)


def test_a_time_is_written_from_the_newest_passing_record(tmp_path, monkeypatch):
    log = tmp_path / "setup_times.jsonl"
    log.write_text('{"date": "2026-01-01", "suite_s": 600, "suite_rc": 0}\n'
                   '{"date": "2026-01-03", "suite_s": 1500, "suite_rc": 1}\n'
                   '{"date": "2026-01-02", "suite_s": 130, "suite_rc": 0}\n')
    monkeypatch.setattr(gen, "_records", lambda script: sorted(
        [__import__("json").loads(x) for x in log.read_text().splitlines()],
        key=lambda r: r["date"], reverse=True))
    text = "took <!-- setup_times: suite -->about 99 minutes<!-- /setup_times -->."
    assert gen.fill_times(text) == \
        "took <!-- setup_times: suite -->about 2 minutes<!-- /setup_times -->."
    with pytest.raises(ValueError, match="--steps matrix"):
        gen.fill_times("<!-- setup_times: matrix --><!-- /setup_times -->")
