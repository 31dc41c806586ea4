"""Resizing a running job's pools at a step boundary: ``Run.scale(pool, n)``.

Consumes scale requests (``request_scale``: a pool named by its ``Pool.name`` in a cluster
rollart made, or by its resource tag on any cluster, and the number of workers wanted)
and the run's ``Fleet`` and pipeline; produces workers started, or drained and retired,
and one event per request: a console line and a row of ``recovery.json`` (``"kind":
"scale"``). The control loop applies what was asked before each trainer step
(``Scaler.apply``), and resizes a pool declared with ``Pool.adapt=(min, max)`` by its
measured demand (``Demand``) the same way.

==========  ===========================================================================
grow        a cluster rollart made (``Resources.make_cluster``: a ``SpecCluster``) gets
            new worker specs copied from the pool's first; ``Stages.reconcile`` (the
            supervisor's heal, every ``check_every`` s) starts an inference worker (the
            newest weights first) or env manager on each as it joins and routes to it.
            On a cluster started by hand, a ``ScaleError`` names the ``dask worker
            --resources`` command: workers started so are routed to as they join.
shrink      the pool's newest workers are drained, then retired through Dask's
            ``retire_workers`` (their spec dropped first, so nothing restarts them): an
            inference worker leaves every manager's routing, then finishes the requests
            it holds; an env manager takes no more groups (``SampleBuffer.retire_holder``)
            and finishes the ones it runs, within ``Waits.call``. What is still running
            past that is handled as a lost manager's: re-run elsewhere and counted
            (``rollout/infra_*``), never trained as a zero reward. The drained actors are
            closed and their tasks forgotten (Dask does not retire a worker holding an
            actor), so a retired worker process exits on its own, a ``dask worker``
            started by hand included.
trainer     the TRAIN pool: the trainer gang goes from N to M ranks with its exact state
            (``rollart.control.resize``): workers started as above, then the trainer
            writes its state (sharded), a trainer of M ranks on rank 0's worker loads
            it and takes its place (one process for M = 1); on a shrink the freed
            workers (never rank 0's nor the buffer's) are then retired. The gang forms
            at M ranks at the next step; its rows say ``trainer/ranks`` = M.
refused     a worker holding the trainer or the buffer, an inference or env pool asked
            to 0 while the run uses it, the trainer's pool asked to 0, a Megatron gang
            (it changes size at a ``--resume``), LoRA on more than one rank, and a gang
            on a cluster of threads (``Resources(processes=False)``).
==========  ===========================================================================
"""

from __future__ import annotations

import copy
import logging
import re
import threading
import time

from rollart.observe.metrics import SCALE_TOPIC  # requests from `rollart scale`, the page
from rollart.types import BUFFER, TRAIN

logger = logging.getLogger(__name__)

__all__ = ["Demand", "SCALE_TOPIC", "ScaleError", "Scaler", "request_scale"]


_REQUESTS: dict[str, list[tuple[str, int]]] = {}
_LOCK = threading.Lock()


class ScaleError(ValueError):
    """A scale request that cannot be carried out; the message says what to do instead."""


def request_scale(run: str, pool: str, n: int) -> None:
    """Ask the run named ``run`` (its run directory's name) to run ``n`` workers in
    ``pool`` from its next trainer step on.

    >>> request_scale("demo", "env", -1)
    Traceback (most recent call last):
    ...
    rollart.control.scaling.ScaleError: a pool runs 0 or more workers, not -1
    """
    check_count(n)
    with _LOCK:
        _REQUESTS.setdefault(run, []).append((str(pool), int(n)))


def check_count(n) -> None:
    if not isinstance(n, int) or n < 0:
        raise ScaleError(f"a pool runs 0 or more workers, not {n}")


def _take(run: str) -> list[tuple[str, int]]:
    with _LOCK:
        return _REQUESTS.pop(run, [])


