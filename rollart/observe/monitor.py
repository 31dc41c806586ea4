"""The live monitor: samples a run's actors in a thread and publishes figures to the
scheduler (``rollart.observe.metrics`` has the message format and ``RunState``).

The control loop's only hooks are ``Monitor.step(metrics)`` (returns False once
``request_stop`` named the run) and ``Monitor.close()``. ``install`` registers the
dashboard plugin (``rollart.observe.dashboard``) on the scheduler.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from rollart.observe.dashboard.plugin import RollartPlugin
from rollart.observe.metrics import _STOP, TOPIC, TOPIC_LIVE, TRAJ_STATES, histogram

logger = logging.getLogger(__name__)


class Monitor:
    """Samples a run's actors in a thread and publishes figures to the scheduler.

    Used by the control loop: ``monitor.step(metrics)`` after each trainer step (adds
    per-pool figures to ``metrics``; False once ``request_stop`` named this run), and
    ``monitor.close()`` before the actors shut down.
    """

    def __init__(self, client, actors, graph, run: str, interval: float = 1.0):
        self.client, self.actors, self.run = client, actors, run
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

    def step(self, metrics: dict) -> bool:
        snap = self.sample()
        if snap is not None:
            for pool, p in snap["pools"].items():
                metrics[f"rollout/tokens/{pool}"] = p["tokens"]
                metrics[f"rollout/busy_s/{pool}"] = p["busy_s"]
        self._publish({"kind": "step", "row": {k: v for k, v in metrics.items()
                                               if isinstance(v, (int, float))}})
        return self.run not in _STOP

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
        """Read the actors' stats once and publish a snapshot; None if that failed."""
        try:
            with self._lock:
                snap = self._collect()
        except Exception as e:  # noqa: BLE001 - monitoring never stops a run
            logger.debug("rollart monitor: %s: %s", type(e).__name__, e)
            return None
        self._publish(snap)
        return snap

    def _collect(self) -> dict:
        a = self.actors
        wf = [(w.stats(), tag) for w, tag, _ in a.workers]
        mf = [(m.stats(), m.env_latencies()) for m in a.managers]
        bf = a.buffer.stats()
        ws = [(f.result(timeout=10), tag) for f, tag in wf]
        ms = [(s.result(timeout=10), lat.result(timeout=10)) for s, lat in mf]
        buf = bf.result(timeout=10)
        now = time.time()
        pools, workers = {}, {}
        for s, tag in ws:
            p = pools.setdefault(tag, {"tokens": 0, "busy_s": 0.0, "workers": 0})
            p["tokens"] += s["tokens_generated"]
            p["busy_s"] += s["busy_seconds"]
            p["workers"] += 1
            workers[s["address"] or tag] = {"pool": tag, "version": s["version"]}
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
        lat: list[float] = []
        for s, ls in ms:
            for k, v in s.get("states", {}).items():
                running[k] = running.get(k, 0) + v
            lat += ls.tolist()  # one float64 array per manager
        lat.sort()
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
