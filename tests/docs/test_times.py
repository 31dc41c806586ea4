"""The set-up times and the default run's held-out table that README.md and
docs/quickstart.md state are those of ``benchmarks/setup_times.py``'s newest records
(``docs/gen_reference.py --times`` writes them in), and each step that script times is
still the command ``.ci/run`` (or the README) runs. README's pipeline row is the newest
paired record of ``benchmarks/pipeline.py`` (the same command), or says it is not
measured yet."""

import importlib.util
import json
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
    monkeypatch.setattr(gen.figures, "_records", lambda script: sorted(
        [__import__("json").loads(x) for x in log.read_text().splitlines()],
        key=lambda r: r["date"], reverse=True))
    text = "took <!-- setup_times: suite -->about 99 minutes<!-- /setup_times -->."
    assert gen.fill_times(text) == \
        "took <!-- setup_times: suite -->about 2 minutes<!-- /setup_times -->."
    with pytest.raises(ValueError, match="--steps matrix"):
        gen.fill_times("<!-- setup_times: matrix --><!-- /setup_times -->")


def test_the_readme_pipeline_row_is_the_newest_paired_record():
    text = (ROOT / "README.md").read_text()
    assert "<!-- figures: pipeline -->" in text and "<!-- figures: pipeline_command -->" in text
    assert text == gen.fill_figures(text), (
        "README.md's pipeline row differs from benchmarks/results/pipeline.jsonl's newest "
        "paired record: run python docs/gen_reference.py --times")


def _planted(monkeypatch, *records):
    monkeypatch.setattr(gen.figures, "_records", lambda script: sorted(
        [json.loads(json.dumps(r)) for r in records], key=lambda r: r["date"], reverse=True))


OLD = {"date": "2026-01-01", "command": "pipeline.py", "seeds": 3,
       "speedup_vs_syncplus": 1.04, "speedup_vs_areal": 0.56}
PAIRED = {"date": "2026-01-02", "commit": "abc1234", "load_before": [0.1, 0.2, 0.3],
          "command": "pipeline.py --redundant '' --eval-seeds 128", "seeds": 5, "steps": 30,
          "target": 0.4, "speedup_vs_syncplus": 1.1,
          "speedup_vs_syncplus_paired": 1.25, "speedup_vs_syncplus_min": 0.8,
          "speedup_vs_syncplus_max": None, "wins_vs_syncplus": 4, "pairs_vs_syncplus": 5,
          "speedup_vs_areal_paired": 0.6, "speedup_vs_areal_min": 0.4,
          "speedup_vs_areal_max": 0.9, "wins_vs_areal": 0, "pairs_vs_areal": 5,
          "speedup_vs_areal_at_async_paired": 0.9, "speedup_vs_areal_at_async_min": 0.7,
          "speedup_vs_areal_at_async_max": 1.2, "wins_vs_areal_at_async": 2,
          "pairs_vs_areal_at_async": 5, "speedup_vs_sync_paired": 1.8,
          "speedup_vs_sync_min": 1.5, "speedup_vs_sync_max": 2.0, "wins_vs_sync": 5,
          "pairs_vs_sync": 5, "pairs_vs_oneoff": 0, "inflight_async": 0.98,
          "inflight_areal": 1.7, "inflight_areal_at_async": 0.99,
          "runs": [{"label": "sync+", "seed": 1, "time_to_target_s": None, "traj_per_s": 30.0,
                    "heldout": 0.5},
                   {"label": "async", "seed": 1, "time_to_target_s": 20.0, "traj_per_s": 32.0,
                    "heldout": 0.6}]}
BLOCK = "| <!-- figures: pipeline -->x<!-- /figures --> |"