class Scaler:
    """Applies the scale requests of one run (module docstring)."""

    def __init__(self, fleet, pipeline, run: str, on_event=None):
        self.fleet, self.pipeline, self.run = fleet, pipeline, run
        self.on_event = on_event  # each event, as it is done (the dashboard's mark)
        self.client = fleet.stages.client
        self.waits = fleet.stages.waits
        self.retired: set[str] = set()  # workers retired here (the scheduler may lag)
        self.demand: dict[str, Demand] = {}  # Pool.adapt's state, per pool name
        self.resized: list[str] = []  # the states a resized trainer loaded, until it stepped
        _take(run)  # a request left by an earlier run of the same name is not this one's
        self.client.subscribe_topic(SCALE_TOPIC, self._heard)  # rollart scale, elsewhere

    def _heard(self, event) -> None:
        _, msg = event
        if isinstance(msg, dict) and msg.get("run") == self.run:
            try:
                request_scale(self.run, msg["pool"], msg["n"])
            except (KeyError, ScaleError) as e:
                logger.warning("a scale request for this run was not understood: %r (%s)",
                               msg, e)

    def close(self) -> None:
        self._settle()
        try:
            self.client.unsubscribe_topic(SCALE_TOPIC)
        except Exception as e:  # noqa: BLE001 - a client already closed: nothing to stop
            logger.debug("unsubscribing the scale requests: %r", e)
        _take(self.run)

    def _settle(self) -> None:
        if self.resized:  # the trainer resized before the last step
            from rollart.control.resize import settle  # import cycle: it raises ScaleError

            settle(self, self.resized)
            self.resized = []

    def apply(self, step: int, sample=None) -> list[dict]:
        """Carry out the requests made since the last call, before trainer step
        ``step``, then what the demand in ``sample`` (the last step's ``Fleet.sample``)
        asks of the pools declared with ``Pool.adapt``; a request that cannot be carried
        out is refused with one console line."""
        from rollart.observe.progress import say

        self._settle()
        done = []
        asked = _take(self.run)
        if sample is not None:
            asked += self._adapt(sample)
        for pool, n, *why in asked:
            try:
                event = self.scale(pool, n, step)
            except ScaleError as e:
                say(f"scale {pool}={n} refused: {e}")
                continue
            if why:
                event["reason"] = why[0]
            done.append(event)
            self.fleet.supervisor.events.append(event)
            if self.on_event is not None:
                self.on_event(event)
            say(f"scale {pool} ({event['tag']}): {event['from']} -> {event['to']} workers "
                f"before step {step}" + _what(event)
                + (f" [adapt: {event['reason']}]" if "reason" in event else ""))
        return done

    def _adapt(self, sample) -> list[tuple]:
        """``(pool, n, why)`` for each adapting pool whose demand moved far enough."""
        out = []
        for pool in getattr(getattr(self.client, "cluster", None), "pools", ()):
            if pool.adapt is None:
                continue
            demand = self.demand.setdefault(pool.name, Demand(*pool.adapt))
            n = len([a for a, r in self.fleet.supervisor.live().items()
                     if r.get(pool.tag, 0) > 0 and a not in self.retired])
            want = demand.update(n, pressure(pool, sample))
            if want != n:
                out.append((pool.name, want, demand.why))
        return out

    # -- one request --------------------------------------------------------------------
    def scale(self, pool: str, n: int, step: int) -> dict:
        tag, specs = self._pool(pool)
        live = self.fleet.supervisor.live()
        have = _newest_last([a for a, r in live.items()
                             if r.get(tag, 0) > 0 and a not in self.retired], specs)
        event = {"kind": "scale", "pool": pool, "tag": tag, "from": len(have), "to": n,
                 "step": step, "at": time.time(), "added": [], "removed": []}
        if tag == TRAIN:  # the gang re-formed at n ranks with the trainer's state
            # import cycle: resize raises this module's ScaleError
            from rollart.control.resize import resize_trainer

            event.update(resize_trainer(self, pool, specs, have, n, step))
            return event
        if n > len(have):
            event["added"] = self._grow(pool, tag, specs, n - len(have))
        elif n < len(have):
            if n == 0 and self._needed(tag):
                raise ScaleError(f"the run's tasks use the {tag} pool: it may shrink to 1 "
                                 "worker, not to 0")
            gone = have[n:]
            self._check_movable(gone)
            event.update(self._drain(gone))
            self._release(event.pop("keys"))
            self._retire(gone, specs)
            event["removed"] = gone
        return event

    def _retire(self, gone: list[str], specs: dict) -> None:
        """Retire the workers ``gone`` (drained: no actor of the run left there)."""
        cluster = getattr(self.client, "cluster", None)
        names = [s for s, a in specs.items() if a in gone]
        for name in names:
            cluster.worker_spec.pop(name, None)  # nothing restarts them
        # Dask's drain (data moved off); the cluster rollart made closes its own
        # workers through their nannies once retired (let_go: not waited for), Dask
        # the others (a dask worker started by hand). Both at once raced in Dask's
        # worker (an ERROR line).
        ours = hasattr(cluster, "let_go") and len(names) == len(gone)
        retired = self.client.sync(self.client.scheduler.retire_workers, workers=gone,
                                   close_workers=not ours, remove=not ours,
                                   callback_timeout=self.waits.call)
        if ours:
            self._until_graceful(retired)
            cluster.let_go(names)
        kept = sorted(set(gone) - set(retired))
        if kept:
            raise ScaleError(f"Dask did not retire {', '.join(kept)} (its log says "
                             "why); their actors were drained and closed")
        self.retired.update(gone)

    def _until_graceful(self, workers: list[str], seconds: float = 10.0) -> None:
        """Until each retired worker has itself taken the status ``closing_gracefully``:
        the scheduler sends it on the worker's batched stream, and a nanny's close that
        came first (a busy worker, a real model's) made Dask's worker log an ERROR
        ("Invalid Worker.status transition: closing -> closing_gracefully"). A worker
        gone, or one still running after ``seconds``, is let go as it is."""
        deadline = time.monotonic() + seconds
        while workers and time.monotonic() < deadline:
            try:
                states = self.client.run(_status, workers=workers, on_error="return")
            except Exception:  # noqa: BLE001 - a worker leaving: nothing to wait for
                return
            if all(s != "running" for s in states.values()):
                return
            time.sleep(0.05)

    def _pool(self, pool: str) -> tuple[str, dict[str, str | None]]:
        """``(tag, {spec name: worker address or None})`` of ``pool``: a ``Pool.name`` of
        the ``SpecCluster`` rollart made (its specs ``{pool}-{i}``), or a resource tag
        (any cluster; specs as for a name, where the cluster has them)."""
        cluster = getattr(self.client, "cluster", None)
        spec = getattr(cluster, "worker_spec", None) or {}
        addresses = _spec_addresses(cluster)
        mine = {n: s for n, s in spec.items() if re.fullmatch(rf"{re.escape(pool)}-\d+", n)}
        if mine:
            tag = spec_tag(next(iter(mine.values())))
            return tag, {n: addresses.get(n) for n in mine}
        tags = {t for a, r in self.fleet.supervisor.live().items() for t in r}
        if pool in tags:
            return pool, {n: addresses.get(n) for n, s in spec.items()
                          if spec_tag(s) == pool}
        pools = sorted({n.rsplit("-", 1)[0] for n in spec})
        raise ScaleError(f"no pool {pool!r}: name one of {', '.join(pools) or 'none'} "
                         f"(the pools of the cluster rollart made) or a resource tag of the "
                         f"cluster's workers ({', '.join(sorted(tags))})")

    def _needed(self, tag: str) -> bool:
        return any(t == tag for _, t, _ in self.fleet.actors.of("inference")) or \
            any(t == tag for _, t, _ in self.fleet.actors.of("env"))

    def _grow(self, pool: str, tag: str, specs: dict, k: int) -> list[str]:
        cluster = getattr(self.client, "cluster", None)
        if not specs or not hasattr(cluster, "_correct_state"):
            raise ScaleError(f"this cluster was not started by rollart: start {k} more "
                             f"worker(s) with `dask worker --resources \"{tag}=1\" "
                             f"{self.client.scheduler.address}` (or your cluster manager's "
                             "scale); each is routed to as it joins")
        template = cluster.worker_spec[min(specs, key=_index)]
        if template.get("options", {}).get("env", {}).get("CUDA_VISIBLE_DEVICES"):
            raise ScaleError(f"the {pool} pool's workers each own a GPU: start a worker on "
                             f"another GPU by hand (`dask worker --resources \"{tag}=1\"`)")
        first = max(_index(n) for n in specs) + 1
        names = [f"{pool}-{first + i}" for i in range(k)]
        for name in names:
            spec = copy.deepcopy(template)
            spec.setdefault("options", {})["name"] = name
            cluster.worker_spec[name] = spec
        # SpecCluster.scale's own way to start what its spec declares (one template for
        # every worker there; a pool's template here)
        cluster.sync(cluster._correct_state)
        return names

    def _check_movable(self, gone: list[str]) -> None:
        placement = self.fleet.actors.placement
        for role in ("trainer", "buffer"):
            held = [a for a in placement.get(role, []) if a in gone]
            if held:
                tag = TRAIN if role == "trainer" else BUFFER
                raise ScaleError(f"worker {held[0]} holds the run's {role} ({tag}): it "
                                 "cannot be retired while the run goes on")

    def _drain(self, gone: list[str]) -> dict:
        """Take ``gone``'s actors out of the run, letting their work finish (module
        docstring); returns the counts."""
        actors, out = self.fleet.actors, {"groups_finished": 0, "groups_left": 0,
                                          "requests_left": 0, "keys": []}
        # an actor still starting there (a worker that joined moments ago): cancelled
        out["keys"] += self.fleet.stages.drop_starts(set(gone))
        managers = [(m, a) for m, _, a in actors.of("env") if a in gone]
        for mgr, addr in managers:
            self.pipeline.release_manager(mgr)  # takes no more groups
            done = self.fleet.call(mgr, "drain", self.waits.call, timeout=self.waits.call + 30,
                                   stuck=f"the EnvManager on {addr} did not drain")
            out["groups_finished"] += done["finished"]
            out["groups_left"] += done["left"]
            actors.remove("env", mgr)
            self.pipeline.forget_manager(mgr, lost=done["left"] > 0)
            self._close(mgr, f"the EnvManager on {addr}")
            out["keys"].append(mgr.key)
        workers = [(w, a) for w, _, a in actors.of("inference") if a in gone]
        for w, _ in workers:
            actors.remove("inference", w)
        if workers:
            routes = [(w, t) for w, t, _ in actors.workers]
            self.fleet.broadcast("env", "set_inference_workers", routes)
            deadline = time.monotonic() + self.waits.call
            for w, addr in workers:
                while time.monotonic() < deadline:
                    st = self.fleet.call(w, "stats", timeout=self.waits.call)
                    if not st["queued"] and not st["in_flight"]:
                        break
                    time.sleep(0.1)
                else:
                    out["requests_left"] += st["queued"] + st["in_flight"]
                self._close(w, f"the InferenceWorker on {addr}")
                out["keys"].append(w.key)
        return out

    def _release(self, keys: list[str]) -> None:
        """Forget the closed actors' tasks (``force``: whoever still holds a handle):
        Dask does not retire a worker that holds an actor."""
        if keys:  # on the scheduler's loop, before the retire that follows
            self.client.run_on_scheduler(_forget, keys=keys, client=self.client.id)

    def _close(self, actor, what: str) -> None:
        """Close a drained actor (its engine thread, its env threads), so its worker
        process can exit once Dask retires it; a failure is logged, not raised."""
        try:
            self.fleet.call(actor, "close", timeout=self.waits.call)
        except Exception as e:  # noqa: BLE001 - retiring the worker ends it anyway
            logger.warning("%s did not close before its worker was retired: %r", what, e)


