"""Reward functions over text ``Episode`` records (see ``rollart.reward.functions``).

Consumed by tasks (``rollart.env.tasks.Task.reward_fn``) and the reward stage, which
wraps every call in ``check_reward``.
"""

from rollart.reward.functions import (
    RewardError,
    check_reward,
    count_invalid,
    env_return,
    success_reward,
    success_with_invalid_penalty,
)

__all__ = [
    "RewardError",
    "check_reward",
    "count_invalid",
    "env_return",
    "success_reward",
    "success_with_invalid_penalty",
]
