"""Simulated hardware pools: inference workers that batch continuously, the reward pool,
and the busy-time meters behind utilisation figures.

Consumes a simpy ``Environment`` and cost models (``rollart.sim.costs``); produces
simulated durations and busy intervals. Used by ``rollart.sim.cluster`` only.

Aggregation (what keeps 3,000 GPUs fast): a ``SimWorker`` is one object per inference
worker (``tp`` GPUs) that wakes only when a request arrives, a phase ends or a request
completes — never per decode step. Between two wake-ups its batch is fixed, so each
row advances ``elapsed / step_s`` tokens, with ``step_s = decode_step_s(batch, context
at the phase's midpoint)``. New arrivals are prefilled together in one phase that pauses
decoding (vLLM's default: prefill first), their cached prefix (sticky routing) excluded.
A worker sharing its process with an env manager (``ControlPlane.near``: one GIL) pauses
for each turn's Python on that manager's loop (``SimWorker.stall``).
"""

from __future__ import annotations

import math
from collections import deque

import simpy

from rollart.policy.scaling import Scaling


class Meter:
    """Busy unit-seconds of a pool of ``units``, in total and per ``dt`` bucket."""

    def __init__(self, units: int, dt: float):
        self.units, self.dt = max(int(units), 1), float(dt)
        self.busy = 0.0
        self.buckets: dict[int, float] = {}

    def add(self, t0: float, t1: float, units: float = 1.0) -> None:
        if t1 <= t0:
            return
        self.busy += (t1 - t0) * units
        b0, b1 = int(t0 / self.dt), int(t1 / self.dt)
        for b in range(b0, b1 + 1):
            lo, hi = max(t0, b * self.dt), min(t1, (b + 1) * self.dt)
            if hi > lo:
                self.buckets[b] = self.buckets.get(b, 0.0) + (hi - lo) * units

    def utilisation(self, horizon: float, held: float | None = None) -> float:
        """Busy share of ``units × horizon`` (or of ``held`` unit-seconds)."""
        cap = held if held is not None else self.units * horizon
        return self.busy / cap if cap > 0 else 0.0

    def timeline(self, horizon: float, points: int = 200) -> list[tuple[float, float]]:
        """``[(t, busy share)]`` over ``horizon``, merged to at most ``points`` points."""
        n = max(1, int(math.ceil(horizon / self.dt)))
        step = max(1, int(math.ceil(n / points)))
        out = []
        for start in range(0, n, step):
            busy = sum(self.buckets.get(b, 0.0) for b in range(start, min(start + step, n)))
            width = min(step, n - start) * self.dt
            out.append(((start + min(step, n - start) / 2) * self.dt,
                        min(1.0, busy / (self.units * width))))
        return out


class Req:
    """One generation request (or one phase of it, for PD) on a ``SimWorker``."""

    __slots__ = ("new", "cached", "prompt", "out", "remaining", "context", "event",
                 "kind", "cancelled", "version")

    def __init__(self, env, new: int, cached: int, prompt: int, out: int, kind: str = "full"):
        self.new, self.cached, self.prompt, self.out = new, cached, prompt, out
        self.remaining = float(out)
        self.context = prompt
        self.event = env.event()
        self.kind = kind  # full | prefill (PD: ends after prefill) | decode (KV arrived)
        self.cancelled = False
        self.version = None  # the worker's weights when its first token was made