class Demand:
    """When an adapting pool (``Pool.adapt=(lo, hi)``) grows or shrinks by one worker:
    its ``pressure`` (1.0: just saturated) measured at each trainer step's end, over
    ``HIGH`` for ``GROW_AFTER`` steps in a row grows it, under ``LOW`` for
    ``SHRINK_AFTER`` steps in a row shrinks it, within ``[lo, hi]``; each move starts
    the count again (a resize changes the pressure it was measured under).

    >>> d = Demand(1, 2)
    >>> [d.update(1, 1.5), d.update(1, 1.5), d.update(2, 1.5)], d.why  # at most hi
    ([1, 2, 2], 'pressure 1.50 for 2 steps (over 1)')
    >>> [d.update(2, p) for p in (0.1, 0.1, 0.1)], [d.update(1, 0.0) for _ in range(3)]
    ([2, 2, 1], [1, 1, 1])
    """

    HIGH, LOW, GROW_AFTER, SHRINK_AFTER = 1.0, 0.25, 2, 3

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.high = self.low = 0
        self.why = ""

    def update(self, n: int, pressure: float | None) -> int:
        if pressure is None:  # nothing measured (no worker of it answered)
            return n
        self.high = self.high + 1 if pressure > self.HIGH else 0
        self.low = self.low + 1 if pressure < self.LOW else 0
        if self.high >= self.GROW_AFTER and n < self.hi:
            self.why = f"pressure {pressure:.2f} for {self.high} steps (over {self.HIGH:g})"
            self.high = self.low = 0
            return n + 1
        if self.low >= self.SHRINK_AFTER and n > self.lo:
            self.why = f"pressure {pressure:.2f} for {self.low} steps (under {self.LOW:g})"
            self.high = self.low = 0
            return n - 1
        return n


