"""The live monitor: samples a run's actors in a thread and publishes figures to the
scheduler (``rollart.observe.metrics`` has the message format and ``RunState``).

It reads what the fleet samples (``rollart.control.fleet.Fleet.sample``: the one
reader of the actors' figures, which the step row and the watchdog use too). The
control loop's only hooks are ``Monitor.step(row, sample)`` (returns False once
``request_stop`` named the run), ``Monitor.notice`` (a silent task,
``rollart.observe.silent``) and ``Monitor.close()``. ``install`` registers the
dashboard plugin (``rollart.observe.dashboard``) on the scheduler.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from rollart.observe.dashboard.plugin import RollartPlugin
from rollart.observe.figures import pool_totals
from rollart.observe.metrics import _STOP, TOPIC, TOPIC_LIVE, TRAJ_STATES, histogram

logger = logging.getLogger(__name__)


class Monitor:
    """Publishes a run's figures to the scheduler: a snapshot every ``interval`` s from
    the fleet's sample (``rollart.control.fleet.Fleet.sample``, read in a thread), and
    each step's row with the snapshot of the step's own sample.

    Used by the control loop: ``monitor.step(row, sample)`` after each trainer step
    (False once ``request_stop`` named this run), and ``monitor.close()`` before the
    actors shut down.
    """

    def __init__(self, client, fleet, graph, run: str, interval: float = 1.0):
        self.client, self.fleet, self.run = client, fleet, run
        self.interval = interval
        self._prev: dict[str, tuple[float, float, float]] = {}  # pool -> (t, tokens, busy)
        self._rates: dict[str, tuple[float, float]] = {}  # pool -> (tokens/s, busy)
        self._warned = False
        self._t0 = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        install(client)
        self._publish({"kind": "start", "info": {
            "graph": graph.name, "mode": graph.mode, "steps": graph.steps,
            "alpha": graph.algo.alpha,
            "tasks": [getattr(t, "name", str(t)) for t in graph.tasks]}})
        self._thread = threading.Thread(target=self._loop, name=f"rollart-monitor-{run}",
                                        daemon=True)
        self._thread.start()

    def step(self, row: dict, sample=None) -> bool:
        """Publish the step's snapshot (of ``sample``, the step's own) and ``row``."""
        if sample is not None:
            with self._lock:
                self._publish(self.snapshot(sample))
        self._publish({"kind": "step", "row": {k: v for k, v in row.items()
                                               if isinstance(v, (int, float))}})
        return self.run not in _STOP

    def notice(self, notice) -> None:
        """Publish a ``rollart.observe.silent.Notice`` (a task silent or recovered)."""
        self._publish(notice.message(self.run))

    def scaled(self, event: dict) -> None:
        """Publish a pool resized (``rollart.control.scaling``: a mark on the page's
        plots, a line under its header and in ``rollart status``)."""
        self._publish({"kind": "scale", "step": event["step"], "pool": event["pool"],
                       "from": event["from"], "to": event["to"], "time": event["at"]})

    def close(self, status: str | None = None) -> None:
        """Stop sampling; the run ends as ``status`` (default: failed while an exception
        propagates, stopped if a stop was requested, else finished)."""
        self._stop.set()
        self._thread.join(timeout=10)
        if status is None:
            status = ("failed" if sys.exc_info()[0] is not None else
                      "stopped" if self.run in _STOP else "finished")
        _STOP.discard(self.run)
        self._publish({"kind": "end", "status": status})

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> dict | None:
        """Read the actors' figures once (never healing: that is the driver thread's) and
        publish a snapshot; None if that failed."""
        try:
            with self._lock:
                snap = self.snapshot(self.fleet.sample(latencies=True, timeout=10,
                                                       heal=False))
        except Exception as e:  # noqa: BLE001 - monitoring never stops a run
            logger.debug("rollart monitor: %s: %s", type(e).__name__, e)
            return None
        self._publish(snap)
        return snap

    def snapshot(self, sample) -> dict:
        """The dashboard's snapshot of a ``Sample``: states, per-pool rates, latencies."""
        now = time.time()
        pools = pool_totals(sample.workers)
        workers = {addr or tag: {"pool": tag, "version": s["version"]}
                   for tag, addr, s in sample.workers}
        for tag, p in pools.items():
            t, tok, busy = self._prev.get(tag, (self._t0, 0, 0.0))
            dt = max(now - t, 1e-6)
            if dt < self.interval / 2 and tag in self._rates:  # too close: keep the rates
                p["tokens_per_s"], p["busy"] = self._rates[tag]
                continue
            p["tokens_per_s"] = (p["tokens"] - tok) / dt
            p["busy"] = min(1.0, (p["busy_s"] - busy) / dt / max(p["workers"], 1))
            self._prev[tag] = (now, p["tokens"], p["busy_s"])
            self._rates[tag] = (p["tokens_per_s"], p["busy"])
        running: dict[str, int] = {}
        for s in sample.managers:
            for k, v in s.get("states", {}).items():
                running[k] = running.get(k, 0) + v
        lat, buf = sorted(sample.latencies), sample.buffer
        states = {k: running.get(k, 0) for k in ("generating", "in_env", "scoring")}
        states.update({k: buf.get(k, 0) for k in TRAJ_STATES[3:]})
        states["launched"] = buf.get("launched", 0)
        states["in_flight"] = buf.get("in_flight", 0)
        return {"kind": "snapshot", "time": now, "elapsed": now - self._t0,
                "states": states, "pools": pools, "workers": workers,
                "buffer": buf.get("buffered_rows", 0),
                "env_latency": histogram(lat),  # bins: LATENCY_EDGES
                "env_p50": lat[len(lat) // 2] if lat else 0.0,
                "env_p99": lat[int(len(lat) * 0.99)] if lat else 0.0}

    def _publish(self, msg: dict) -> None:
        topic = TOPIC_LIVE if msg.get("kind") == "snapshot" else TOPIC
        try:
            self.client.log_event(topic, {**msg, "run": self.run})
        except Exception as e:  # noqa: BLE001 - monitoring never stops a run
            (logger.debug if self._warned else logger.warning)(
                "rollart monitor could not publish %s: %s: %s", msg.get("kind"),
                type(e).__name__, e)
            self._warned = True


def install(client) -> bool:
    """Register the dashboard plugin on the client's scheduler (once); False if it can't.

    A scheduler that cannot import rollart still keeps the published events, so
    ``rollart status`` works; only the page and ``/metrics`` need the plugin (or start
    the scheduler with ``dask scheduler --preload rollart.observe.dashboard``).
    """
    try:
        client.register_plugin(RollartPlugin(), name=RollartPlugin.name)
        return True
    except Exception as e:  # noqa: BLE001
        logger.warning("rollart dashboard plugin not installed on the scheduler: %s", e)
        return False
