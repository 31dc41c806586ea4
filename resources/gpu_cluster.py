"""A heterogeneous GPU node: compute- and bandwidth-optimized GPUs, CPU envs, rewards.

The layout the RollArt paper argues for, as Dask worker resource tags: prefill-heavy
work on compute-optimized GPUs (H800), decode-heavy work on bandwidth-optimized GPUs
(H20), environments on a CPU pool, rewards on an elastic pool, training on its own GPUs.
Graphs place work on these tags with ``rollart.task_affinity`` / ``env_affinity`` /
``reward_affinity``; a tag a graph names that is not declared here is refused before
anything starts. The sample buffer (the run's ledger and samples) gets a small CPU worker
of its own (``BUFFER``), off the env pool.

Eight GPUs: each GPU worker owns one (``Pool.gpus``; ``rollart.runtime.devices`` sets its
``CUDA_VISIBLE_DEVICES``): 2 prefill, 4 decode, and 2 trainer workers, which train as
one two-rank FSDP gang (``rollart.trainer.gang``). Started by ``rollart train
--resources gpu_cluster`` on one 8-GPU host (one worker process per declared worker); on
many hosts start the same tags with ``dask worker --resources`` (each with its
``CUDA_VISIBLE_DEVICES`` and ``ROLLART_GPUS``) and use ``resources/scheduler.py``. On a
host without GPUs the same layout runs on the CPU (a warning says so).
"""

from rollart.runtime.resources import Pool, Resources
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN


def resources() -> Resources:
    return Resources(
        pools=(
            Pool("prefill-h800", tag=H800, kind="compute_gpu", workers=2, slots=1,
                 threads=4, gpus=1),
            Pool("decode-h20", tag=H20, kind="bandwidth_gpu", workers=4, slots=1,
                 threads=2, gpus=1),
            Pool("env-cpu", tag=CPU_ENV, kind="cpu_env", workers=2, slots=4, threads=8),
            Pool("reward", tag=REWARD, kind="reward", workers=1, slots=8, threads=8),
            Pool("trainer", tag=TRAIN, kind="trainer", workers=2, threads=8, gpus=1),
            Pool("buffer", tag=BUFFER, kind="cpu", workers=1, threads=2),
        ),
        processes=True,
    )
