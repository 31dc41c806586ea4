"""A finished simulated run's figures: utilisation, throughput, staleness, aborts and
the Dask control plane's load, as a ``SimResult``.

Consumes a ``rollart.sim.cluster.Cluster`` after its run; produces the ``SimResult``.
Called by ``rollart.sim.cluster.simulate``.

Control-plane model (messages per turn and per step, costs from ``ControlPlane``):

* actor calls, worker to worker (no scheduler): a generation request (PD: prefill,
  decode, and the KV fetch), the buffer's ledger calls (launched / put / settle),
  a group's acquire; each costs ``actor_call_s`` on the caller's and the callee's
  event loops — the env managers' loops carry most of them;
* scheduler tasks: a reward on the serverless pool (``msgs_per_task`` messages each),
  and every Dask worker's heartbeat (distributed's interval: 0.5 s up to 10 workers,
  1 s up to 50, 2 s up to 200, then ``n / 200 + 1`` s);
* the driver: lockstep modes launch each group and wait for each worker's version;
  async asks every manager to abort after each step.

``manager_loop_busy`` is the busiest env manager loop's share of the run held by turns
(``Costs.manager_turn_s`` each). The scheduler's load is its messages per second over its capacity
(``scheduler_tasks_s × msgs_per_task``); ``saturates_at_gpus`` extrapolates the GPU
count at which it reaches 1, everything scaling with the cluster.
"""

from __future__ import annotations

from rollart.sim.config import SimResult


def heartbeat_interval(n: int) -> float:
    """distributed's worker heartbeat interval for ``n`` workers (seconds)."""
    if n <= 10:
        return 0.5
    if n < 50:
        return 1.0
    if n < 200:
        return 2.0
    return n / 200 + 1


def control(cl, horizon: float) -> dict:
    cp = cl.costs.control
    m = cl.msgs
    turns = max(cl.counts["turn_requests"], 1)
    steps = max(len(cl.step_times), 1)
    actor = m["generate"] + m["kv_fetch"] + m["ledger"] + m["acquire"]
    managers = sum(len(v) for v in cl.managers.values())
    trainer_nodes = max(1, cl.cfg.cluster.trainer_gpus // 8)
    dask_workers = len(cl.workers) + managers + trainer_nodes + 1 + \
        max(len(cl.reward.workers), 1)
    heartbeats = dask_workers / heartbeat_interval(dask_workers) * horizon
    sched_msgs = m["reward_task"] * cp.msgs_per_task + heartbeats + m["driver"]
    capacity = cp.scheduler_tasks_s * cp.msgs_per_task
    sched_load = sched_msgs / horizon / capacity if horizon > 0 else 0.0
    gpus = cl.cfg.cluster.gpus
    return {
        "actor_calls": actor, "reward_tasks": m["reward_task"], "driver_calls": m["driver"],
        "heartbeats": round(heartbeats), "dask_workers": dask_workers,
        "msgs_per_turn": (actor + m["reward_task"] * cp.msgs_per_task) / turns,
        "msgs_per_step": (actor + sched_msgs) / steps,
        "scheduler_msgs_s": sched_msgs / horizon if horizon else 0.0,
        "scheduler_load": sched_load,
        "driver_load": m["driver"] * cp.actor_call_s / horizon if horizon else 0.0,
        "managers": managers,
        "manager_loop_load": 2 * (m["generate"] + m["ledger"] + m["kv_fetch"]) *
        cp.actor_call_s / horizon / managers if horizon else 0.0,
        "manager_loop_busy": max((mgr.loop_busy for v in cl.managers.values() for mgr in v),
                                 default=0.0) / horizon if horizon else 0.0,
        "buffer_loop_load": (m["ledger"] + m["acquire"]) * cp.actor_call_s / horizon
        if horizon else 0.0,
        "saturates_at_gpus": gpus / sched_load if sched_load > 0 else float("inf"),
    }


def result(cl, mode: str, wall_s: float) -> SimResult:
    horizon = cl.step_times[-1] if cl.step_times else cl.env.now
    util, timeline = {}, {}
    for tag, meter in cl.meters.items():
        util[tag] = meter.utilisation(horizon)
        timeline[tag] = meter.timeline(horizon)
    r = cl.reward
    util["reward"] = r.meter.busy / r.held(horizon) if r.held(horizon) > 0 else 0.0
    timeline["reward"] = r.meter.timeline(horizon)
    util["trainer"] = cl.trainer.utilisation(horizon)
    timeline["trainer"] = cl.trainer.timeline(horizon)
    c = cl.counts
    aborts = {k: c[k] for k in ("aborted", "cancelled", "failed", "replaced", "backups",
                                "dropped", "groups_failed", "launched", "delivered",
                                "rescored", "rescored_tokens", "rescore_failed")}
    reuse = [mgr.router.stats()["expected_reuse"] for v in cl.managers.values()
             for mgr in v]
    spread = {}
    for tag in cl.pool_of:
        busy = sorted(w.busy / horizon for w in cl.workers if w.tag == tag) if horizon else []
        if busy:
            spread[tag] = {"min": busy[0], "median": busy[len(busy) // 2], "max": busy[-1]}
    return SimResult(
        mode=mode, sim_time_s=horizon, steps=len(cl.step_times), trained=cl.trained,
        throughput={"trajectories_s": cl.trained / horizon if horizon else 0.0,
                    "tokens_s": cl.trained_tokens / horizon if horizon else 0.0,
                    "steps_s": len(cl.step_times) / horizon if horizon else 0.0},
        utilisation=util, timeline=timeline,
        staleness=dict(sorted(cl.staleness.items())), aborts=aborts,
        control=control(cl, horizon), sim_wall_s=wall_s,
        step_times=list(cl.step_times), gpus=cl.cfg.cluster.gpus,
        decisions=list(cl.decisions),
        extra={"prefix_reuse": sum(reuse) / len(reuse) if reuse else 0.0,
               "reward_cold_starts": r.cold_starts,
               "weight_loads": sum(w.loads for w in cl.workers),
               "engine_stalled_s": sum(w.stalled for w in cl.workers),
               "engine_busy_s": sum(w.busy for w in cl.workers),
               "turns": cl.counts["turn_requests"],
               "requests": sum(w.admitted for w in cl.workers),
               "worker_busy": spread,
               "weight_bytes_per_version": len(cl.workers) * cl.costs.model.weight_bytes,
               "trained_groups": [list(b) for b in cl.trained_groups],
               "inflight_limits": list(cl.inflight_limits),
               **weight_sync(cl)})


def weight_sync(cl) -> dict:
    """The weight path's figures (``rollart.sim.fanout``): per published version the
    seconds until the last worker held it (``weight_sync_s``), the origins' bytes over
    the bytes delivered (``origin_bytes_ratio``: 1 from the store, about 1/workers
    relayed), the buckets and the ranks that served them."""
    s = cl.syncs
    return {"weight_path": cl.costs.weights.path,
            "weight_sync_s": [x["sync_s"] for x in s],
            "origin_bytes_ratio": s[-1]["origin_ratio"] if s else float("nan"),
            "origin_bytes_per_version": s[-1]["origin_bytes"] if s else float("nan"),
            "weight_buckets": s[-1]["buckets"] if s else 0,
            "weight_origins": s[-1]["origins"] if s else 0}
