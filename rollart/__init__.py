"""rollart: disaggregated multi-task agentic RL training as a Dask dataflow.

>>> # import rollart
>>> # result = rollart.train()          # the default multi-task graph on a local cluster
"""

from rollart._lazy import lazy_exports

# Names are imported on first use (PEP 562), so ``import rollart.types`` or an env
# worker's ``rollart.env`` does not pay for torch and transformers (~5 s of CPU a
# process); ``from rollart import train`` works as before.
_EXPORTS = {
    "rollart.policy.affinity": ("Affinity", "AffinityError", "env_affinity", "reward_affinity",
                         "task_affinity"),
    "rollart.app.api": ("Run", "start_run"),
    "rollart.app.cli": ("quiet",),
    "rollart.control.loop": ("RunResult", "train"),
    "rollart.agents.agent": ("AgentEndpoint", "AgentTask"),
    "rollart.chaos.faults": ("Faults", "Latency", "straggler_profile", "with_faults"),
    "rollart.env.tasks": ("BUILTIN_TASKS", "Task", "get_task"),
    "rollart.config.graph": ("GRPO", "Graph", "GraphError", "LoRA", "Policy", "Rollout",
                             "TrainerParallel", "load_graph"),
    "rollart.runtime.resources": ("Pool", "Resources", "ResourcesError", "ResourceTagError",
                          "load_resources"),
    "rollart.reward.offload": ("http_reward", "serverless"),
    "rollart.types": ("CPU_ENV", "H20", "H800", "REWARD", "TRAIN", "Episode", "StepResult",
                      "Trajectory"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


__getattr__ = lazy_exports(globals(), _WHERE)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__version__ = "0.1.0"

__all__ = [
    "Affinity",
    "AffinityError",
    "AgentEndpoint",
    "AgentTask",
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
    "LoRA",
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
    "TrainerParallel",
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