def test_without_a_paired_record_the_row_says_not_measured_yet(monkeypatch):
    _planted(monkeypatch, OLD, {"date": "2026-01-03", "command": "pipeline.py --modes async",
                                "pairs_vs_syncplus": 0, "pairs_vs_areal": 0})
    row = gen.fill_figures(BLOCK)
    assert "not measured yet" in row and "1.04× sync+" in row and "ratio of medians" in row
    assert gen.fill_figures("<!-- figures: pipeline_command --><!-- /figures -->") == \
        f"<!-- figures: pipeline_command -->`{gen.PIPELINE_COMMAND}`<!-- /figures -->"
    assert "Not measured yet" in gen.paired_table()


def test_the_row_and_the_page_show_the_newest_paired_record(monkeypatch):
    _planted(monkeypatch, OLD, PAIRED)
    row = gen.fill_figures(BLOCK)
    # a null range end of a paired ratio is an infinity (JSON has none)
    assert "async **1.25× sync+** (0.80–∞; first on 4 of 5 seeds)" in row, row
    assert "goal ≥ 2.05×: not met" in row
    assert "**0.60× areal** (0.40–0.90; first on 0 of 5 seeds) at areal's own budget" in row
    assert "0.90× areal (0.70–1.20; first on 2 of 5 seeds) at async's" in row
    assert "async 0.98, areal 1.70 steps' worth" in row
    assert gen.fill_figures(row) == row  # written again: the same
    command = gen.pipeline_figures("pipeline_command")
    assert command == ("`python benchmarks/pipeline.py --redundant '' --eval-seeds 128` "
                       "(sync+, async; 30 steps, 5 seeds)")
    page = gen.paired_table()
    assert "| areal at async's budget | 0.90× (0.70–1.20) | 2 of 5 seeds | async 0.98, " \
        "areal 0.99 |" in page, page
    assert "one-off" not in page.split("Per seed")[0]  # no pair: no row
    assert "| 1 | ∞ · 30 · 0.5 | 20 · 32 · 0.6 |" in page, page


def test_a_candidate_headline_is_named_and_paired_with_the_default(monkeypatch):
    """A record made with ``--ours async@new``: the row names the candidate, never
    passes it off as async's default, and shows it against the default too."""
    rec = {**PAIRED, "date": "2026-01-03", "ours": "async@new", "inflight_async_at_new": 1.4,
           "speedup_vs_async_paired": 1.3, "speedup_vs_async_min": 0.9,
           "speedup_vs_async_max": 1.6, "wins_vs_async": 3, "pairs_vs_async": 5}
    _planted(monkeypatch, OLD, PAIRED, rec)
    row = gen.fill_figures(BLOCK)
    assert "`async@new` (a candidate for async's default) **1.25× sync+**" in row, row
    assert "1.30× async (the default) (0.90–1.60; first on 3 of 5 seeds)" in row, row
    assert "async@new 1.40, areal 1.70" in row, row
    page = gen.paired_table()
    assert "| async@new against | paired ratio" in page, page
    assert "| async (the default) | 1.30× (0.90–1.60) | 3 of 5 seeds | async@new 1.40, " \
        "async 0.98 |" in page, page


