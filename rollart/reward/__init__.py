"""Reward functions over text ``Episode`` records (see ``rollart.reward.functions``).

Consumed by tasks (``rollart.env.tasks.Task.reward_fn``) and the reward stage, which
wraps every call in ``check_reward``. ``@serverless`` marks a reward to run on an
elastic, scale-to-zero Dask pool or behind an HTTP function endpoint
(``rollart.reward.offload``, ``dispatch``, ``elastic``, ``server``); ``LLMJudge`` is
a model-based reward for either.
"""

from rollart.reward.functions import (
    RewardError,
    check_reward,
    count_invalid,
    env_return,
    success_reward,
    success_with_invalid_penalty,
)
from rollart.reward.judge import LLMJudge
from rollart.reward.server import FunctionServer
from rollart.reward.offload import (
    SERVERLESS,
    RewardFailed,
    ServerlessConfig,
    ServerlessReward,
    http_reward,
    is_serverless,
    serverless,
)

__all__ = [
    "FunctionServer",
    "LLMJudge",
    "RewardError",
    "RewardFailed",
    "SERVERLESS",
    "ServerlessConfig",
    "ServerlessReward",
    "check_reward",
    "count_invalid",
    "env_return",
    "http_reward",
    "is_serverless",
    "serverless",
    "success_reward",
    "success_with_invalid_penalty",
]