def pressure(pool, sample) -> float | None:
    """An adapting pool's demand at a step's end (``Sample``): for an inference pool,
    requests waiting per engine over ``QUEUE_PER_ENGINE``; for an env pool, env calls
    under way or waiting per manager over its env threads. None: no figure."""
    if pool.kind == "cpu_env":
        got = [st.get("states", {}).get("in_env", 0) / max(st.get("env_threads", 8), 1)
               for st, tag in zip(sample.managers, sample.manager_pools) if tag == pool.tag]
    else:
        got = [st.get("queued", 0) / QUEUE_PER_ENGINE
               for tag, _, st in sample.workers if tag == pool.tag]
    return sum(got) / len(got) if got else None


#: requests waiting per engine at which an adapting inference pool counts as saturated
QUEUE_PER_ENGINE = 8


def _forget(keys, client, dask_scheduler=None) -> None:
    """(on the scheduler) every client's want of ``keys`` released, as
    ``Client.cancel(..., force=True)`` does, but at once: a cancel sent on the client's
    stream could reach the scheduler after the retire that follows it."""
    dask_scheduler.stimulus_cancel(keys, client=client, force=True,
                                   reason="rollart: drained before its worker is retired",
                                   msg="")
    left = [k for k in keys if k in dask_scheduler.tasks]
    if left:
        raise ScaleError(f"Dask still holds the drained actors {left}")


