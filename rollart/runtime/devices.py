"""Which GPUs each worker process gets, and which device an actor on it computes on.

A ``Pool`` declares ``gpus`` per worker (``rollart.runtime.resources``). When a resources
file starts its pools as worker processes, ``assign_gpus`` hands each such worker its own
GPUs, in pool order (pool A's workers take GPUs 0, 1, …; the next GPU pool continues),
and the worker's environment gets ``CUDA_VISIBLE_DEVICES`` (so its first visible device
is its own, as dask-cuda's ``LocalCUDACluster`` does it) and ``ROLLART_GPUS`` (the same
ids: the mark that the worker owns GPUs). Workers of a pool without GPUs see none
(``CUDA_VISIBLE_DEVICES=""``) once any pool declares some, so a CPU pool never grabs a
GPU by accident. A worker started by hand (``dask worker`` on a cluster host) gets the
same two variables from its launcher.

``worker_device()`` is what an actor computes on: the first visible CUDA device when its
worker owns GPUs and torch sees CUDA, else the CPU. A worker owns GPUs when
``ROLLART_GPUS`` names some or, where it is not set, when its launcher restricted
``CUDA_VISIBLE_DEVICES`` to some (SLURM's ``--gres=gpu:N`` does: ``resources/jobqueue.py``);
a worker whose environment says neither (a laptop's workers beside a GPU) stays on the
CPU. ``ROLLART_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``) overrides it. On a host without GPUs, a layout that declares them
runs on the CPU, the same code path (``check_gpus`` says so once).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

#: set in a worker's environment: the GPU ids it owns (empty or absent: none)
GPUS_ENV = "ROLLART_GPUS"
DEVICE_ENV = "ROLLART_DEVICE"


class GPUAssignmentError(ValueError):
    """The pools ask for more GPUs than the host has, or for GPUs in one process."""


def assign_gpus(pools, available: int | None) -> dict[str, list[int]]:
    """``{worker name: GPU ids}`` for every worker of ``pools`` (``{pool}-{i}``), GPUs
    handed out in order; ``available`` (None: unknown) bounds the total when > 0.

    >>> from rollart.runtime.resources import Pool
    >>> pools = (Pool("train", tag="TRAIN", kind="trainer", workers=2, gpus=2),
    ...          Pool("env", tag="CPU_ENV", kind="cpu_env"),
    ...          Pool("decode", tag="H20", kind="bandwidth_gpu", gpus=1))
    >>> assign_gpus(pools, 8)
    {'train-0': [0, 1], 'train-1': [2, 3], 'env-0': [], 'decode-0': [4]}
    """
    out, nxt = {}, 0
    for p in pools:
        for i in range(p.workers):
            out[f"{p.name}-{i}"] = list(range(nxt, nxt + p.gpus))
            nxt += p.gpus
    if available and nxt > available:
        wanted = ", ".join(f"{p.name}: {p.workers} x {p.gpus}" for p in pools if p.gpus)
        raise GPUAssignmentError(
            f"the pools ask for {nxt} GPUs ({wanted}) but this host has {available}: "
            "lower Pool.gpus or Pool.workers, or start the other workers on other hosts "
            "(resources/scheduler.py)")
    return out


def worker_env(gpus: list[int], parent: str | None = None) -> dict[str, str]:
    """The environment variables of a worker that owns ``gpus`` (``[]``: none), ids
    counted within ``parent`` (this process's ``CUDA_VISIBLE_DEVICES``) when it is set.

    >>> worker_env([0, 1])
    {'CUDA_VISIBLE_DEVICES': '0,1', 'ROLLART_GPUS': '0,1'}
    >>> worker_env([1], parent="4,6")["CUDA_VISIBLE_DEVICES"], worker_env([])[GPUS_ENV]
    ('6', '')
    """
    visible = [v for v in (parent or "").split(",") if v.strip()]
    ids = ",".join(visible[g] if visible else str(g) for g in gpus)
    return {"CUDA_VISIBLE_DEVICES": ids, GPUS_ENV: ids}


def visible_gpu_count() -> int:
    """CUDA devices this process sees (0 without torch's CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA: none
        return 0


def check_gpus(pools, processes: bool, source: str) -> dict[str, list[int]] | None:
    """The GPU assignment of a layout started here, or None when no pool declares GPUs.
    GPUs in one process (``processes=False``) are refused: each worker's devices are
    its process's environment."""
    wanted = sum(p.gpus * p.workers for p in pools)
    if not wanted:
        return None
    if not processes:
        raise GPUAssignmentError(
            f"{source}: pools declare GPUs (Pool.gpus) but the workers are threads of one "
            "process (processes=False); a worker's GPUs are set in its process's "
            "environment: use processes=True")
    have = visible_gpu_count()
    if not have:
        logger.warning("%s: the pools declare %d GPUs but this host has none visible: "
                       "every worker computes on the CPU (the same code path)", source,
                       wanted)
    return assign_gpus(pools, have)


def worker_device(env=None):
    """The ``torch.device`` an actor on this worker computes on (module docstring)."""
    import torch

    env = os.environ if env is None else env
    if env.get(DEVICE_ENV):
        return torch.device(env[DEVICE_ENV])
    owned = env.get(GPUS_ENV, env.get("CUDA_VISIBLE_DEVICES", ""))
    if owned.strip() and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")
