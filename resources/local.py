"""The default pool: this machine, as tagged CPU workers (one Dask worker process each).

Every role of a disaggregated cluster gets its own worker so placement is real even on a
laptop: two inference pools named after a compute-optimized (H800) and a
bandwidth-optimized (H20) GPU, an environment pool, a reward pool and the trainer.
Change counts or threads here; a graph that needs a tag missing here is refused early.
"""

from rollart.resources import Pool, Resources
from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN


def resources() -> Resources:
    return Resources(
        pools=(
            Pool("infer-h800", tag=H800, kind="compute_gpu", workers=1, threads=1),
            Pool("infer-h20", tag=H20, kind="bandwidth_gpu", workers=1, threads=1),
            Pool("env", tag=CPU_ENV, kind="cpu_env", workers=1, threads=1),
            Pool("reward", tag=REWARD, kind="reward", workers=1, threads=2),
            Pool("trainer", tag=TRAIN, kind="trainer", workers=1, threads=1),
        ),
        processes=True,
    )
