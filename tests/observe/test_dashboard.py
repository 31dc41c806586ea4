"""The RollArt dashboard page, Prometheus figures and ``rollart status``.

Pure figure logic without a cluster; a separate ``dask scheduler --preload
rollart.observe.dashboard`` process fed through Dask's event topic; and (slow, browser) the page
in headless Chromium during a short real run, driven through the Client-first API.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from rollart.observe.metrics import TOPIC, TOPIC_LIVE, fold, histogram

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("ROLLART_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def _messages(run="r1", steps=3):
    """What a Monitor publishes for a short run (start, snapshots, step rows, end)."""
    msgs = [{"kind": "start", "run": run, "info": {"graph": "gridnav", "mode": "async",
                                                   "steps": steps, "alpha": 1,
                                                   "tasks": ["gridnav", "guess"]}}]
    for s in range(1, steps + 1):
        msgs.append({"kind": "snapshot", "run": run, "time": 100.0 + s, "elapsed": s,
                     "states": {"generating": 3, "in_env": 1, "scoring": 0, "buffered": 2,
                                "trained": 32 * s, "dropped": 0, "aborted": 1,
                                "cancelled": 0, "failed": 0, "launched": 40 * s},
                     "pools": {"H800": {"tokens": 100 * s, "busy_s": s * 0.5, "workers": 1,
                                        "tokens_per_s": 100.0, "busy": 0.5}},
                     "workers": {"tcp://127.0.0.1:1": {"pool": "H800", "version": s}},
                     "buffer": 2, "env_latency": histogram([0.01, 0.02, 3.0]),
                     "env_p50": 0.02, "env_p99": 3.0})
        msgs.append({"kind": "step", "run": run, "row": {
            "step": s, "version": s, "time": float(s), "reward/gridnav": 0.1 * s,
            "reward/guess": 0.2, "reward/mean": 0.15, "trainer/staleness/0": 16,
            "trainer/staleness/1": 16}})
        if s == 1:  # a pool resized (Run.scale) before step 2
            msgs.append({"kind": "scale", "run": run, "step": 2, "pool": "env", "from": 1,
                         "to": 2, "time": 101.5})
    msgs.append({"kind": "end", "run": run, "status": "finished"})
    return msgs


def test_histogram_bins_stragglers_apart():
    counts = histogram([0.001, 0.0011, 0.05, 30.0])
    assert sum(counts) == 4 and counts[-1] == 0
    assert counts.index(2) < counts.index(1)  # the two fast steps share a bin
    assert histogram([1e9])[-1] == 1 and histogram([0.0])[0] == 1


def test_run_state_folds_messages():
    runs = fold([(0.0, m) for m in _messages()] + [(0.0, {"not": "ours"})])
    r = runs["r1"]
    assert r.status == "finished" and r.tasks() == ["gridnav", "guess"]
    assert r.reward_curves()["gridnav"] == ([1, 2, 3], [0.1, 0.2, pytest.approx(0.3)])
    assert r.staleness == {0: 48, 1: 48}
    s = r.summary()
    assert s["step"] == 3 and s["workers"]["tcp://127.0.0.1:1"]["version"] == 3
    assert s["scales"] == [{"step": 2, "pool": "env", "from": 1, "to": 2, "time": 101.5}]
    names = {n for n, *_ in r.prometheus()}
    assert {"rollart_reward", "rollart_trajectories", "rollart_staleness_trained_total",
            "rollart_tokens_per_second", "rollart_busy_fraction",
            "rollart_weight_version", "rollart_buffer_trajectories"} <= names
    json.dumps(s)  # what `rollart status --json` prints


def test_status_shows_the_agent_counters_of_the_last_row():
    from rollart.observe.dashboard.status import format_status

    msgs = _messages()
    msgs[-2]["row"].update({"rollout/agent_calls": 12, "rollout/agent_rewrites": 3,
                            "rollout/agent_dropped_tokens": 40})
    s = fold(msgs)["r1"].summary()
    assert s["agents"] == {"calls": 12, "rewrites": 3, "dropped_tokens": 40}
    assert "  agents:       calls=12  rewrites=3  dropped_tokens=40" in format_status(
        {"r1": s})
    assert "agents:" not in format_status({"r1": fold(_messages())["r1"].summary()})
    assert "  scaled:       env 1 -> 2 workers before step 2" in format_status({"r1": s})
    json.dumps(s)  # `rollart status --json`


def test_page_fills_every_plot_from_a_run_state():
    pytest.importorskip("bokeh")
    from rollart.observe.dashboard.page import PLOTS, RollartPage

    class Holder:
        runs = fold(_messages())

        def latest(self):
            return self.runs["r1"]

    page = RollartPage(Holder())
    page.update()
    for name in PLOTS:
        data = page.sources[name].data
        assert any(len(v) for v in data.values()), name
    assert "finished" in page.header.text and "step 3/3" in page.header.text
    assert "scaled: env 1 -&gt; 2 workers before step 2" in page.header.text
    assert page.sources["scales"].data["step"] == [2]  # the reward plot's mark
    assert page.sources["scales"].data["t"] == [0.5]  # the tokens plot's, in its seconds


def test_the_pages_scale_control_asks_the_running_run():
    """The page's scale control sends what ``rollart scale`` sends: a request on the
    scheduler's scale topic, which the run's driver hears (rollart.control.scaling)."""
    pytest.importorskip("bokeh")
    from rollart.observe.dashboard.page import RollartPage
    from rollart.observe.metrics import SCALE_TOPIC

    class Scheduler:
        def __init__(self):
            self.sent = []

        def log_event(self, topic, msg):
            self.sent.append((topic, msg))

    class Holder:
        runs = fold(_messages()[:-1])  # still running
        scheduler = Scheduler()

        def latest(self):
            return self.runs["r1"]

    page = RollartPage(Holder())
    page.scale_pool.value, page.scale_n.value = "infer-h20", 2
    page.ask_scale()
    assert Holder.scheduler.sent == [(SCALE_TOPIC, {"run": "r1", "pool": "infer-h20",
                                                    "n": 2})]
    assert "asked r1 to run 2 worker(s) in infer-h20" in page.scale_said.text
    Holder.runs = fold(_messages())  # finished: nothing to scale
    page.ask_scale()
    assert len(Holder.scheduler.sent) == 1 and "no running run" in page.scale_said.text


def test_page_shows_the_latest_decoded_trajectories_per_task():
    """The plugin keeps the newest ``rollart-samples`` message per run; the page's
    ``rollart-samples`` section shows its turns, escaped, grouped by task."""
    pytest.importorskip("bokeh")
    from rollart.observe.dashboard.page import RollartPage
    from rollart.observe.dashboard.plugin import RollartPlugin
    from rollart.observe.samples import TOPIC_SAMPLES

    def traj(task, seed, action):
        return {"traj_id": f"{task}-{seed}", "task": task, "seed": seed, "reward": 1.0,
                "outcome": "success", "state": "trained", "version": 2, "num_turns": 1,
                "error": "", "turns": [{"observation": f"{task} : goal <b>", "action":
                                        action, "version": 2}]}

    plugin = RollartPlugin()
    for m in _messages():
        plugin.log_event(TOPIC_LIVE if m["kind"] == "snapshot" else TOPIC, m)
    plugin.log_event(TOPIC_SAMPLES, {"kind": "samples", "run": "r1",
                                     "trajectories": [traj("gridnav", 1, "up")]})
    page = RollartPage(plugin)
    page.update()
    text = page.samples.text
    assert "gridnav : goal &lt;b&gt;" in text and "<code>up</code>" in text
    plugin.log_event(TOPIC_SAMPLES, {"kind": "samples", "run": "r1", "trajectories": [
        traj("gridnav", 2, "left"), traj("guess", 3, "7")]})
    page.update()  # newer samples replace the old ones, even with no new step
    text = page.samples.text
    assert "<h4>gridnav</h4>" in text and "<h4>guess</h4>" in text and "seed 1" not in text
    assert "<code>left</code>" in text and "(v2)" in text


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def separate_scheduler(tmp_path_factory):
    """``dask scheduler --preload rollart.observe.dashboard`` in its own process."""
    d = tmp_path_factory.mktemp("sched")
    sfile = d / "scheduler.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--dashboard-address", "127.0.0.1:0", "--scheduler-file",
         str(sfile), "--preload", "rollart.observe.dashboard"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(d / "log", "w"))
    deadline = time.time() + 300  # imports torch & co.: slow on a crowded machine
    while not sfile.exists():
        assert proc.poll() is None and time.time() < deadline, (d / "log").read_text()
        time.sleep(0.2)
    time.sleep(0.5)
    ident = json.loads(sfile.read_text())
    yield ident["address"], f"http://127.0.0.1:{ident['services']['dashboard']}"
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def test_separate_scheduler_page_metrics_and_status(separate_scheduler, capsys):
    from distributed import Client

    from rollart.app.cli import main

    address, http = separate_scheduler
    with Client(address) as client:
        for m in _messages("remote-run"):
            client.log_event(TOPIC_LIVE if m["kind"] == "snapshot" else TOPIC, m)
        state = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["rollart"].state())
    assert state["remote-run"]["step"] == 3
    page = _get(f"{http}/rollart")
    assert "rollart" in page and "bokeh" in page.lower()  # the Bokeh app + nav link
    assert 'href="rollart"' in _get(f"{http}/status")  # linked from the dashboard nav
    metrics = _get(f"{http}/metrics")
    assert 'rollart_reward{run="remote-run",task="gridnav"} 0.3' in metrics
    assert 'rollart_weight_version{pool="H800",run="remote-run"' in metrics
    assert main(["status", "--scheduler", address]) == 0
    out = capsys.readouterr().out
    assert "remote-run" in out and "gridnav" in out and "H800" in out
    assert main(["status", "--scheduler", address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["remote-run"]["step"] == 3


def test_status_without_plugin_reads_events(capsys):
    """A scheduler without rollart's plugin still keeps the events ``status`` reads."""
    from distributed import Client, LocalCluster

    from rollart.app.cli import main

    with LocalCluster(n_workers=0, dashboard_address=":0", processes=False) as cluster, \
            Client(cluster) as client:
        for m in _messages("plain"):
            client.log_event(TOPIC_LIVE if m["kind"] == "snapshot" else TOPIC, m)
        assert main(["status", "--scheduler", cluster.scheduler_address]) == 0
    out = capsys.readouterr().out
    assert "plain" in out and "finished" in out


