"""Reward functions: ``Episode`` (text only) -> float.

Consumes a finished ``rollart.types.Episode``; produces one scalar reward. Called by the
reward stage (possibly as a Dask task on another process), so every reward function is a
plain module-level function that pickles by reference. ``check_reward`` is what callers
use to turn a garbage return value into a readable ``RewardError``.
"""

from __future__ import annotations

import math
import numbers

from rollart.types import Episode

INVALID_PENALTY = 0.1  #: subtracted per invalid action by ``success_with_invalid_penalty``


class RewardError(RuntimeError):
    """A reward function returned something that is not a finite real number."""


def success_reward(ep: Episode) -> float:
    """1.0 if the episode's final info says ``success``, else 0.0.

    >>> from rollart.types import Episode
    >>> success_reward(Episode("t", 0, ["o"], [], [], {"success": True}))
    1.0
    >>> success_reward(Episode("t", 0, ["o"], [], [], {}))
    0.0
    """
    return 1.0 if ep.info.get("success") else 0.0


def env_return(ep: Episode) -> float:
    """Sum of the per-step environment rewards.

    >>> from rollart.types import Episode
    >>> env_return(Episode("t", 0, ["o", "o", "o"], ["a", "b"], [-0.1, 1.0], {}))
    0.9
    """
    return float(sum(ep.env_rewards))


def count_invalid(ep: Episode) -> int:
    """Number of invalid actions in ``ep``.

    Uses the env's cumulative ``info["num_invalid"]`` when the final info carries it
    (every built-in env does); otherwise counts observations after the first whose words
    include ``invalid`` (built-in envs prefix ``invalid .`` after a bad action).

    >>> from rollart.types import Episode
    >>> count_invalid(Episode("t", 0, ["go :", "invalid . go :", "go :"], ["x", "up"], [], {}))
    1
    >>> count_invalid(Episode("t", 0, ["go :"], [], [], {"num_invalid": 3}))
    3
    """
    n = ep.info.get("num_invalid")
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    return sum(1 for obs in ep.observations[1:] if "invalid" in obs.split())


def success_with_invalid_penalty(ep: Episode) -> float:
    """Success (1/0) minus 0.1 per invalid action. The reward of every built-in task.

    >>> from rollart.types import Episode
    >>> obs = ["go :", "invalid . go :", "done ."]
    >>> round(success_with_invalid_penalty(Episode("t", 0, obs, ["?", "up"], [-0.1, 1.0],
    ...                                            {"success": True})), 6)
    0.9
    >>> success_with_invalid_penalty(Episode("t", 0, ["go :"], [], [], {"success": False}))
    0.0
    """
    return success_reward(ep) - INVALID_PENALTY * count_invalid(ep)


def check_reward(value: object, fn_name: str) -> float:
    """Return ``value`` as a float, or raise ``RewardError`` naming ``fn_name``.

    >>> check_reward(1, "success_reward")
    1.0
    >>> try:
    ...     check_reward(float("nan"), "my_reward")
    ... except RewardError as e:
    ...     print(e)
    reward function my_reward returned nan; expected a finite real number
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {fn_name} returned {type(value).__name__} ({value!r:.80}); "
            "expected a finite real number (int or float)"
        )
    out = float(value)
    if not math.isfinite(out):
        raise RewardError(
            f"reward function {fn_name} returned {out}; expected a finite real number"
        )
    return out
