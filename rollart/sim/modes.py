"""The simulated modes: how rollout and training interleave, as ``rollart.control.modes``
defines them, each a simpy process over a ``rollart.sim.cluster.Cluster``.

==========  =========================================================================
``async``   The buffer's slots (``rollart.policy.admission.Slots``, capacity
            ``rollart.policy.admission.slot_capacity``) pace rollout: a group starts when one
            frees; ``Redundancy`` extras; the trainer takes any ``alpha``-fresh groups
            (``StalenessBound``); workers pull each version while generating; members
            that can no longer meet the bound are aborted and replaced. With
            ``Rollout.max_in_flight="auto"`` the runtime's ``InflightLimit`` resizes
            the slots after each step from the simulated pace (``_pace``).
``areal``   As ``async`` under ``StartBound`` (the bound checked when a group starts);
            nothing aborted or dropped.
``one-off`` Batch k+1 rolls out turn by turn (a barrier per turn) while the trainer
            trains on batch k, launched once every worker holds the trainer's version.
``sync+``   A batch's groups each on their own (no turn barrier, ``Redundancy``
            extras), then train with rollout stopped, then every worker loads the new
            version.
``sync``    As ``sync+`` with a barrier per turn and no extras.
==========  =========================================================================

Each driver call a mode waits on (lockstep modes: train_step, the gathered
wait_version) costs ``ControlPlane.actor_call_s`` of latency; async's acquire delays the
group's start by one round trip.

Consumes the cluster's state and policy objects; produces trainer steps. Called by
``rollart.sim.cluster.simulate``.
"""

from __future__ import annotations

from rollart.policy.admission import (AUTO, GroupSequence, Slots, StartBound, Work,
                                      auto_admission, take_window_for)
from rollart.policy.inflight import InflightLimit, Pace
from rollart.policy.redundancy import Redundancy
from rollart.sim.members import Barrier


def _sequence(cl) -> GroupSequence:
    g = cl.graph
    return GroupSequence(g.tasks, g.task_weights, g.seed + cl.cfg.seed, g.algo.group_size)


def asynchronous(cl, areal: bool = False):
    """``async`` / ``areal``: slots pace rollout while the trainer steps."""
    from rollart.policy.admission import slot_capacity

    algo, limit = cl.graph.algo, cl.max_in_flight
    window = take_window_for(cl.graph, cl.mode)  # None: completion order
    # "auto" adapts as the runtime does, unless SimConfig.slot_capacity fixes async's
    adapting = limit == AUTO and not (cl.cfg.slot_capacity and not areal)
    inflight = InflightLimit.for_algo(algo) if adapting else None
    if areal:  # Rollout.max_in_flight bounds it as it bounds async, when set
        admission = StartBound(algo.alpha, algo.groups_per_step,
                               None if limit is None else slot_capacity(algo, limit))
        slots = Slots(admission.capacity, _sequence(cl), admission, window)
    elif inflight is not None:  # "auto": the runtime's start bound under the limit
        slots = Slots(inflight.limit, _sequence(cl), auto_admission(algo, inflight.limit),
                      window)
    else:
        slots = Slots(cl.cfg.slot_capacity or slot_capacity(algo, limit), _sequence(cl),
                      take_window=window)
    training = [0]

    def fill() -> None:
        while True:
            work = slots.take("sim", None, training=training[0])
            if work is None:
                return
            cl.msgs["acquire"] += 1
            cl.start_group(work, redundancy=cl.redundancy,
                           delay=cl.costs.control.actor_call_s)  # take_work's round trip

    def released(grp) -> None:  # a slot frees: the managers take work (take_work)
        slots.release(grp.gid)
        fill()

    cl.on_release = released
    fill()
    # areal drops nothing; nor does async keeping stale groups (GRPO.stale_groups: the
    # trainer re-scores them in the forward it runs anyway, or trains them as they are;
    # at no simulated cost either way)
    keep = areal or algo.stale_groups != "drop"
    for _ in range(cl.cfg.steps):
        floor = None if keep else cl.bound.min_version(cl.version)
        t0, lost = cl.env.now, (cl.counts["dropped"], cl.counts["aborted"])
        batch = yield from cl.take_batch(algo.groups_per_step, floor,
                                         None if window is None else slots.take_limit)
        waited = cl.env.now - t0
        training[0] = len(batch)
        fill()
        yield from cl.train(batch)
        slots.published(len(batch))
        training[0] = 0
        cl.publish()
        if not areal:
            cl.counts["aborted_now"] += cl.abort_stale()
        if inflight is not None:  # the runtime's rule on the simulated pace
            slots.resize(inflight.update(_pace(cl, waited, cl.env.now - t0, lost)))
            cl.inflight_limits.append(slots.capacity)
        fill()


