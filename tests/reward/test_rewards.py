"""Reward functions over text episodes (rollart.reward)."""

from __future__ import annotations

import doctest
import math
import pickle

import pytest

import rollart.reward.functions as functions
from rollart.env import BUILTIN_TASKS
from rollart.reward import (
    RewardError,
    check_reward,
    count_invalid,
    env_return,
    success_reward,
    success_with_invalid_penalty,
)
from rollart.types import Episode

REWARD_FNS = [success_reward, env_return, success_with_invalid_penalty, count_invalid]


def play(task_name: str, seed: int, actions: list[str]) -> Episode:
    """Run ``actions`` (until done) and record the Episode a rollout would produce."""
    env = BUILTIN_TASKS[task_name].env_factory()
    obs, rewards, info = [env.reset(seed)], [], {}
    for act in actions:
        res = env.step(act)
        obs.append(res.observation)
        rewards.append(res.reward)
        info = res.info
        if res.done:
            break
    return Episode(task_name, seed, obs, actions[: len(rewards)], rewards, info,
                   truncated=bool(info.get("truncated")))


def test_doctests():
    result = doctest.testmod(functions)
    assert result.attempted >= 5 and result.failed == 0


def _solve_guess(extra_invalid: int) -> Episode:
    """A guess episode with ``extra_invalid`` bad actions, then the right guess."""
    env = BUILTIN_TASKS["guess"].env_factory()
    env.reset(0)
    secret = env._secret
    return play("guess", 0, ["?"] * extra_invalid + [str(secret)])


def test_success_with_invalid_penalty_on_real_episode():
    ep = _solve_guess(extra_invalid=2)
    assert ep.info["success"] and count_invalid(ep) == 2
    assert success_with_invalid_penalty(ep) == pytest.approx(0.8)
    assert env_return(ep) == pytest.approx(0.8)
    assert success_reward(ep) == 1.0
    # without the info counter the observation text gives the same count
    ep.info = {"success": True}
    assert count_invalid(ep) == 2


def test_failed_episode():
    ep = play("gridnav", 4, ["bogus"] * 8)
    assert ep.truncated and not ep.info["success"]
    assert success_reward(ep) == 0.0
    assert success_with_invalid_penalty(ep) == pytest.approx(-0.8)


def test_builtin_tasks_use_penalised_success():
    for task in BUILTIN_TASKS.values():
        assert task.reward_fn is success_with_invalid_penalty


def test_check_reward():
    assert check_reward(1, "f") == 1.0 and isinstance(check_reward(1, "f"), float)
    for bad, msg in [(None, "returned NoneType"), ("1", "returned str"),
                     (True, "returned bool"), (math.inf, "returned inf"),
                     (math.nan, "returned nan")]:
        with pytest.raises(RewardError, match=f"reward function my_fn {msg}"):
            check_reward(bad, "my_fn")
    assert issubclass(RewardError, RuntimeError)


def test_reward_functions_pickle():
    ep = _solve_guess(extra_invalid=1)
    for fn in REWARD_FNS:
        back = pickle.loads(pickle.dumps(fn))
        assert back is fn and back(ep) == fn(ep)
