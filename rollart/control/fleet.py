"""``Fleet``: the driver's one way to reach the run's actors.

Consumes the ``Actors`` record (``rollart.control.stages``: role, pool, address and
handle of every actor placed) and, for a run that heals, the ``Stages`` that placed
them; owns the ``Supervisor`` (``rollart.control.supervisor``) built from those. Every
call the driver makes on an actor goes through here; a ``Fleet`` is the run's ``Door``
(``rollart.control.door``: the ``Door`` without the scheduler's view is what ``Stages``
places and restores actors through, below the Fleet). The two rules, spelled out there:
a call whose worker left is ``ActorLost`` (an ``OSError``), and a wait past its bound is
a ``StuckError`` (a ``RuntimeError``: never taken for a lost worker), naming what did
not happen and the ``Waits`` setting that raises the bound when given one:

=====================  ==============================================================
``call(a, m, *args)``  ``a.m(*args)``'s result; ``ActorLost`` when ``a``'s worker was
                       lost (the one rule: ``rollart.runtime.lost.is_lost``), any other
                       error as it was raised; with ``timeout=``, ``StuckError`` past
                       it (``stuck=``: what did not happen, and the ``Waits`` setting)
``submit(a, m, ...)``  the call's future (``ActorLost`` if the handle fails at once)
``result(f, a)``       a future's result, failing as soon as ``a``'s worker leaves
``broadcast(role, m)`` ``[(actor, result)]`` of every live actor of ``role``; lost ones
                       are left out (the supervisor replaces them)
``ask_buffer(m)``      ``call`` on the buffer, once more on its replacement if it was lost
``sample()``           one read of every actor's figures (``Sample``): the monitor, the
                       watchdog and the step row all read it
``catch_up(w, v)``     inference workers load weights ``v`` (``stages.catch_up``)
=====================  ==============================================================

Without ``stages`` there is no supervisor and nothing is judged lost: an error is the
caller's, as raised (tests that drive a pipeline over hand-made actors).
Used by ``rollart.control.modes`` (the pipelines), ``rollart.control.loop``,
``rollart.control.lifecycle``, ``rollart.control.scaling``, ``rollart.control.checkpoint``
and ``rollart.observe.monitor``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollart.control.door import ActorLost, Door
from rollart.control.stages import Actors, catch_up
from rollart.control.supervisor import Supervisor

__all__ = ["ActorLost", "Fleet", "Sample"]


@dataclass
class Sample:
    """What every live actor reported at one moment (``Fleet.sample``)."""

    workers: list = field(default_factory=list)  # [(pool tag, address, stats)]
    managers: list = field(default_factory=list)  # [stats] of each env manager
    manager_pools: list = field(default_factory=list)  # the env pool tag of each, in order
    latencies: list = field(default_factory=list)  # env step latencies (s), all managers
    buffer: dict = field(default_factory=dict)  # SampleBuffer.stats(): counts + internals

    def worker_versions(self) -> list[dict]:
        """``{address, pool, version, load_error}`` of each worker (the watchdog's view)."""
        return [{"address": addr, "pool": tag, "version": st["version"],
                 "load_error": st.get("load_error")} for tag, addr, st in self.workers]


class Fleet(Door):
    """The run's actors and the one way to call them (see the module doc).

    >>> # fleet = Fleet(stages.start(), stages, checkpoint_url=url)
    >>> # fleet.broadcast("env", "abort_older_than", 3)   # live managers' answers
    """

    def __init__(self, actors: Actors, stages=None, *, checkpoint_url: str | None = None):
        self.actors, self.stages = actors, stages
        self.supervisor = None if stages is None else \
            Supervisor(stages, actors, checkpoint_url=checkpoint_url)
        super().__init__(None if self.supervisor is None else self.supervisor.live)

    # -- calls (``call``, ``submit``, ``result``, ``attempt``: ``Door``) ----------------
    def broadcast(self, role: str, method: str, *args, timeout: float | None = None
                  ) -> list[tuple]:
        """``[(actor, result)]`` of ``method(*args)`` on every live actor of ``role``, all
        sent before any is awaited; lost ones are left out."""
        futs = []
        for actor, _, _ in self.actors.of(role):
            try:
                futs.append((actor, self.submit(actor, method, *args)))
            except ActorLost:
                continue
        out = []
        for actor, fut in futs:
            try:
                out.append((actor, self.result(fut, actor, timeout)))
            except ActorLost:
                continue
        return out

    def ask_buffer(self, method: str, *args):
        """``call`` on the sample buffer; if its worker was lost, once more on the buffer
        the supervisor re-creates (``Supervisor.wait_for_buffer``)."""
        try:
            return self.call(self.actors.buffer, method, *args)
        except ActorLost:
            self.supervisor.wait_for_buffer()
        return self.call(self.actors.buffer, method, *args)

    # -- waiting ----------------------------------------------------------------------
    def until_done(self, fut, tick, actor=None) -> None:
        """Wait for ``fut``, calling ``tick()`` (heal, watchdog, keep rollout going)
        meanwhile; ``ActorLost`` once ``actor`` (the one called, if given) left the
        cluster. Errors raised here are not ``fut``'s."""
        checked = time.monotonic()
        while not fut.done():
            tick()
            if actor is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if not fut.done():
                    self.check_alive(actor)
            time.sleep(0.02)

    def wait(self, fut, tick, actor=None):
        """``fut``'s result once done (``until_done``), its error judged on ``actor``."""
        self.until_done(fut, tick, actor)
        return fut.result() if actor is None else self.attempt(actor, fut.result)

    # -- env managers -----------------------------------------------------------------
    def manager(self, i: int, task=None):
        """The ``i``-th env manager (among those on ``task``'s env pool, if given),
        waiting for one to come back if every manager was lost."""
        if not self.actors.managers and self.supervisor is not None:
            self.supervisor.wait_for_manager()
        managers = self.actors.managers_for(task) if task is not None else \
            self.actors.managers
        return managers[i % len(managers)]

    def on_live_manager(self, index: int, task, call, attempts: int = 100):
        """``(call(mgr), mgr)`` on the ``index``-th env manager for ``task``. A manager
        whose worker is gone (the call raises at once) is healed away and the next one
        tried, for up to ``attempts`` × 0.05 s while the scheduler notices the loss."""
        for attempt in range(attempts - 1):
            mgr = self.manager(index + attempt, task)
            try:
                return self.attempt(mgr, lambda: call(mgr)), mgr
            except ActorLost:
                self.supervisor.heal(force=True)
                time.sleep(0.05)
        mgr = self.manager(index + attempts - 1, task)
        return call(mgr), mgr  # the last try: its error is the caller's

    # -- figures and weights ----------------------------------------------------------
    def sample(self, *, workers: bool = True, managers: bool = True,
               latencies: bool = False, timeout: float | None = 30.0,
               heal: bool = True) -> Sample:
        """One read of every live actor's figures (lost ones left out): the inference
        workers' and env managers' ``stats()`` (unless ``workers`` / ``managers`` is
        False), the managers' env-step latencies (with ``latencies``) and the buffer's ``stats()`` (its ledger counts, checked: an
        ``AccountingError`` if they do not add up). The step row, the watchdog and the
        monitor's snapshots are all made from one of these. ``heal=False`` (the monitor's
        thread): a lost buffer is an ``ActorLost`` here, left to the driver's thread to
        replace."""
        tags = {id(w): (tag, addr) for w, tag, addr in self.actors.workers}
        buffer = self.ask_buffer("stats") if heal else \
            self.call(self.actors.buffer, "stats", timeout=timeout)
        out = Sample(buffer=buffer)
        if workers:
            out.workers = [(*tags[id(w)], s) for w, s in
                           self.broadcast("inference", "stats", timeout=timeout)]
        if managers:
            pool = {id(m): tag for m, tag, _ in self.actors.of("env")}
            got = self.broadcast("env", "stats", timeout=timeout)
            out.managers = [s for _, s in got]
            out.manager_pools = [pool.get(id(m)) for m, _ in got]
        if latencies:
            for _, lat in self.broadcast("env", "env_latencies", timeout=timeout):
                out.latencies += lat.tolist()  # one float64 array per manager
        return out

    def catch_up(self, version: int, workers: list | None = None) -> None:
        """Inference workers (``workers``: ``[(actor, tag, address)]``, default all) load
        weights ``version`` (``rollart.control.stages.catch_up``)."""
        workers = self.actors.workers if workers is None else workers
        catch_up([(w, f"{addr} ({tag})") for w, tag, addr in workers], version,
                 self.stages.waits if self.stages is not None else _waits(), "", self)


def _waits():
    from rollart.runtime.waits import Waits

    return Waits.from_config()
