"""CPU contention on a shared machine, as the kernel counts it: how much longer rollart's
runnable threads took than the CPU time they got, and the laptop's CPU costs rescaled
by it.

Consumes ``/proc/self/task/*/schedstat`` (Linux: per thread, nanoseconds on a CPU and
nanoseconds waiting on a run queue while runnable) in this process and, through a Dask
client, in every worker process of its cluster; produces ``stretch`` figures and the
costs of ``rollart.sim.measure.EngineFit`` scaled by a stretch ratio (``scaled``).
Called by ``rollart.sim.calibrate`` and tests.

The model (stated, not fitted): a CPU-bound cost's wall time is its CPU time times the
stretch ``(run + wait) / run`` of the threads doing it. The laptop's CPU costs are
measured (micro-benchmarks, then the per-mode probe's in-situ figures) at the probe's
stretch; the real run they stand for may meet another one as the other processes on
the machine come and go, so the calibration measures each run's stretch over the run,
per process (the rollout worker: engine, env manager, rewards; the trainer's), from
the kernel's counters of rollart's own threads (not any figure of the run's
throughput), and scales each process's CPU costs by its ``run stretch / probe
stretch``. Env latency (``asyncio.sleep`` in the benchmark's profile) is not CPU and is
not scaled.
"""

from __future__ import annotations

import os
from dataclasses import replace

__all__ = ["cluster_clocks", "roles", "scaled", "stretch", "stretches", "thread_clocks"]


def thread_clocks() -> dict:
    """``{(pid, tid): (seconds run, seconds waited runnable)}`` for this process's
    threads (empty where the kernel has no schedstat: not Linux, or no schedstats)."""
    pid, out = os.getpid(), {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        out[(pid, int(tid))] = (int(run) / 1e9, int(wait) / 1e9)
    return out


def cluster_clocks(client=None) -> dict:
    """``{process: thread_clocks()}``: ``"client"`` for this process and, with
    ``client``, each worker process of its cluster by address."""
    out = {"client": thread_clocks()}
    if client is not None:
        out.update(client.run(thread_clocks))
    return out


def stretch(before: dict, after: dict) -> float:
    """``(run + wait) / run`` between two ``thread_clocks`` readings, over the threads
    alive at the second (one started in between from zero; one that ended is lost);
    1.0: never waited; ``nan`` when none ran."""
    run = wait = 0.0
    for key, (r1, w1) in after.items():
        r0, w0 = before.get(key, (0.0, 0.0))
        run, wait = run + max(0.0, r1 - r0), wait + max(0.0, w1 - w0)
    return (run + wait) / run if run > 0 else float("nan")


def roles(client) -> dict:
    """``{"rollout": address, "trainer": address}``: the worker holding the ``CPU_ENV``
    resource (env manager, co-located engines, rewards) and the one holding ``TRAIN``."""
    from rollart.types import CPU_ENV, TRAIN

    out = {}
    for addr, w in client.scheduler_info()["workers"].items():
        res = w.get("resources", {})
        if CPU_ENV in res:
            out.setdefault("rollout", addr)
        if TRAIN in res:
            out.setdefault("trainer", addr)
    return out


def stretches(before: dict, after: dict, roles: dict) -> dict:
    """``{role: stretch}`` of the processes ``roles`` names (``{role: process}``, a key
    of ``cluster_clocks``) between two ``cluster_clocks`` readings."""
    return {role: stretch(before.get(proc, {}), after.get(proc, {}))
            for role, proc in roles.items()}


def scaled(fit, control, turn_s: float, k: float, k_train: float | None = None):
    """``(fit, control, turn_s)`` with the rollout process's CPU costs ``k`` times as
    long (the engine's overheads and rates, the reward call, the control plane's
    per-message costs and capacity, the env manager's turn) and the trainer process's
    ``k_train`` times (its step, its weight puts and the store's reads; ``None``:
    ``k``); a ratio that is not a positive number leaves its costs as measured."""
    k_train = k if k_train is None else k_train
    if k > 0:
        gpu = replace(fit.gpu, flops=fit.gpu.flops / k, hbm_bytes_s=fit.gpu.hbm_bytes_s / k)
        gen = replace(fit.gen, gpu=gpu, step_overhead_s=fit.gen.step_overhead_s * k,
                      row_overhead_s=fit.gen.row_overhead_s * k,
                      prefill_token_overhead_s=fit.gen.prefill_token_overhead_s * k,
                      request_overhead_s=fit.gen.request_overhead_s * k)
        fit = replace(fit, gpu=gpu, gen=gen, reward_s=fit.reward_s * k)
        control = replace(control, actor_call_s=control.actor_call_s * k,
                          task_s=control.task_s * k,
                          scheduler_tasks_s=control.scheduler_tasks_s / k)
        turn_s *= k
    if k_train > 0:
        tgpu = fit.train.gpu
        train = replace(fit.train, gpu=replace(tgpu, flops=tgpu.flops / k_train,
                                               hbm_bytes_s=tgpu.hbm_bytes_s / k_train),
                        overhead_s=fit.train.overhead_s * k_train)
        weights = replace(fit.weights, latency_s=fit.weights.latency_s * k_train,
                          tcp_bytes_s=fit.weights.tcp_bytes_s / k_train,
                          rdma_bytes_s=fit.weights.rdma_bytes_s / k_train)
        fit = replace(fit, train=train, weights=weights)
    return fit, control, turn_s