class SimWorker:
    """An inference worker: continuous batching of up to ``max_batch`` rows.
    ``keep_kv`` (``Policy.weight_update="keep"``): a weight load re-prefills nothing."""

    def __init__(self, env: simpy.Environment, index: int, tag: str, gen, max_batch: int,
                 meter: Meter, keep_kv: bool = False):
        self.env, self.index, self.tag, self.gen = env, index, tag, gen
        self.max_batch, self.meter, self.keep_kv = int(max_batch), meter, bool(keep_kv)
        self.version = 0
        self.active: list[Req] = []
        self.pending: deque[Req] = deque()
        self._phase = None  # None | "prefill" | "decode" | "load"
        self._t = 0.0  # when the current phase (or the last advance) started
        self._step = 0.0
        self._token = 0
        self._batch: list[Req] = []
        self.tokens_out = 0
        self.prefill_tokens = 0
        self.admitted = 0  # requests taken into a batch (the engine's ``requests``)
        self.busy = 0.0
        self._load = None  # (version, exposed seconds, [done events]) waiting to run
        self.loads = 0
        self._stall = 0.0  # co-located Python's CPU the engine waits out next
        self.stalled = 0.0

    # -- requests -----------------------------------------------------------------------
    def submit(self, req: Req) -> simpy.Event:
        self.pending.append(req)
        if self._phase == "decode":
            self._advance()
            self._phase = None
        if self._phase is None:
            self._next()
        return req.event

    def cancel(self, req: Req) -> None:
        req.cancelled = True
        if req in self.pending:
            self.pending.remove(req)
        elif req in self.active and self._phase == "decode":
            self._advance()
            self.active.remove(req)
            self._phase = None
            self._next()

    def load(self, version: int, exposed_s: float) -> simpy.Event:
        """Suspend, swap in ``version`` (``exposed_s`` stalled), resume, recompute the
        in-flight rows' KV (one prefill of their contexts; none with ``keep_kv``: the
        rows go on over the KV they have)."""
        done = self.env.event()
        waiting = self._load[2] if self._load is not None else []
        self._load = (version, exposed_s, waiting + [done])
        if self._phase == "decode":
            self._advance()
            self._phase = None
        if self._phase is None:
            self._next()
        return done

    def stall(self, seconds: float) -> None:
        """Python of the same process (a co-located env manager's turn) holds the GIL
        for ``seconds``: a busy engine pauses that long (decode is cut at once, a
        prefill or load in progress finishes first); an idle one loses nothing."""
        if seconds <= 0 or not (self.active or self.pending or self._phase is not None):
            return
        self._stall += seconds
        if self._phase == "decode":
            self._advance()
            self._phase = None
        if self._phase is None:
            self._next()

    # -- the batching loop (callbacks, no process) --------------------------------------
    def _advance(self) -> None:
        """Decode progress since the phase started, then end the phase."""
        now = self.env.now
        if self._step > 0 and now > self._t:
            steps = (now - self._t) / self._step
            for r in self.active:
                r.remaining -= steps
                r.context += steps
            self.meter.add(self._t, now)
            self.busy += now - self._t
        self._t = now

    def _at(self, delay: float, phase: str) -> None:
        self._phase, self._t = phase, self.env.now
        self._token += 1
        token = self._token
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _e: self._end(token))

    def _end(self, token: int) -> None:
        if token != self._token:
            return  # superseded (an arrival ended the decode phase early)
        phase = self._phase
        if phase == "decode":
            self._advance()
            self._finish_rows()
        elif phase == "prefill":
            self.meter.add(self._t, self.env.now)
            self.busy += self.env.now - self._t
            self._admit()
        elif phase == "stall":
            self.stalled += self.env.now - self._t
        elif phase == "load":
            self.meter.add(self._t, self.env.now)
            self.busy += self.env.now - self._t
            for done in self._loading[2]:
                done.succeed()
            self._loading = None
            self.loads += 1
        self._phase = None
        self._next()

    def _next(self) -> None:
        if self._phase is not None:
            return
        if self._stall > 0:
            pause, self._stall, self._step = self._stall, 0.0, 0.0
            self._at(pause, "stall")
            return
        if self._load is not None:
            self._loading, self._load = self._load, None
            version, exposed, _ = self._loading
            self.version = version
            recompute = 0.0 if self.keep_kv else \
                self.gen.prefill_batch_s((int(r.context), 0) for r in self.active)
            self._step = 0.0
            self._at(exposed + recompute, "load")
            return
        room = self.max_batch - len(self.active)
        while self.pending and self.pending[0].cancelled:
            self.pending.popleft()
        if self.pending and room > 0:
            batch = [self.pending.popleft() for _ in range(min(room, len(self.pending)))]
            self._batch = batch
            self.admitted += len(batch)
            self._step = 0.0
            self._at(self._prefill_s(batch), "prefill")
            return
        self.active = [r for r in self.active if not r.cancelled]
        if self.active:
            n = max(1e-9, min(r.remaining for r in self.active))
            ctx = sum(r.context for r in self.active) + len(self.active) * n / 2
            self._step = self.gen.decode_step_s(len(self.active), int(ctx))
            self._at(math.ceil(n - 1e-9) * self._step, "decode")

    def _prefill_s(self, batch: list[Req]) -> float:
        """One admission phase: the batch's prefill and each request's fixed cost."""
        admit = len(batch) * self.gen.request_overhead_s
        news = [r.new for r in batch if r.kind != "decode"]
        if not news:  # KV arrived from a prefill worker: the rows join the running
            return admit  # batch and decode in its next step (no phase of their own)
        self.prefill_tokens += sum(news)
        # one batched prefill: each row's attention over its own context
        return self.gen.prefill_batch_s((r.new, r.cached) for r in batch
                                        if r.kind != "decode") + admit

    def _admit(self) -> None:
        for r in self._batch:
            if r.cancelled:
                continue
            r.version = self.version
            if r.kind == "prefill":
                r.event.succeed(r)
            elif r.out <= 0:
                r.event.succeed(r)
            else:
                self.active.append(r)
        self._batch = []

    def _finish_rows(self) -> None:
        keep = []
        for r in self.active:
            if r.cancelled:
                continue
            if r.remaining <= 1e-6:
                self.tokens_out += r.out
                r.event.succeed(r)
            else:
                keep.append(r)
        self.active = keep