def test_the_fanout_limits_and_simulator_rows_come_from_their_records(monkeypatch):
    """README's other generated rows: "not measured yet" (with the older figures) until
    a record has the new figures, then the newest such record's, a loss said as one."""
    old = {"limits": [{"date": "2026-01-01", "commit": "a", "model": "built-in",
                       "trainer_vs_bare": 0.87, "rollout_vs_bare": 0.18}],
           "cluster_sim": [{"date": "2026-01-01", "calibration_error_heldout": 0.12,
                            "calibration_error_heldout_max": 0.25}],
           "weight_sync": []}
    monkeypatch.setattr(gen.figures, "_records", lambda script: old.get(script, []))
    assert "**not measured yet** (the newest record before them: `trainer_vs_bare` 0.87" \
        in gen.figures.limits_figures()
    assert "median error 0.12, worst 0.25" in gen.figures.sim_figures()
    assert "not measured yet" in gen.figures.fanout_figures()
    new = {"limits": [{"date": "2026-01-03", "commit": "b", "model": "smollm2",
                       "rollout_vs_replay": 0.1, "trainer_vs_bare": 0.5},  # not the toy
                      {"date": "2026-01-02", "commit": "c", "model": "built-in",
                       "rollout_vs_replay": 0.9, "rollout_vs_replay_cpu": 0.95,
                       "rollout_vs_replay_free": 0.4, "useful_share": 0.6,
                       "trainer_vs_bare": 0.91, "inference_idle": 0.3}] + old["limits"],
           "cluster_sim": [{"date": "2026-01-02", "commit": "d", "invocations": 3,
                            "heldout_configs": 11, "heldout_within_015": 5,
                            "heldout_within_015_0": 7, "heldout_within_015_1": 5,
                            "heldout_within_015_2": 6, "heldout_worst": 0.31,
                            "frozen": "abc"}],
           "weight_sync": [{"date": "2026-01-02", "commit": "e", "fanout_mib": 128.0,
                            "origin_bytes_ratio_8": 0.125, "fanout_s_8": 1.6,
                            "fanout_s_8_norelay": 1.4, "fanout_speedup_8": 0.86}]}
    monkeypatch.setattr(gen.figures, "_records", lambda script: new.get(script, []))
    limits = gen.figures.limits_figures()
    assert "`rollout_vs_replay` **0.90**" in limits and "record of 2026-01-02" in limits
    assert "`useful_share` **0.60** (goal ≥ 0.7)" in limits and "0.95" in limits
    sim = gen.figures.sim_figures()
    assert "predicts 11 it never probed" in sim, sim
    assert "within 0.15 7, 5, 6 (the fewest **5**; goal ≥ 6 of 8" in sim, sim
    assert "frozen at `abc`" in sim and "worst error **0.31**" in sim, sim
    fan = gen.figures.fanout_figures()
    assert "`fanout_speedup_8` = **0.86** (goal > 1: a loss" in fan, fan


def test_a_candidate_run_beside_the_default_is_shown_against_it(monkeypatch):
    """The default as the headline and ``async@new`` beside it (a record made before the
    switch, ``inflight="alpha"``): the row names the default of then, and gives the
    candidate's time ÷ the default's, the seeds the default was first on, and that the
    candidate is the default now."""
    rec = {**PAIRED, "date": "2026-01-04", "speedup_vs_async_at_new_paired": 0.89,
           "speedup_vs_async_at_new_min": 0.7, "speedup_vs_async_at_new_max": 1.09,
           "wins_vs_async_at_new": 1, "pairs_vs_async_at_new": 5, "inflight": "alpha"}
    _planted(monkeypatch, PAIRED, rec)
    row = gen.fill_figures(BLOCK)
    assert ("async (its default then: one step's worth in flight, stale members aborted) "
            "**1.25× sync+**") in row, row
    assert ("a candidate for the default, `async@new` (async's default since 2026-12-07): "
            "its time ÷ the default's 0.89× (0.70–1.09), the default first on 1 of 5 "
            "seeds") in row, row


def test_the_earlier_default_beside_the_present_one_is_shown_as_such(monkeypatch):
    """A record made after the switch (``inflight="mode"``) with ``async@one`` beside the
    default: plain "async", the earlier setting "beside it"."""
    rec = {**PAIRED, "date": "2026-01-05", "speedup_vs_async_at_one_paired": 1.2,
           "speedup_vs_async_at_one_min": 0.9, "speedup_vs_async_at_one_max": 1.5,
           "wins_vs_async_at_one": 4, "pairs_vs_async_at_one": 5, "inflight": "mode"}
    _planted(monkeypatch, PAIRED, rec)
    row = gen.fill_figures(BLOCK)
    assert "async **1.25× sync+**" in row and "its default then" not in row, row
    assert ("beside it, `async@one`: its time ÷ the default's 1.20× (0.90–1.50), the "
            "default first on 4 of 5 seeds") in row, row


