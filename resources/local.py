"""The default pool: this machine, as tagged CPU workers (one Dask worker process each).

Every role of a disaggregated cluster gets its own worker so placement is real even on a
laptop: two inference pools named after a compute-optimized (H800) and a
bandwidth-optimized (H20) GPU, an environment pool, a reward pool and the trainer.
Change counts or threads here; a graph that needs a tag missing here is refused early.

The sample buffer (the run's ledger and unflushed samples) carries the ``BUFFER`` tag on
the trainer's worker rather than a pool of its own: on 2 cores a sixth worker process
costs start-up time and memory (it imports rollart and torch like the others) for an
actor that is mostly idle; the trainer's process is not an env worker (envs are the
most failure-prone), and the trainer's batch pulls from a co-located buffer skip the
comm (``rollart.runtime.near``).
"""

from rollart.runtime.resources import Pool, Resources
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN


def resources() -> Resources:
    return Resources(
        pools=(
            Pool("infer-h800", tag=H800, kind="compute_gpu", workers=1, threads=1),
            Pool("infer-h20", tag=H20, kind="bandwidth_gpu", workers=1, threads=1),
            Pool("env", tag=CPU_ENV, kind="cpu_env", workers=1, threads=1),
            Pool("reward", tag=REWARD, kind="reward", workers=1, threads=2),
            Pool("trainer", tag=TRAIN, kind="trainer", workers=1, threads=1,
                 extra_tags={BUFFER: 1}),
        ),
        processes=True,
    )
