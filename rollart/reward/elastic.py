"""The elastic reward pool: Dask workers that come with demand and go when idle.

Two pieces, both on the run's own cluster (no second cluster in the process: actor
handles of two clusters in one process can hang):

* ``ServerlessMonitor`` — a scheduler plugin that watches every resource-tagged task
  and worker. Per tag it knows the queue (tasks waiting for a slot), what runs, the pool
  size over time, worker-seconds held, busy seconds (the tasks' compute time), task
  latency (submitted → done) and cold waits (tasks that found no worker). Read it with
  ``pool_stats(client, tag)``; ``ElasticPool`` reads it through a scheduler handler.
* ``ElasticPool`` — Dask's adaptive core (``distributed.deploy.adaptive_core``) applied
  to just the workers it owns in a ``SpecCluster``: target = ceil(tasks waiting or
  running / threads), capped at ``max_workers``; a new worker is a cold start (counted, with its start-up
  time); a worker idle for ``idle_timeout`` seconds (as the scheduler saw it) is
  retired, down to zero. The fixed pools of the cluster are never touched.

``start_pools(client, rewards)`` starts the pools that serverless rewards with
``backend="pool"`` need (used by ``rollart.control.loop``); ``ElasticPool.stop`` ends one.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from distributed.deploy.adaptive_core import AdaptiveCore
from distributed.diagnostics.plugin import SchedulerPlugin

from rollart.reward.offload import SERVERLESS, is_serverless
from rollart.policy.scaling import Scaling

logger = logging.getLogger(__name__)
MONITOR = "rollart-serverless"
_DONE = ("memory", "erred", "released", "forgotten")
_QUEUED = ("waiting", "no-worker", "queued")


class _Tag:
    """What the monitor knows about one resource tag."""

    def __init__(self, now: float):
        self.created = now
        self.workers: dict[str, tuple[str, float, float]] = {}  # addr -> (name, t0, slots)
        self.held: deque = deque(maxlen=20000)  # (t0, t1, slots) of departed workers
        self.series: deque = deque([(now, 0)], maxlen=20000)  # (t, pool size)
        self.busy: deque = deque(maxlen=50000)  # (start, stop) of task compute
        self.first_seen: dict = {}
        self.queued: set = set()
        self.processing: set = set()
        self.cold: set = set()  # keys that waited for a worker (no-worker state)
        self.active: dict[str, float] = {}  # worker addr -> when it last started/ended work
        self.latency: deque = deque(maxlen=5000)
        self.counts = {"done": 0, "erred": 0, "cold_waits": 0, "max_queue": 0}


class ServerlessMonitor(SchedulerPlugin):
    """Scheduler plugin: per-tag queue, pool size, busy time and latency."""

    name = MONITOR

    def __init__(self):
        self.tags: dict[str, _Tag] = {}
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["rollart_serverless"] = self.snapshot
        for addr in scheduler.workers:
            self.add_worker(scheduler, addr)

    def _tag(self, tag: str) -> _Tag:
        if tag not in self.tags:
            self.tags[tag] = _Tag(time.time())
        return self.tags[tag]

    def add_worker(self, scheduler=None, worker=None, **kwargs) -> None:
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return
        now = time.time()
        for tag, slots in ws.resources.items():
            st = self._tag(tag)
            st.workers[worker] = (str(ws.name), now, float(slots))
            st.active[worker] = now
            st.series.append((now, len(st.workers)))

    def remove_worker(self, scheduler=None, worker=None, **kwargs) -> None:
        now = time.time()
        for st in self.tags.values():
            if worker in st.workers:
                _, t0, slots = st.workers.pop(worker)
                st.active.pop(worker, None)
                st.held.append((t0, now, slots))
                st.series.append((now, len(st.workers)))

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        ts = self.scheduler.tasks.get(key) if self.scheduler else None
        if ts is None or not ts.resource_restrictions:
            return
        now = time.time()
        for tag in ts.resource_restrictions:
            st = self._tag(tag)
            if finish in _DONE:
                st.queued.discard(key)
                st.processing.discard(key)
                st.cold.discard(key)
                t0 = st.first_seen.pop(key, None)
                if finish in ("memory", "erred") and t0 is not None:
                    st.latency.append(now - t0)
                    st.counts["done" if finish == "memory" else "erred"] += 1
                if kwargs.get("worker") in st.workers:
                    st.active[kwargs["worker"]] = now
                for ss in kwargs.get("startstops") or ():
                    if ss.get("action") == "compute":
                        st.busy.append((ss["start"], ss["stop"]))
                continue
            st.first_seen.setdefault(key, now)
            if finish == "processing":
                st.queued.discard(key)
                st.processing.add(key)
                if ts.processing_on is not None:
                    st.active[ts.processing_on.address] = now
            elif finish in _QUEUED:
                st.queued.add(key)
                st.counts["max_queue"] = max(st.counts["max_queue"], len(st.queued))
                if finish == "no-worker" and key not in st.cold:
                    st.cold.add(key)
                    st.counts["cold_waits"] += 1

    def snapshot(self, tag: str = SERVERLESS, since: float | None = None,
                 series: bool = False, until: float | None = None) -> dict:
        """Figures for ``tag`` over ``[since, until]`` (default: first seen .. now)."""
        st = self._tag(tag)
        now = time.time() if until is None else min(until, time.time())
        since = st.created if since is None else since
        live = [(t0, now, s) for _, t0, s in st.workers.values()]
        spans = list(st.held) + live
        worker_s = sum(_overlap(a, b, since, now) for a, b, _ in spans)
        slot_s = sum(_overlap(a, b, since, now) * s for a, b, s in spans)
        busy_s = sum(_overlap(a, b, since, now) for a, b in st.busy)
        lat = sorted(st.latency)
        workers = {}
        for addr, (name, t0, slots) in st.workers.items():
            ws = self.scheduler.workers.get(addr)
            busy = len(ws.processing) if ws else 0
            workers[name] = {"address": addr, "since": t0, "slots": slots,
                             "processing": busy, "keys": len(ws.has_what) if ws else 0,
                             "idle_s": 0.0 if busy else now - st.active.get(addr, t0)}
        out = {
            "tag": tag, "time": now, "since": since, "workers": workers,
            "pool_size": len(st.workers), "queue_depth": len(st.queued),
            "processing": len(st.processing),
            "demand": len(st.queued) + len(st.processing),
            **st.counts,
            "worker_seconds": worker_s, "slot_seconds": slot_s, "busy_seconds": busy_s,
            "busy_fraction": busy_s / slot_s if slot_s > 0 else 0.0,
            "latency_p50": lat[len(lat) // 2] if lat else 0.0,
            "latency_p95": lat[int(len(lat) * 0.95)] if lat else 0.0,
        }
        if series:
            out["series"] = [(t, n) for t, n in st.series if t >= since]
        return out


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


async def _install_monitor(dask_scheduler=None) -> bool:
    """Add the monitor to the scheduler once (run through ``client.run_on_scheduler``)."""
    if MONITOR in dask_scheduler.plugins:
        return False
    plugin = ServerlessMonitor()
    await plugin.start(dask_scheduler)
    dask_scheduler.add_plugin(plugin, name=MONITOR)
    return True


def _snapshot(tag, since, series, until, dask_scheduler=None) -> dict:
    return dask_scheduler.plugins[MONITOR].snapshot(tag, since, series, until)


def install_monitor(client) -> None:
    """Start watching tagged tasks and workers (idempotent)."""
    client.run_on_scheduler(_install_monitor)


def pool_stats(client, tag: str = SERVERLESS, since: float | None = None,
               series: bool = False, until: float | None = None) -> dict:
    """``ServerlessMonitor.snapshot`` for ``tag``, read from the scheduler."""
    install_monitor(client)
    return client.run_on_scheduler(_snapshot, tag, since, series, until)


class ElasticPool(AdaptiveCore):
    """Adaptive, scale-to-zero workers tagged ``tag`` inside a ``SpecCluster``.

    >>> # pool = ElasticPool(client.cluster, tag="SERVERLESS", max_workers=2).start(client)
    >>> # ... submit tasks with resources={"SERVERLESS": 1} ...
    >>> # pool.stop()
    """

    def __init__(self, cluster, tag: str = SERVERLESS, max_workers: int = 2,
                 threads: int = 1, interval: float = 0.05, wait_count: int = 5,
                 processes: bool | None = None, name: str | None = None,
                 idle_timeout: float | None = None):
        if not hasattr(cluster, "worker_spec"):
            raise TypeError(
                f"ElasticPool needs the run's SpecCluster (got {type(cluster).__name__}); "
                f"on a cluster you did not start, run workers with --resources "
                f"'{tag}={threads}' under your cluster manager's adaptive mode instead")
        # Idleness is judged in seconds by the scheduler monitor (a busy event loop can
        # stretch the adapt interval), so one recommendation suffices to retire.
        super().__init__(minimum=0, maximum=int(max_workers), wait_count=1)
        self.idle_timeout = interval * wait_count if idle_timeout is None else idle_timeout
        self.cluster, self.tag, self.threads = cluster, tag, int(threads)
        self.interval = interval
        self.prefix = name or f"elastic-{tag.lower()}"
        if processes is None:
            from distributed import Nanny

            processes = any(isinstance(s.get("cls"), type) and issubclass(s["cls"], Nanny)
                            for s in cluster.worker_spec.values())
        self.processes = processes
        self.cold_starts = 0
        self.cold_start_seconds: list[float] = []
        self._asked: dict[str, float] = {}  # worker name -> when it was asked for
        self._snap: dict = {"workers": {}, "demand": 0}
        self._i = 0
        self._pc = None

    @property
    def scaling(self) -> Scaling:
        """The scaling decision (``rollart.policy.scaling``) with this pool's settings."""
        return Scaling(self.maximum, self.threads, self.idle_timeout)

    # -- AdaptiveCore's state ---------------------------------------------------------
    def _mine(self, names) -> set:
        return {n for n in names if isinstance(n, str) and n.startswith(self.prefix + "-")}

    @property
    def plan(self) -> set:
        return self._mine(self.cluster.worker_spec)

    @property
    def requested(self) -> set:
        return self._mine(self.cluster.workers)

    @property
    def observed(self) -> set:
        return self._mine(self._snap["workers"])

    async def target(self) -> int:
        self._snap = await self.cluster.scheduler_comm.rollart_serverless(tag=self.tag)
        now = time.time()
        for name in self.observed:
            asked = self._asked.pop(name, None)
            if asked is not None:
                self.cold_start_seconds.append(now - asked)
        return self.scaling.uncapped(self._snap["demand"])

    async def workers_to_close(self, target: int) -> list:
        workers = {n: w for n, w in self._snap["workers"].items() if n in self.observed}
        return self.scaling.to_close({n: w["idle_s"] for n, w in workers.items()},
                                     {n for n, w in workers.items() if w["processing"]},
                                     len(self.plan), target)

    async def scale_up(self, n: int) -> None:
        from distributed import Worker

        from rollart.runtime.resources import worker_nanny

        while len(self.plan) < min(n, self.maximum):
            name = f"{self.prefix}-{self._i}"
            self._i += 1
            options = {"nthreads": self.threads, "resources": {self.tag: self.threads},
                       "name": name, "memory_limit": 0}
            if self.processes:
                t = str(self.threads)
                options["env"] = {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}
            self.cluster.worker_spec[name] = {"cls": worker_nanny() if self.processes else Worker,
                                              "options": options}
            self._asked[name] = time.time()
            self.cold_starts += 1
        self.cluster._correct_state()

    async def scale_down(self, workers) -> None:
        # SpecCluster retires by address but holds names: retire by name first, so any
        # results still held move to another worker instead of being recomputed.
        arrived = [n for n in workers if n in self.observed]
        if arrived:  # a task may have landed since the last look: keep workers that work
            self._snap = await self.cluster.scheduler_comm.rollart_serverless(tag=self.tag)
            busy = {n for n, w in self._snap["workers"].items()
                    if w["processing"] or w["idle_s"] < self.idle_timeout}
            workers = [n for n in workers if n not in busy]
            arrived = [n for n in arrived if n not in busy
                       and self._snap["workers"].get(n, {}).get("keys")]
        if arrived:  # only workers that still hold results need the slower retirement
            await self.cluster.scheduler_comm.retire_workers(names=arrived, remove=False)
        for name in workers:
            self.cluster.worker_spec.pop(name, None)
            self._asked.pop(name, None)
        self.cluster._correct_state()

    # -- life cycle ---------------------------------------------------------------------
    def start(self, client=None):
        """Install the monitor (through ``client``) and start adapting every ``interval``."""
        from tornado.ioloop import PeriodicCallback

        if client is not None:
            install_monitor(client)
        self._pc = PeriodicCallback(self._tick, self.interval * 1000)
        self.cluster.loop.add_callback(self._pc.start)
        return self

    async def _tick(self) -> None:
        try:
            await self.adapt()
        except Exception:
            logger.warning("elastic pool %s could not adapt", self.prefix, exc_info=True)

    def stop(self) -> None:
        """Stop adapting and retire every worker of the pool (blocking)."""
        self.cluster.sync(self._stop)

    async def _stop(self) -> None:
        if self._pc is not None:
            self._pc.stop()
            self._pc = None
        await self.scale_down(list(self.plan))
        task = self.cluster._correct_state()
        if task is not None:
            await task

    def stats(self) -> dict:
        cs = self.cold_start_seconds
        return {"cold_starts": self.cold_starts, "planned": len(self.plan),
                "cold_start_s": sum(cs) / len(cs) if cs else 0.0}


