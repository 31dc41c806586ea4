"""One small machine, as few processes as the roles allow: rollout in one worker.

The default (``resources/local.py``) gives every role a worker process of its own, so
placement is real on a laptop too; every turn then crosses processes (env manager →
inference worker) and is serialised twice. On a 2-core machine that comm is a large
share of the work. Here one worker carries the environment pool, both inference tags and
the reward pool: env managers and the inference workers share its event loop and call
each other directly (``rollart.runtime.near``), and rewards run on its threads. The trainer
keeps its own process, so training overlaps rollout, and carries the ``BUFFER`` tag:
the sample buffer (the run's ledger and unflushed samples) stays off the worker that
holds the envs, the most failure-prone one.

    rollart train --resources laptop
"""

from rollart.runtime.resources import Pool, Resources
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN


def resources() -> Resources:
    return Resources(
        pools=(
            Pool("rollout", tag=CPU_ENV, kind="cpu_env", workers=1, threads=2,
                 extra_tags={H800: 1, H20: 1, REWARD: 1}),
            Pool("trainer", tag=TRAIN, kind="trainer", workers=1, threads=1,
                 extra_tags={BUFFER: 1}),
        ),
        processes=True,
    )
