"""Environments and tasks: the env contract, the built-in tasks, and task lookup.

Consumed by the rollout stage (env manager), the warm-up and the tokenizer builder.
"""

from rollart.env.protocol import Env, EnvOutputError, check_observation, check_step_result
from rollart.env.tasks import BUILTIN_TASKS, Task, UnknownTaskError, get_task, task_corpus

__all__ = [
    "BUILTIN_TASKS",
    "Env",
    "EnvOutputError",
    "Task",
    "UnknownTaskError",
    "check_observation",
    "check_step_result",
    "get_task",
    "task_corpus",
]
