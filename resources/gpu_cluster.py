"""A heterogeneous GPU cluster: compute- and bandwidth-optimized GPUs, CPU envs, rewards.

The layout the RollArt paper argues for, as Dask worker resource tags: prefill-heavy
work on compute-optimized GPUs (H800), decode-heavy work on bandwidth-optimized GPUs
(H20), environments on a CPU pool, rewards on an elastic pool, training on its own GPUs.
Graphs place work on these tags with ``rollart.task_affinity`` / ``env_affinity`` /
``reward_affinity``; a tag a graph names that is not declared here is refused before
anything starts. The sample buffer (the run's ledger and samples) gets a small CPU worker
of its own (``BUFFER``), off the env pool. Started by ``rollart train --resources gpu_cluster`` on one big host
(one worker process per declared worker); on many hosts start the same tags with
``dask worker --resources`` and use ``resources/scheduler.py``.
"""

from rollart.runtime.resources import Pool, Resources
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN


def resources() -> Resources:
    return Resources(
        pools=(
            Pool("prefill-h800", tag=H800, kind="compute_gpu", workers=2, slots=1,
                 threads=4),
            Pool("decode-h20", tag=H20, kind="bandwidth_gpu", workers=4, slots=1,
                 threads=2),
            Pool("env-cpu", tag=CPU_ENV, kind="cpu_env", workers=2, slots=4, threads=8),
            Pool("reward", tag=REWARD, kind="reward", workers=1, slots=8, threads=8),
            Pool("trainer", tag=TRAIN, kind="trainer", workers=1, threads=8),
            Pool("buffer", tag=BUFFER, kind="cpu", workers=1, threads=2),
        ),
        processes=True,
    )
