"""An HPC cluster through dask-jobqueue: SLURM jobs per hardware pool, one scheduler.

A ``SLURMCluster`` (a ``SpecCluster``) runs the scheduler; every declared pool adds its
jobs to the cluster's worker spec with the pool's partition, GPUs and resource tag
(``--resources TAG=1``), so one scheduler sees all the tagged workers, and rollart
connects to its address like to any existing cluster. Needs ``pip install
dask-jobqueue`` and a SLURM login node; adjust partitions, GPUs and walltime below.
Nothing is submitted until ``rollart train --resources jobqueue`` calls
``resources()``. (Heterogeneous jobs go through the ``SpecCluster`` worker spec, which
dask-jobqueue has no public helper for; written against dask-jobqueue 0.9. There is no
SLURM on the CI machines: ``tests/policy/test_affinity.py`` checks the generated job scripts
through ``slurm_cluster(submit=False)`` and ``job_scripts``.)
"""

import os

from rollart.runtime.resources import Resources, ResourcesError
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN

#: pool tag -> (SLURM partition, number of jobs, extra #SBATCH lines)
POOLS = {
    H800: ("h800", 2, ["--gres=gpu:1"]),
    H20: ("h20", 4, ["--gres=gpu:1"]),
    CPU_ENV: ("cpu", 2, []),
    REWARD: ("cpu", 1, []),
    TRAIN: ("h800", 8, ["--gres=gpu:1"]),  # a GPU a rank: an 8-rank trainer gang
    BUFFER: ("cpu", 1, []),  # the sample buffer (ledger, samples), off the env pool
}
_CLUSTER = None  # keeps the scheduler alive for the run


def slurm_cluster(submit: bool = True, **scheduler_options):
    """The ``SLURMCluster`` with one job spec per worker of every pool; with ``submit``,
    its jobs are submitted (``sbatch``) before it is returned."""
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError:
        raise ResourcesError("resources/jobqueue.py needs dask-jobqueue: pip install "
                             "dask-jobqueue (or start workers yourself and use "
                             "resources/scheduler.py)") from None
    cluster = SLURMCluster(cores=8, memory="64GB", processes=1,
                           walltime=os.environ.get("ROLLART_WALLTIME", "04:00:00"),
                           scheduler_options=scheduler_options or None)
    for tag, (queue, jobs, extra) in POOLS.items():
        for i in range(jobs):
            options = {**cluster._job_kwargs, "queue": queue, "job_extra_directives": extra,
                       "worker_extra_args": ["--resources", f"{tag}=1"]}
            cluster.worker_spec[f"{tag}-{i}"] = {"cls": cluster.job_cls, "options": options}
    if submit:
        cluster.sync(cluster._correct_state)
    return cluster


def job_scripts(cluster) -> dict[str, str]:
    """The ``sbatch`` script of every job in ``cluster``'s spec, by job name."""
    return {name: spec["cls"](scheduler=cluster.scheduler_address, name=name,
                              **spec["options"]).job_script()
            for name, spec in cluster.worker_spec.items()}


def resources() -> Resources:
    global _CLUSTER
    _CLUSTER = slurm_cluster()
    return Resources(address=_CLUSTER.scheduler_address, source="resources/jobqueue.py")
