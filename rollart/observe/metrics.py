"""Live run figures: sampled in the driver, published to the scheduler, read by the dashboard.

::

    driver: Monitor (a thread)                       scheduler
    ─────────────────────────                        ─────────
    every `interval` s: stats() of InferenceWorkers,  client.log_event("rollart", msg)
      EnvManagers (+ env latencies), SampleBuffer  ─►  topic "rollart-live" (snapshots)
    every trainer step: the metrics row            ─►  topic "rollart" (kept by Dask)
                                                       RollartPlugin.log_event → RunState
                                                       ├─ /rollart Bokeh page
                                                       ├─ rollart_* on /metrics
                                                       └─ rollart status (run_on_scheduler)

Messages are plain dicts (msgpack-able): ``{"kind": "snapshot"|"step"|"warning"|"scale"|"end",
"run": name, ...}`` (a warning names a silent task or its recovery:
``rollart.observe.silent.Notice.message``). ``RunState`` folds them into the figures every reader shows; it is pure logic
(no Dask) so the page, Prometheus, ``rollart status`` and the tests share it. The sampling
side is ``rollart.observe.monitor.Monitor``.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque

from rollart.buffer.infra import INFRA_COUNTS
from rollart.buffer.ledger import BUFFERED, FINAL, TAKEN
from rollart.observe.figures import AGENT_KEYS

logger = logging.getLogger(__name__)

TOPIC = "rollart"  # start / per-step rows / end: one event per trainer step
TOPIC_LIVE = "rollart-live"  # snapshots, one per `interval`: the scheduler keeps few
#: scale requests for a running job (rollart.control.scaling: `rollart scale`, the page)
SCALE_TOPIC = "rollart-scale"
# the dashboard's state chart: in flight split by where (the env managers'), then the
# ledger's own states (taken until its update is published; lost_in_step and the rest)
TRAJ_STATES = ("generating", "in_env", "scoring", BUFFERED, TAKEN, *FINAL)
# env step latency bins (seconds), log-spaced: 100 µs .. 100 s, so stragglers stand out
LATENCY_EDGES = tuple(10 ** (e / 4) for e in range(-16, 9))
_STOP: set[str] = set()  # runs asked to stop (by ``request_stop``), this process


def request_stop(run: str) -> None:
    """Ask the run named ``run`` (its run directory's name) to stop after this step."""
    _STOP.add(run)


def stop_requested(run: str) -> bool:
    """``request_stop(run)`` was called and the run has not ended yet."""
    return run in _STOP


def histogram(values, edges=LATENCY_EDGES) -> list[int]:
    """Counts per bin; bin i is [edges[i], edges[i+1]), the first and last bins are open.

    >>> histogram([0.0, 0.002, 0.5, 500], edges=(0.001, 0.01, 1.0))
    [2, 1, 1]
    """
    counts = [0] * len(edges)
    for v in values:
        counts[max(0, bisect.bisect_right(edges, v) - 1)] += 1
    return counts


class RunState:
    """Everything the dashboard shows about one run, folded from published messages."""

    def __init__(self, run: str, history: int = 3600):
        self.run = run
        self.status = "running"
        self.info: dict = {}  # graph name, mode, steps, tasks
        self.rows: list[dict] = []  # per-step scalar figures (reward/<task>, ...)
        self.snapshot: dict = {}  # the latest live figures
        self.series: deque = deque(maxlen=history)  # (time, tokens/s per pool, buffer)
        self.staleness: dict[int, int] = {}  # trained samples by versions behind
        self.warnings: dict[tuple[str, str], str] = {}  # (task, reason) -> text, active
        self.scales: list[dict] = []  # pools resized (rollart.control.scaling), in order
        self.updated = 0.0

    def ingest(self, msg: dict) -> None:
        kind = msg.get("kind")
        self.updated = time.time()
        if kind == "start":
            self.info = dict(msg.get("info", {}))
            self.status = "running"
        elif kind == "step":
            row = msg["row"]
            self.rows.append(row)
            for k, v in row.items():
                if k.startswith("trainer/staleness/"):
                    n = int(k.rsplit("/", 1)[1])
                    self.staleness[n] = self.staleness.get(n, 0) + int(v)
        elif kind == "snapshot":
            self.snapshot = msg
            self.series.append({"time": msg["time"], "buffer": msg.get("buffer", 0),
                                **{f"tokens_per_s/{p}": v["tokens_per_s"]
                                   for p, v in msg.get("pools", {}).items()},
                                **{f"busy/{p}": v["busy"]
                                   for p, v in msg.get("pools", {}).items()}})
        elif kind == "warning":
            key = (msg.get("task", "?"), msg.get("reason", "?"))
            if msg.get("active", True):
                self.warnings[key] = msg.get("text", "")
            else:
                self.warnings.pop(key, None)
        elif kind == "scale":
            self.scales.append({k: msg.get(k) for k in ("step", "pool", "from", "to",
                                                        "time")})
        elif kind == "end":
            self.status = msg.get("status", "finished")

    # -- views ------------------------------------------------------------------------
    def tasks(self) -> list[str]:
        return sorted({k[7:] for r in self.rows for k in r
                       if k.startswith("reward/") and k != "reward/mean"})

    def reward_curves(self) -> dict[str, tuple[list, list]]:
        out = {}
        for task in self.tasks():
            pts = [(r["step"], r[f"reward/{task}"]) for r in self.rows
                   if r.get(f"reward/{task}") is not None]
            out[task] = ([p[0] for p in pts], [p[1] for p in pts])
        return out

    def summary(self) -> dict:
        """The live figures as one flat-ish dict (what ``rollart status`` prints)."""
        last = self.rows[-1] if self.rows else {}
        snap = self.snapshot
        return {
            "run": self.run, "status": self.status, **self.info,
            "step": last.get("step", 0), "version": last.get("version"),
            "elapsed_s": snap.get("elapsed", last.get("time", 0.0)),
            "reward": {t: last[f"reward/{t}"] for t in self.tasks() if f"reward/{t}" in last},
            "trajectories": snap.get("states", {}),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "env_step_p50_s": snap.get("env_p50", 0.0),
            "env_step_p99_s": snap.get("env_p99", 0.0),
            "pools": snap.get("pools", {}),
            "workers": snap.get("workers", {}),
            "buffer": snap.get("buffer", 0),
            "warnings": list(self.warnings.values()),  # silent tasks, now
            "scales": list(self.scales),  # pools resized: step, pool, from, to, time
            # agent tasks' endpoint counters (rollart.observe.figures.AGENT_KEYS) at the
            # last step: calls, history rewrites, generated tokens they dropped
            "agents": {key.rsplit("agent_", 1)[1]: last[key] for key in AGENT_KEYS
                       if last.get(key)},
            # members lost to infrastructure, groups they left too small (at the last
            # step: rollart.buffer.infra.INFRA_COUNTS), when any
            "infra": {k: last[f"rollout/{k}"] for k in INFRA_COUNTS
                      if last.get(f"rollout/{k}")},
        }

    def prometheus(self) -> list[tuple[str, str, dict, float]]:
        """``(name, help, labels, value)`` samples, all named ``rollart_*``."""
        s, run = self.summary(), {"run": self.run}
        out = [("rollart_step", "trainer steps done", run, s["step"]),
               ("rollart_buffer_trajectories", "trajectories held by the sample buffer",
                run, s["buffer"]),
               ("rollart_env_step_p99_seconds", "env step latency, 99th percentile", run,
                s["env_step_p99_s"]),
               ("rollart_running", "1 while the run is running", run,
                float(self.status == "running"))]
        out += [("rollart_reward", "mean reward of the last trained batch",
                 {**run, "task": t}, v) for t, v in s["reward"].items()]
        out += [("rollart_trajectories", "trajectories by state", {**run, "state": k}, v)
                for k, v in s["trajectories"].items()]
        out += [("rollart_staleness_trained_total", "trained samples by versions behind",
                 {**run, "versions_behind": str(k)}, v) for k, v in s["staleness"].items()]
        for pool, p in s["pools"].items():
            lab = {**run, "pool": pool}
            out += [("rollart_tokens_per_second", "generated tokens/s", lab, p["tokens_per_s"]),
                    ("rollart_busy_fraction", "engine busy fraction", lab, p["busy"]),
                    ("rollart_tokens_generated_total", "generated tokens", lab, p["tokens"])]
        out += [("rollart_weight_version", "weight version held", {**run, "worker": a,
                 "pool": w["pool"]}, w["version"]) for a, w in s["workers"].items()]
        return [(n, h, lab, float(v)) for n, h, lab, v in out
                if v is not None and not (isinstance(v, float) and math.isnan(v))]


def fold(messages) -> dict[str, RunState]:
    """``{run: RunState}`` from ``(time, msg)`` pairs or messages (e.g. Dask's events)."""
    runs: dict[str, RunState] = {}
    for m in messages:
        msg = m[1] if isinstance(m, (tuple, list)) else m
        if isinstance(msg, dict) and "run" in msg:
            runs.setdefault(msg["run"], RunState(msg["run"])).ingest(msg)
    return runs