def _pace(cl, waited: float, step_s: float, lost_before: tuple) -> Pace:
    """A simulated step's ``Pace``: the engines' rows and queues (beyond their free
    rows) at its end (the runtime averages rows over the step; a simulated worker keeps
    no decode count); members dropped as too stale or aborted, the more of the two, as
    ``pace_of`` counts them."""
    ws = cl.workers
    lost = max(cl.counts["dropped"] - lost_before[0], cl.counts["aborted"] - lost_before[1])
    return Pace(waited_s=waited, step_s=step_s,
                rows=sum(len(w.active) for w in ws) / max(len(ws), 1),
                batch=min((w.max_batch for w in ws), default=1),
                queued=sum(max(0, len(w.pending) - max(0, w.max_batch - len(w.active)))
                           for w in ws) / max(len(ws), 1),
                stale_groups=lost / max(cl.graph.algo.group_size, 1))


def areal(cl):
    return asynchronous(cl, areal=True)


def _batch(cl, seq, lockstep: bool, redundancy: Redundancy | None):
    """Launch one step's groups (``Pipeline.run_batch``); returns their done events."""
    algo = cl.graph.algo
    works = [Work(*seq.next(), algo.group_size) for _ in range(algo.groups_per_step)]
    barrier = Barrier(cl.env, sum(w.size for w in works)) if lockstep else None
    cl.msgs["driver"] += len(works)  # run_batch / run_group per group
    return [cl.start_group(w, barrier, redundancy).done for w in works]


def _take_all(cl):
    """After a lockstep batch: everything complete is this step's batch."""
    n = len(cl.complete)
    batch = yield from cl.take_batch(n, None)
    return batch


def synchronous(cl, lockstep: bool = True):
    """``sync`` (lockstep) / ``sync+`` (each trajectory on its own, with extras)."""
    seq = _sequence(cl)
    red = None if lockstep else cl.redundancy
    call_s = cl.costs.control.actor_call_s
    for _ in range(cl.cfg.steps):
        yield cl.env.all_of(_batch(cl, seq, lockstep, red))
        batch = yield from _take_all(cl)
        yield cl.env.timeout(call_s)  # the driver's train_step call
        yield from cl.train(batch)
        cl.msgs["driver"] += len(cl.workers)  # wait_version per worker (gathered)
        yield cl.env.timeout(call_s)
        yield cl.publish(wait=True)


def sync_plus(cl):
    return synchronous(cl, lockstep=False)


def one_off(cl):
    """``one-off``: the next batch rolls out (lockstep) while the trainer trains."""
    seq = _sequence(cl)
    pending = _batch(cl, seq, True, None)
    loads = None
    for _ in range(cl.cfg.steps):
        yield cl.env.all_of(pending)
        batch = yield from _take_all(cl)
        if loads is not None:
            yield loads  # every worker holds the trainer's version
        pending = _batch(cl, seq, True, None)
        yield from cl.train(batch)
        loads = cl.publish(wait=False)  # workers pick the version up themselves


DRIVERS = {"async": asynchronous, "areal": areal, "one-off": one_off, "sync+": sync_plus,
           "sync": synchronous}
