"""``resources/laptop.py`` with the inference engine in a worker process of its own.

On ``laptop`` the engine's serve loop shares one process, so one GIL, with the env
managers, the rewards and the worker's event loop: the engine gets the GIL between its
torch calls only when nobody else holds it. Here the inference tags move to a second
worker: the engine runs apart from its front end (the env managers, which reach it
through Dask's comm: every turn crosses processes and is serialised twice), as vLLM's
engine core runs apart from its API server. Which of the two layouts is faster on a
machine is a measurement (``benchmarks/pipeline.py --resources laptop_engine``,
``benchmarks/limits.py --resources laptop_engine``), not a rule.

    rollart train --resources laptop_engine
"""

from rollart.runtime.resources import Pool, Resources
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN


def resources() -> Resources:
    return Resources(
        pools=(
            Pool("rollout", tag=CPU_ENV, kind="cpu_env", workers=1, threads=2,
                 extra_tags={REWARD: 1}),
            Pool("engine", tag=H800, kind="compute_gpu", workers=1, threads=1,
                 extra_tags={H20: 1}),
            Pool("trainer", tag=TRAIN, kind="trainer", workers=1, threads=1,
                 extra_tags={BUFFER: 1}),
        ),
        processes=True,
    )
