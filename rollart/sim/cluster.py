"""The simulator's engine: a rollart cluster as simpy processes, driven by the runtime's
own policy objects.

Consumes a ``SimConfig`` (``rollart.sim.config``); produces a ``SimResult``. Called by
``rollart.sim.simulate``, ``rollart.sim.paper``, ``rollart.sim.calibrate`` and
``benchmarks/cluster_sim.py``. The modes' drivers are in ``rollart.sim.modes``, the
pools in ``rollart.sim.pools``, the records of members, groups and env managers in
``rollart.sim.members``.

What is simulated (and what is aggregated to stay fast at thousands of GPUs):

* **Env managers**: each trajectory is one simpy process (an event chain, not a thread):
  env reset, then per turn a generation request and an env step (``EnvCost``
  latencies; a failed step fails the member, which the group replaces as
  ``EnvManager`` does), then its reward and the buffer (which trains a group only with
  ``min_members`` finished members, and never its failed ones). A trajectory holds one of its
  env pool's slots while it lives (``EnvManager``'s ``max_concurrency``). Groups are
  spread round robin over the pool's ``managers``, each with its own ``Router``.
* **Inference workers**: one ``SimWorker`` per worker (``tp`` GPUs) batching many
  requests continuously; it wakes only at arrivals and completions, never per decode
  step (``rollart.sim.pools``). Requests are routed by the runtime's ``Router``
  (``rollart.policy.routing``: affinity, auto classification, stickiness — its prefix
  cache spares the cached tokens' prefill — and least-loaded); PD (prefill pool → KV
  transfer at the weight link's rate → decode pool) follows the task's affinity.
* **Reward** on a dedicated pool or the elastic pool (the runtime's ``Scaling``).
* **Buffer and trainer**: the runtime's ``Slots``/``GroupSequence`` (and ``StartBound``
  for ``areal``) admit groups; the runtime's ``Redundancy`` plans members and backups;
  a trainer step (``TrainCost`` on the batch's tokens, then the weight push) takes
  ``groups_per_step`` complete groups the runtime's ``StalenessBound`` calls fresh;
  workers find the new version after up to one store poll (``WeightRule``), pull it
  while generating (``WeightSync``; from one store node or as the trainer gang's buckets
  relayed among the workers, ``rollart.sim.fanout``), stall for the load and re-prefill
  their in-flight contexts (with ``Policy.weight_update="keep"``: the load alone);
  members the bound rules out are aborted and replaced, or, under
  ``Graph.stale_members == "rescore"`` (async's default on the torch engine), re-scored
  at their next turn boundary and before delivery as ``rollart.env.rescore`` does: one
  forward over their whole context on their worker (a prefill of every token, nothing
  cached), their tokens then that worker's version; one the worker's version still
  leaves out of the bound is aborted (the runtime first waits up to ``WAIT_S`` for the
  worker to load; the simulator does not wait).
* **Control plane**: Dask messages counted per turn and per step, their cost
  (``ControlPlane``) summed into scheduler, driver and env-manager loop load, and each
  round trip charged as latency on the path that waits for it (a turn's generation
  call, a group's acquire, a trajectory's reward task and buffer put, the trainer's
  get_table, the lockstep driver's train and weight-version calls).
* **Env managers' event loops**: each manager is one asyncio loop, a capacity-1
  resource; every turn holds it ``Costs.manager_turn_s`` (its Python: prompt building,
  tokenising, bookkeeping), so a manager's trajectories queue for it; with
  ``ControlPlane.near`` (env managers and inference workers in one process, as
  ``resources/laptop.py`` runs them) the workers pause as long (one GIL).
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict

import simpy

from rollart.policy.admission import (group_number, in_flight_for, stale_members_for,
                                      take_order)
from rollart.policy.affinity import env_tag, task_routes
from rollart.policy.redundancy import Redundancy, min_members
from rollart.policy.routing import Router
from rollart.sim.config import SimConfig, SimConfigError, SimResult
from rollart.sim.fanout import fan_out
from rollart.sim.members import Group, Manager, Member
from rollart.sim.modes import DRIVERS
from rollart.sim.pools import Meter, Req, RewardSim, SimWorker
from rollart.policy.staleness import StalenessBound, WeightRule, within

ABORTED, CANCELLED, FAILED, DELIVERED = "aborted", "cancelled", "failed", "delivered"


class Cluster:
    """One simulated run's state; ``rollart.sim.modes`` drives it."""

    def __init__(self, cfg: SimConfig):
        from rollart.sim.costs import Costs

        self.cfg, self.graph = cfg, cfg.graph
        self.costs = cfg.costs if cfg.costs is not None else Costs()
        self.env = simpy.Environment()
        seed = cfg.seed
        self.rng_env, self.rng_gen = random.Random(seed * 3 + 1), random.Random(seed * 3 + 2)
        self.rng_misc = random.Random(seed * 3 + 3)
        dt = cfg.timeline_dt or 1.0
        self.workers: list[SimWorker] = []
        self.meters: dict[str, Meter] = {}
        for pool in cfg.cluster.inference:
            self.meters[pool.tag] = Meter(pool.workers, dt)
            gen = self.costs.gen_for(pool.gpu, pool.tp, pool.tag)
            for _ in range(pool.workers):
                self.workers.append(SimWorker(
                    self.env, len(self.workers), pool.tag, gen, pool.max_batch,
                    self.meters[pool.tag], keep_kv=self.graph.policy.weight_update == "keep"))
        self.pool_of = {p.tag: p for p in cfg.cluster.inference}
        routes = task_routes(self.graph.tasks)
        tags = [w.tag for w in self.workers]
        near = tuple(self.workers) if self.costs.control.near else ()
        self.managers: dict[str, list[Manager]] = {}
        for ep in cfg.cluster.env:
            res = simpy.Resource(self.env, capacity=max(1, ep.slots))
            meter = self.meters[ep.tag] = Meter(ep.slots, dt)
            n = ep.managers or -(-ep.slots // max(1, self.graph.rollout.env_concurrency))
            self.managers[ep.tag] = [Manager(self.env, f"{ep.tag}-{i}", res, meter,
                                             Router(tags, routes), near)
                                     for i in range(max(1, n))]
        self._rr: Counter = Counter()
        self.reward = RewardSim(self.env, cfg.cluster.reward, self.costs.reward,
                                random.Random(seed * 3 + 4), dt)
        self.train_cost = self.costs.train_for(cfg.cluster.trainer_gpu,
                                               cfg.cluster.trainer_gpus)
        self.trainer = Meter(1, dt)
        algo, ro = self.graph.algo, self.graph.rollout
        self.bound = StalenessBound(algo.alpha)
        # the graph's mode-dependent settings as the simulated mode (SimConfig.mode may
        # differ from the graph's) takes them: Rollout.max_in_flight, and stale_members
        # ("rescore": a member the bound rules out is re-scored at its next turn
        # boundary instead of aborted)
        self.mode = cfg.run_mode
        self.max_in_flight = in_flight_for(ro, self.mode)
        self.rescore = stale_members_for(ro, self.mode, self.graph.policy.engine) == "rescore"
        self.weights_rule = WeightRule()
        self.redundancy = Redundancy(ro.redundancy, ro.backup_after)
        self.inference_pools = tuple(p for p in ro.inference_pools if p in self.pool_of) \
            or None
        self.version = 0
        self.groups: dict[str, Group] = {}
        self.complete: OrderedDict[str, Group] = OrderedDict()
        self.trained_groups: list[list[int]] = []  # each step's groups, by start number
        self.changed = self.env.event()
        self.on_release = None  # the mode's hook when a group leaves (frees a slot)
        self.counts = Counter()
        self.msgs = Counter()
        self.staleness: Counter = Counter()
        self.decisions: list = []
        self.step_times: list[float] = []
        self.syncs: list[dict] = []  # per published version: rollart.sim.fanout's figures
        self.inflight_limits: list[int] = []  # max_in_flight="auto": each step's new limit
        self.trained = self.trained_tokens = 0

    # -- groups and members -------------------------------------------------------------
    def manager_for(self, task) -> Manager:
        tag = env_tag(task)
        pool = self.managers.get(tag) or next(iter(self.managers.values()))
        i = self._rr[tag]
        self._rr[tag] += 1
        return pool[i % len(pool)]

    def start_group(self, work, barrier=None, redundancy: Redundancy | None = None,
                    delay: float = 0.0) -> Group:
        """Start ``work``'s group; its first members wait ``delay`` (the acquire call's
        round trip) before they take a slot."""
        grp = Group(self.env, work, self.manager_for(work.task), barrier)
        self.groups[grp.gid] = grp
        start, grp.backups, grp.backup_at = (redundancy or Redundancy()).plan(grp.need)
        self.launch(grp, start, delay)
        return grp

    def launch(self, grp: Group, n: int, delay: float = 0.0) -> None:
        self.msgs["ledger"] += 1  # buffer.launched(ids): one actor call per launch
        self.counts["launched"] += n
        for _ in range(n):
            m = Member(f"{grp.gid}-{grp.next_index}", grp)
            grp.next_index += 1
            grp.members[m.id] = m
            m.proc = self.env.process(self.member(m, delay))

    def member(self, m: Member, delay: float = 0.0):
        """One trajectory: slot, reset, turns (the manager's loop, generation, env
        step), reward, buffer put; each control-plane round trip on its path."""
        grp, env, cp = m.group, self.env, self.costs.control
        shape = self.cfg.shape(grp.task.name)
        ec = self.costs.env_for(shape.env)
        mgr, turn_s = grp.manager, self.costs.manager_turn_s
        slot = None
        t0, reset = None, False
        try:
            if delay > 0:
                yield env.timeout(delay)
            slot = mgr.slots.request()
            yield slot
            t0 = env.now
            yield env.timeout(ec.sample_reset(self.rng_env))
            reset = True  # the env is up: a pooled one goes back at the end
            context = shape.prompt_tokens
            turns, mean_out = shape.draw(self.rng_gen)
            for turn in range(turns):
                if grp.barrier is not None:
                    yield grp.barrier.wait()
                if turn and self.rescore:
                    yield from self.refresh(m, mgr.router, grp.task.name, context)
                if turn_s > 0:
                    yield from mgr.turn(env, turn_s)
                out = self.sample_out(shape, mean_out)
                yield from self.generate(m, mgr.router, grp.task.name, context, out)
                context += out
                latency, failed = ec.sample_step(self.rng_env)
                yield env.timeout(latency)
                if failed:
                    m.failed = True
                    break
                if turn + 1 < turns:
                    context += shape.obs_tokens
            m.tokens = context
            if grp.barrier is not None:
                grp.barrier.leave()
                m.state = "left"
            if not m.failed:
                if self.reward_msgs():
                    yield env.timeout(cp.task_s)
                yield self.reward.call()
                if self.rescore:  # before delivery: no token below the bound
                    yield from self.refresh(m, mgr.router, grp.task.name, context)
            yield env.timeout(cp.actor_call_s)  # buffer.put / record_failed
            state = FAILED if m.failed else DELIVERED
        except simpy.Interrupt as stop:
            state = stop.cause
            if m.req is not None and not m.req.event.triggered:
                m.worker.cancel(m.req)
            if grp.barrier is not None and m.state != "left":
                grp.barrier.leave()
        finally:
            if slot is not None and slot.triggered:
                mgr.slots.release(slot)
            elif slot is not None:
                slot.cancel()
            if t0 is not None:
                mgr.meter.add(t0, env.now)
            if reset:  # the env goes back (a pooled one: rollart.sim.sandbox)
                ec.release()
            mgr.router.release(m.id)
        self.settle(m, state)

    def refresh(self, m: Member, router: Router, task: str, context: int):
        """``EnvManager._refresh`` under ``"rescore"``: a member whose oldest token the
        bound rules out is re-scored on its worker (one forward over its ``context``
        tokens, no sampling; its tokens then the version that forward ran under); one
        still out of the bound after that is aborted (``simpy.Interrupt(ABORTED)``, as
        the driver's abort would end it)."""
        if m.oldest is None or not self.bound.abort(m.oldest, self.version):
            return
        env, call_s = self.env, self.costs.control.generate_s
        idx = router.route(m.id, task, self.inference_pools, tokens=context)
        if call_s > 0:
            yield env.timeout(call_s)
        req = self._send(m, idx, Req(env, context, 0, context, 0, "prefill"), task, "score")
        try:
            yield req.event
        finally:
            router.done(idx, context)
        m.req = None
        if self.bound.abort(req.version, self.version):
            self.counts["rescore_failed"] += 1
            raise simpy.Interrupt(ABORTED)
        m.oldest = req.version
        self.counts["rescored"] += 1
        self.counts["rescored_tokens"] += context

    def sample_out(self, shape, mean: float | None = None) -> int:
        mean = shape.response_tokens if mean is None else mean
        if shape.spread <= 0:
            return max(1, int(mean))
        draw = (1 - shape.spread) + shape.spread * self.rng_gen.expovariate(1.0)
        return max(1, int(round(mean * draw)))

    def generate(self, m: Member, router: Router, task: str, context: int, out: int):
        """One turn's generation through the runtime's router (PD when it says so); each
        call's round trip (``ControlPlane.generate_s``; the KV fetch: an actor call)
        before its request reaches the worker."""
        env, call_s = self.env, self.costs.control.generate_s
        aff = router.disaggregated(task)
        new = router.new_tokens(m.id, context)
        if aff is None:
            idx = router.route(m.id, task, self.inference_pools, tokens=new + out)
            router.count_reuse(m.id, idx, context, new)
            if call_s > 0:
                yield env.timeout(call_s)
            req = self._send(m, idx, Req(env, new, context - new, context, out), task, "gen")
            try:
                yield req.event
            finally:
                router.done(idx, new + out)
            router.served(m.id, context + out - 1)
        else:
            p = router.route(m.id, pools=(aff.prefill,), tokens=new)
            router.count_reuse(m.id, p, context, new)
            if call_s > 0:
                yield env.timeout(call_s)
            req = self._send(m, p, Req(env, new, context - new, context, 0, "prefill"),
                             task, "prefill")
            try:
                yield req.event
            finally:
                router.done(p, new)
            router.served(m.id, context)
            oldest = req.version
            kv = self.costs.model.kv_bytes_per_token * context
            yield env.timeout(self.costs.weights.latency_s + kv / self.costs.weights.bytes_s
                              + self.costs.control.actor_call_s + call_s)  # fetch, call
            d = router.route(None, pools=(aff.decode,), tokens=out)
            req = self._send(m, d, Req(env, 0, context, context, out, "decode"), task,
                             "decode")
            try:
                yield req.event
            finally:
                router.done(d, out)
            req.version = oldest
            self.msgs["kv_fetch"] += 1
        router.observe(task, context, out)
        if m.oldest is None:
            m.oldest = req.version
        m.req = None

    def _send(self, m: Member, idx: int, req: Req, task: str, phase: str) -> Req:
        w = self.workers[idx]
        m.req, m.worker = req, w
        self.msgs["generate"] += 1
        self.counts["turn_requests"] += phase in ("gen", "prefill")  # not a re-scoring
        if self.cfg.record:
            self.decisions.append((task, w.tag, phase))
        w.submit(req)
        return req

    def reward_msgs(self) -> bool:
        """Count the reward's message; True when it runs as a Dask task."""
        local = self.graph.rollout.local_reward and self.cfg.cluster.reward.kind == "dedicated"
        self.msgs["reward_task" if not local else "reward_local"] += 1
        return not local

    def settle(self, m: Member, state: str) -> None:
        """``EnvManager._member``'s bookkeeping for a member that ended as ``state``."""
        grp = m.group
        grp.members.pop(m.id, None)
        self.msgs["ledger"] += 1  # buffer.put / settle / record_failed
        if state == ABORTED:
            self.counts["aborted"] += 1
            if not grp.filled:
                self.launch(grp, 1)
        elif state == CANCELLED or grp.filled:
            self.counts["cancelled"] += 1
        elif state == FAILED and grp.barrier is None and grp.replaced < grp.size:
            grp.replaced += 1
            self.counts["failed"] += 1
            self.counts["replaced"] += 1
            self.launch(grp, 1)
        else:
            self.counts["failed" if m.failed else "delivered"] += 1
            grp.delivered.append(m)
        if grp.filled:
            for other in list(grp.members.values()):
                if other.proc.is_alive and other.state != "stopping":
                    other.state = "stopping"
                    other.proc.interrupt(CANCELLED)
        elif n := Redundancy.backups_now(grp.backups, len(grp.delivered), grp.backup_at,
                                         len(grp.members)):
            grp.backups = 0
            self.counts["backups"] += n
            self.launch(grp, n)
        if grp.filled and not grp.members and not grp.done.triggered:
            self.group_complete(grp)

    # -- the buffer ---------------------------------------------------------------------
    def group_complete(self, grp: Group) -> None:
        grp.done.succeed()
        self.groups.pop(grp.gid, None)
        trainable = sum(not m.failed for m in grp.delivered)
        if grp.version is None or trainable < min_members(self.graph.algo.min_group_size,
                                                          grp.size):
            # too many members failed: nothing to train (rollart.buffer.infra), slot frees
            self.counts["groups_failed"] += 1
            self.release(grp)
            self.notify()  # a start-order window may have moved past it
            return
        self.complete[grp.gid] = grp
        self.notify()

    def notify(self) -> None:
        ev, self.changed = self.changed, self.env.event()
        ev.succeed()

    def release(self, grp: Group) -> None:
        if self.on_release is not None:
            self.on_release(grp)

    def take_batch(self, n: int, floor: int | None, limit=None):
        """``SampleBuffer.get_table``: drop complete groups below ``floor`` (``None``:
        never), wait for ``n``, take the first ``n`` completed; with ``limit`` (a callable,
        ``Slots.take_limit``: ``Rollout.take_window``) the first ``n`` started among
        those numbered below it."""
        while True:
            if floor is not None:
                for gid, g in list(self.complete.items()):
                    if not within(g.version, floor):
                        del self.complete[gid]
                        self.counts["dropped"] += len(g.delivered)
                        self.release(g)
            ready = take_order(self.complete, None if limit is None else limit())
            if len(ready) >= n:
                batch = [self.complete.pop(gid) for gid in ready[:n]]
                for g in batch:
                    self.release(g)
                return batch
            yield self.changed

    def abort_stale(self) -> int:
        """``EnvManager.abort_older_than(bound.min_version(version))`` on every manager;
        under ``"rescore"`` it aborts none (the members re-score at their next turn
        boundary: ``refresh``)."""
        n = 0
        if self.rescore:
            self.msgs["driver"] += sum(len(v) for v in self.managers.values())
            return 0
        for grp in list(self.groups.values()):
            for m in list(grp.members.values()):
                if self.bound.abort(m.oldest, self.version) and m.proc.is_alive and \
                        m.state != "stopping":
                    m.state = "stopping"
                    m.proc.interrupt(ABORTED)
                    n += 1
        self.msgs["driver"] += sum(len(v) for v in self.managers.values())
        return n

    # -- the trainer and the weights ----------------------------------------------------
    def train(self, batch: list[Group]):
        """One trainer step on ``batch``: the update, then the weight push."""
        t0 = self.env.now
        yield self.env.timeout(self.costs.control.actor_call_s)  # get_table's round trip
        members = [m for g in batch for m in g.delivered if not m.failed]  # the buffer's rows
        tokens = sum(m.tokens for m in members)
        for m in members:
            if not m.failed and m.oldest is not None:
                self.staleness[self.bound.lag(m.oldest, self.version)] += 1
        yield self.env.timeout(self.train_cost.step_s(tokens))
        yield self.env.timeout(self.costs.weights.publish_s(
            self.costs.model, self.cfg.cluster.trainer_gpus))
        self.trainer.add(t0, self.env.now)
        self.version += 1
        self.trained += len(members)
        self.trained_tokens += tokens
        self.step_times.append(self.env.now)
        self.trained_groups.append(sorted(group_number(g.gid) for g in batch))
        self.msgs["driver"] += 2  # train_step + its result
        self.msgs["trainer"] += 3  # get_table, weight store put, mark_trained

    def publish(self, wait: bool = False) -> simpy.Event:
        """Workers load the new version: lockstep (``wait``) at once, nothing hidden;
        otherwise each finds it within one store poll and pulls it while generating.
        When each worker holds the whole version is ``rollart.sim.fanout``'s answer for
        ``WeightSync.path`` (the store node's shared links, or the gang's buckets
        relayed among the workers); the version's sync time and origin bytes are kept
        in ``syncs``."""
        version, w_cost, model = self.version, self.costs.weights, self.costs.model
        pools = [self.pool_of[w.tag] for w in self.workers]
        starts = [0.0 if wait else self.rng_misc.uniform(0, self.weights_rule.poll_s)
                  for _ in self.workers]
        fan = fan_out(w_cost, model.weight_bytes, [p.tp for p in pools],
                      self.cfg.cluster.trainer_gpus, starts)
        self.syncs.append({"version": version, "sync_s": fan.sync_s,
                           "origin_bytes": fan.origin_bytes,
                           "origin_ratio": fan.origin_ratio, "buckets": fan.buckets,
                           "origins": fan.origins})
        loads = []
        for w, pool, pulled in zip(self.workers, pools, fan.done_s):
            load = w_cost.load_s(model, self.costs.gpus[pool.gpu], pool.tp)
            if wait:  # nothing to overlap: the pull and the load both stall the worker
                loads.append(w.load(version, pulled + load))
                continue
            done = self.env.event()  # prefetched while generating: the load is exposed
            loads.append(done)
            ev = self.env.timeout(pulled)
            ev.callbacks.append(lambda _e, w=w, x=load, v=version, d=done:
                                w.load(v, x).callbacks.append(lambda _l: d.succeed()))
        return self.env.all_of(loads)


def simulate(config: SimConfig) -> SimResult:
    """Run ``config``: ``config.steps`` trainer steps in ``config.run_mode``; returns the
    figures (``SimResult``). Deterministic for a seed. Raises ``SimConfigError`` when
    the run stalls (no event left before the last step) or passes ``max_sim_s``."""
    from rollart.sim.report import result

    mode = config.run_mode
    if mode not in DRIVERS:
        raise SimConfigError(f"mode {mode!r} is not simulated; use one of {sorted(DRIVERS)}")
    t0 = time.perf_counter()
    cl = Cluster(config)
    main = cl.env.process(DRIVERS[mode](cl))
    limit = cl.env.timeout(config.max_sim_s)
    cl.env.run(until=cl.env.any_of([main, limit]))
    if not main.triggered:
        raise SimConfigError(
            f"simulated run ({mode}) did not finish {config.steps} steps within "
            f"max_sim_s={config.max_sim_s:g} s (reached {cl.version} steps): raise "
            f"max_sim_s, or check the config (env slots, groups_per_step)")
    if not main.ok:
        raise main.value
    return result(cl, mode, time.perf_counter() - t0)