def pool_rewards(rewards) -> dict[str, dict]:
    """``{tag: {"max_workers", "threads", "idle_timeout"}}`` over the serverless rewards
    on the pool backend (several rewards on one tag share a pool with the largest settings)."""
    pools: dict[str, dict] = {}
    for fn in rewards:
        if is_serverless(fn) and fn.config.backend == "pool":
            p = pools.setdefault(fn.config.pool, {"max_workers": 1, "threads": 1,
                                                  "idle_timeout": 0.0})
            for k in p:
                p[k] = max(p[k], getattr(fn.config, k))
    return pools


def start_pools(client, rewards, **options) -> list[ElasticPool]:
    """Start an ``ElasticPool`` on the client's cluster per tag the rewards need.

    On a cluster rollart did not start (an existing scheduler) there is nothing to
    scale from here: workers carrying the tag must come from that cluster's manager.
    """
    wanted = pool_rewards(rewards)
    if not wanted:
        return []
    cluster = getattr(client, "cluster", None)
    if cluster is None or not hasattr(cluster, "worker_spec"):
        logger.warning("serverless rewards need workers tagged %s; this cluster was not "
                       "started by rollart, so start them with its own adaptive manager",
                       sorted(wanted))
        install_monitor(client)
        return []
    return [ElasticPool(cluster, tag, **p, **options).start(client)
            for tag, p in wanted.items()]


def reward_metrics(client, pools: list[ElasticPool], managers: list[dict]) -> dict:
    """One metrics row's ``reward/…`` figures: the env managers' dispatch counts and
    latency (from their ``stats()``, ``managers``), and per elastic pool its size, queue,
    busy fraction and cold starts."""
    out: dict[str, float] = {}
    for s in managers:
        for k, v in s.items():
            if k.startswith("reward/") and not k.startswith("reward/latency"):
                out[k] = out.get(k, 0) + v
            elif k.startswith("reward/latency"):
                out[k] = max(out.get(k, 0.0), v)
    for pool in pools:
        snap = pool_stats(client, pool.tag)
        pre = f"reward/pool/{pool.tag}/" if len(pools) > 1 else "reward/pool/"
        for k in ("pool_size", "queue_depth", "max_queue", "busy_fraction",
                  "worker_seconds", "busy_seconds", "cold_waits", "latency_p50"):
            out[pre + k] = snap[k]
        out.update({pre + k: v for k, v in pool.stats().items()})
    return out
