"""Built-in tasks, one self-contained module each (data + env + reward).

Every module exposes ``NAME``, an env class, ``MAX_TURNS``, ``DESCRIPTION``,
``reward_fn``, ``warmup_action(rng, observation)`` and ``vocabulary()``;
``rollart.env.tasks`` turns them into ``Task`` records. The turn bookkeeping they share
(parsing, invalid actions, ending) is ``base.TextGame``.
"""

from rollart.env.builtin.boxpush import BoxPushEnv
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.builtin.guess import GuessEnv

__all__ = ["BoxPushEnv", "GridNavEnv", "GuessEnv"]