def test_the_trl_row_is_the_newest_full_vs_trl_real_record(monkeypatch):
    """README's TRL row: "not measured yet" with only a smoke record; then the newest
    full record's ratio, win count and held-out figures, a single seed said as one."""
    quick = {"date": "2026-01-01", "command": "vs_trl_real.py --quick", "speedup": None}
    monkeypatch.setattr(gen.figures, "_records", lambda script: [quick])
    assert "**not measured yet**" in gen.figures.trl_real_figures()
    smoke = {**quick, "speedup": 2.0}
    one = {"date": "2026-01-02", "command": "vs_trl_real.py --seeds 1 --resume",
           "speedup": 4.4, "speedup_each": "4.4", "rollart_wins": 1, "seeds": 1,
           "steps": 40, "method": "lora", "task": "guess_number", "target": 0.3375,
           "before": 0.1875, "heldout_equal_rollart": 0.72, "heldout_equal_trl": 0.32,
           "heldout_final_rollart": 0.72, "heldout_final_trl": 0.76}
    monkeypatch.setattr(gen.figures, "_records", lambda script: [smoke, one])
    row = gen.figures.trl_real_figures()  # the newest is a smoke run: skipped
    assert "TRL's ÷ rollart's **4.40×**, rollart first on 1 of 1 seed;" in row, row
    assert "(one seed: not yet a median)" in row and "record of 2026-01-02" in row, row
    three = {**one, "seeds": 3, "speedup": 0.8, "speedup_each": "4.4/0.8/0.5",
             "rollart_wins": 1}
    monkeypatch.setattr(gen.figures, "_records", lambda script: [three, one])
    row = gen.figures.trl_real_figures()
    assert "**0.80×** (4.4/0.8/0.5), rollart first on 1 of 3 seeds" in row, row
    assert "not yet a median" not in row and "in flight" not in row  # says no default
    side = {"mode": "async", "max_in_flight": "auto", "stale_members": "rescore"}
    monkeypatch.setattr(gen.figures, "_records", lambda script: [{**three, "rollart": side}])
    row = gen.figures.trl_real_figures()  # a newer record names rollart's default
    assert "(lora, 40 steps each; rollart async, in flight `auto`, stale members " \
        "`rescore`)" in row, row


def test_a_record_without_areal_at_asyncs_budget_or_sync_says_so(monkeypatch):
    """A run of sync+, areal and async only: the row gives the pairs that ran and says
    the equal-budget one did not, instead of printing empty ratios."""
    rec = {**PAIRED, "date": "2026-01-06", "pairs_vs_areal_at_async": 0,
           "speedup_vs_areal_at_async_paired": None, "pairs_vs_sync": 0,
           "speedup_vs_sync_paired": None, "inflight": "mode"}
    _planted(monkeypatch, PAIRED, rec)
    row = gen.fill_figures(BLOCK)
    assert "**0.60× areal** (0.40–0.90; first on 0 of 5 seeds) at areal's own budget " \
        "(areal at async's: not run); groups in flight" in row, row
    assert " sync (" not in row and "of 0 seeds" not in row, row
    # a newer run of sync, areal and async at the same default fills in sync's pair
    with_sync = {"date": "2026-01-07", "pairs_vs_sync": 5, "wins_vs_sync": 5,
                 "speedup_vs_sync_paired": 3.9, "speedup_vs_sync_min": 1.9,
                 "speedup_vs_sync_max": None, "throughput_vs_sync": 2.71,
                 "inflight": "mode", "pairs_vs_areal": 5, "wins_vs_areal": 1,
                 "speedup_vs_areal_paired": 0.69}
    _planted(monkeypatch, with_sync, rec)
    row = gen.fill_figures(BLOCK)
    assert "at areal's own budget (later runs at the same default: 0.69× (1 of 5)) " \
        "(areal at async's: not run), 3.90× sync (1.90–∞; first on 5 of 5 seeds) " \
        "(the record of 2026-01-07) and 2.71× sync's trajectories/s (goal ≥ 2.65×: met)" \
        in row, row
    _planted(monkeypatch, {**with_sync, "inflight": "alpha"}, rec)  # another default
    assert " sync (" not in gen.fill_figures(BLOCK)