def _status(dask_worker) -> str:
    """(on a worker) its own status, as it has taken it."""
    return dask_worker.status.name


def _spec_addresses(cluster) -> dict[str, str]:
    """Spec name -> its worker's address, for the workers a ``SpecCluster`` runs."""
    out = {}
    for name, w in (getattr(cluster, "workers", None) or {}).items():
        addr = getattr(w, "worker_address", None) or getattr(w, "address", None)
        if addr:
            out[name] = addr
    return out


def _index(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def spec_tag(spec: dict) -> str | None:
    """The resource tag a ``SpecCluster`` worker spec gives its worker: a local worker's
    ``options["resources"]``, or a dask-jobqueue job's ``--resources TAG=1`` among its
    ``worker_extra_args`` (``resources/jobqueue.py``).

    >>> spec_tag({"options": {"resources": {"H20": 1}}})
    'H20'
    >>> spec_tag({"options": {"worker_extra_args": ["--resources", "CPU_ENV=1"]}})
    'CPU_ENV'
    >>> spec_tag({"options": {}}) is None
    True
    """
    options = spec.get("options", {})
    if options.get("resources"):
        return next(iter(options["resources"]))
    args = list(options.get("worker_extra_args") or ())
    for flag, value in zip(args, args[1:]):
        if flag == "--resources":
            return value.split("=", 1)[0].split(",", 1)[0].strip()
    return None


def _newest_last(addresses: list[str], specs: dict) -> list[str]:
    """``addresses`` oldest first: by their spec's index where the cluster has one, then
    by address."""
    index = {a: _index(n) for n, a in specs.items() if a}
    return sorted(addresses, key=lambda a: (index.get(a, 10 ** 9), a))


def _what(event: dict) -> str:
    if "ranks" in event:  # the trainer's pool (rollart.control.resize)
        if "version" not in event:
            return ": nothing to do"
        a, b = event["ranks"]
        workers = (f", starting {', '.join(event['added'])}" if event["added"] else
                   f", retired {', '.join(event['removed'])}" if event["removed"] else "")
        return (f": the trainer of {a} rank(s) handed its state (v{event['version']}) to "
                f"one of {b}{workers}")
    if event["added"]:
        return f": starting {', '.join(event['added'])} (routed to as each joins)"
    if event["removed"]:
        return (f": retired {', '.join(event['removed'])} after draining them "
                f"({event['groups_finished']} groups finished there, "
                f"{event['groups_left']} left to re-run elsewhere)")
    return ": nothing to do"