def _chromium():
    pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("headless chromium not installed (apt-get install chromium "
                    "chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1300"):
        opts.add_argument(flag)
    import tempfile

    opts.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='rollart-chromium-')}")
    return webdriver.Chrome(service=Service(driver), options=opts)


JS_DATA = """
const doc = Bokeh.documents[0];
const out = {};
for (const p of arguments[0]) {
  const m = doc.get_model_by_name('rollart-' + p);
  out[p] = m ? Math.max(0, ...Object.values(m.data).map(v => v.length)) : -1;
}
return out;
"""


@pytest.mark.slow
@pytest.mark.browser
def test_dashboard_in_chromium_during_a_run(tmp_path, capsys):
    """A real short run: page in Chromium with data in every plot, then a graceful stop,
    metrics as a DataFrame, samples as Arrow, and ``rollart report``."""
    from distributed import Client

    import rollart
    from rollart.app.api import start_run, wait_for_step
    from rollart.app.cli import main
    from rollart.observe.dashboard.page import PLOTS

    browser = _chromium()
    g, _ = rollart.load_graph("gridnav")
    g = replace(g, steps=50, policy=replace(g.policy, warmup_steps=5))
    res = replace(rollart.load_resources(), processes=False, dashboard_address=":0")
    try:
        with res.make_cluster() as cluster, Client(cluster) as client:
            run = start_run(client, g, run_dir=tmp_path / "run")
            wait_for_step(run, 1, timeout=500)
            assert run.status == "running", run.error
            browser.get(run.dashboard_link)
            deadline, data = time.time() + 60, {}
            while time.time() < deadline:
                data = browser.execute_script(
                    "return window.Bokeh && Bokeh.documents.length ? 1 : 0") and \
                    browser.execute_script(JS_DATA, list(PLOTS))
                if data and all(data[p] > 0 for p in PLOTS) and data["reward"] > 0:
                    break
                time.sleep(1)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(ARTIFACTS / "rollart-dashboard.png"))
            assert data and all(data[p] > 0 for p in PLOTS), data
            header = browser.execute_script(
                "return Bokeh.documents[0].get_model_by_name('rollart-header').text")
            assert "running" in header and run.name in header and "gridnav graph" in header
            assert 'href="rollart"' in _get(run.dashboard_link.replace("rollart", "status"))
            assert "rollart_tokens_per_second" in _get(
                run.dashboard_link.replace("rollart", "metrics"))
            assert main(["status", "--scheduler", cluster.scheduler_address,
                         "--run", run.name]) == 0
            live = capsys.readouterr().out
            assert f"run {run.name}: running, gridnav graph" in live and "tok/s" in live
            run.stop()
            result = run.wait(timeout=300)
    finally:
        browser.quit()
    assert run.status == "stopped" and 1 <= len(result.metrics) < 50
    df = run.metrics()
    assert df.index.name == "step" and "reward/gridnav" in df and len(df) >= 1
    table = run.samples()
    assert table.num_rows > 0 and "trained" in table.column("state").to_pylist()
    assert (Path(result.model_dir) / "config.json").exists()
    assert main(["report", run.run_dir.as_posix()]) == 0
    for f in ("reward.png", "throughput.png", "staleness.png", "report.html"):
        assert (run.run_dir / f).stat().st_size > 1000, f
