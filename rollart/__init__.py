"""rollart: disaggregated multi-task agentic RL training as a Dask dataflow.

>>> # import rollart
>>> # result = rollart.train()          # the default multi-task graph on a local cluster
"""

from rollart.affinity import (Affinity, AffinityError, env_affinity, reward_affinity,
                              task_affinity)
from rollart.api import Run, start_run
from rollart.cli import quiet
from rollart.control import RunResult, train
from rollart.env.faults import Faults, Latency, straggler_profile, with_faults
from rollart.env.tasks import BUILTIN_TASKS, Task, get_task
from rollart.graph import GRPO, Graph, GraphError, Policy, Rollout, load_graph
from rollart.resources import Pool, Resources, ResourcesError, ResourceTagError, load_resources
from rollart.reward.offload import http_reward, serverless
from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN, Episode, StepResult, Trajectory

__version__ = "0.1.0"

__all__ = [
    "Affinity",
    "AffinityError",
    "BUILTIN_TASKS",
    "CPU_ENV",
    "Episode",
    "Faults",
    "GRPO",
    "Graph",
    "GraphError",
    "H20",
    "H800",
    "Latency",
    "Policy",
    "Pool",
    "REWARD",
    "ResourceTagError",
    "Resources",
    "ResourcesError",
    "Rollout",
    "Run",
    "RunResult",
    "StepResult",
    "TRAIN",
    "Task",
    "Trajectory",
    "env_affinity",
    "get_task",
    "http_reward",
    "load_graph",
    "load_resources",
    "quiet",
    "reward_affinity",
    "serverless",
    "start_run",
    "straggler_profile",
    "task_affinity",
    "train",
    "with_faults",
]