class RewardSim:
    """The reward pool: ``dedicated`` (``workers`` always held) or ``elastic`` (scaled by
    the runtime's ``Scaling``; each new worker pays ``cold_start_s``)."""

    def __init__(self, env, spec, cost, rng, dt: float):
        self.env, self.spec, self.cost, self.rng = env, spec, cost, rng
        self.elastic = spec.kind == "elastic"
        cap = spec.max_workers if self.elastic else spec.workers
        self.meter = Meter(max(cap * spec.threads, 1), dt)
        self.scaling = Scaling(spec.max_workers, spec.threads, spec.idle_timeout)
        self.queue: deque = deque()
        self.idle: list[int] = []  # worker ids ready and idle
        self.workers: dict[int, float] = {}  # id -> when asked for (held since)
        self.idle_since: dict[int, float] = {}
        self.starting = 0
        self.running = 0
        self.held_s = 0.0
        self.cold_starts = 0
        self._ids = 0
        if not self.elastic:
            for _ in range(spec.workers * spec.threads):
                self._ready(self._new())

    def _new(self) -> int:
        self._ids += 1
        self.workers[self._ids] = self.env.now
        return self._ids

    def call(self) -> simpy.Event:
        ev = self.env.event()
        self.queue.append(ev)
        self._dispatch()
        if self.elastic:
            self._scale()
        return ev

    def _scale(self) -> None:
        demand = len(self.queue) + self.running
        want = self.scaling.target(demand) * self.spec.threads
        have = len(self.workers)
        for _ in range(max(0, want - have)):
            wid = self._new()
            self.cold_starts += 1
            self.starting += 1
            ev = self.env.timeout(self.cost.cold_start_s)
            ev.callbacks.append(lambda _e, w=wid: self._started(w))

    def _started(self, wid: int) -> None:
        self.starting -= 1
        self._ready(wid)

    def _ready(self, wid: int) -> None:
        self.idle.append(wid)
        self.idle_since[wid] = self.env.now
        self._dispatch()
        if self.elastic and wid in self.idle:
            ev = self.env.timeout(self.spec.idle_timeout)
            ev.callbacks.append(lambda _e, w=wid, t=self.env.now: self._maybe_retire(w, t))

    def _dispatch(self) -> None:
        while self.queue and self.idle:
            wid, ev = self.idle.pop(), self.queue.popleft()
            self.running += 1
            t0 = self.env.now
            done = self.env.timeout(self.cost.sample_call(self.rng))
            done.callbacks.append(lambda _e, w=wid, e=ev, t=t0: self._done(w, e, t))

    def _done(self, wid: int, ev, t0: float) -> None:
        self.running -= 1
        self.meter.add(t0, self.env.now)
        ev.succeed()
        self._ready(wid)

    def _maybe_retire(self, wid: int, since: float) -> None:
        if wid not in self.idle or self.idle_since.get(wid) != since:
            return  # it worked meanwhile
        demand = len(self.queue) + self.running
        target = self.scaling.target(demand) * self.spec.threads
        idle = {w: self.env.now - self.idle_since[w] for w in self.idle}
        if wid in self.scaling.to_close(idle, (), len(self.workers), target):
            self.idle.remove(wid)
            self.held_s += self.env.now - self.workers.pop(wid)

    def held(self, horizon: float) -> float:
        """Worker-seconds held up to ``horizon`` (what the pool costs)."""
        return self.held_s + sum(horizon - t for t in self.workers.values())
