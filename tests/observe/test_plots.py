"""``rollart report RUN``: reward, throughput and staleness plots plus one HTML page, from a
run directory's ``metrics.jsonl``; doctests of the figure helpers."""

import doctest
import json

import rollart.observe.metrics
import rollart.observe.plots
from rollart.app.cli import main
from rollart.observe.plots import rates, staleness_counts


def _rows(n=6):
    rows = []
    for s in range(1, n + 1):
        rows.append({"step": s, "version": s, "time": 2.0 * s, "reward/gridnav": s / 10,
                     "reward/guess": 0.3, "rollout/tokens_generated": 300 * s,
                     "rollout/tokens/H800": 100 * s, "rollout/tokens/H20": 200 * s,
                     "trainer/staleness_mean": 0.5, "trainer/staleness_max": 1,
                     "trainer/staleness/0": 8, "trainer/staleness/1": 8,
                     "traj/trained": 16 * s})
    return rows


def test_doctests():
    for module in (rollart.observe.metrics, rollart.observe.plots):
        assert doctest.testmod(module).failed == 0


def test_rates_and_staleness_from_rows():
    rows = _rows()
    assert rates([r["time"] for r in rows], [r["rollout/tokens/H20"] for r in rows]) == \
        [100.0] * 6
    assert staleness_counts(rows) == {0: 48, 1: 48}


def test_report_writes_pngs_and_html(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("reward.png", "throughput.png", "staleness.png", "report.html"):
        assert (tmp_path / name).stat().st_size > 1000 and name in out
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "reward/gridnav" in page
    assert main(["report", str(tmp_path / "nope")]) == 2
