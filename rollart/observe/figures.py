"""The rollout figures of a step (``rollout/…``, ``env/…`` metrics), from the stats the
inference workers (``InferenceWorker.stats``) and env managers (``EnvManager.stats``)
report. Pure: ``Pipeline.rollout_stats`` gathers the stats over Dask and calls
``rollout_figures``; a test or a simulator can call it with plain dicts.

Every figure is cumulative over the run (a replaced env manager starts again at 0).
"""

from __future__ import annotations


def rollout_figures(workers: list[dict], managers: list[dict], driver_errors: int = 0) -> dict:
    """The ``rollout/…`` and ``env/…`` metrics from each live worker's and manager's
    stats; ``driver_errors`` counts the groups whose ``take_work`` loop raised in the
    driver (the managers count the ones that raised in them)."""
    turns = sum(m["turns"] for m in managers)

    def total(stats: list[dict], key: str) -> float:
        return sum(s.get(key, 0) for s in stats)

    return {
        "rollout/tokens_generated": total(workers, "tokens_generated"),
        "rollout/engine_busy_s": total(workers, "busy_seconds"),
        "rollout/requests": total(workers, "requests"),  # admitted
        "rollout/suspends": total(workers, "suspends"),
        "rollout/turns": turns,
        "rollout/group_errors": driver_errors + total(managers, "group_errors"),
        "rollout/backups": total(managers, "backups"),  # backup_after
        # plain rewards run on the env manager's own worker vs as Dask tasks
        "rollout/rewards_here": total(managers, "rewards_here"),
        "rollout/reward_tasks": total(managers, "reward_tasks"),
        "rollout/turn_overhead_s": sum(m["turn_overhead_s"] * m["turns"] for m in managers)
        / max(turns, 1),
        "env/step_p99_s": max((m["env_step_p99"] for m in managers), default=0.0),
        # share of prompt tokens served from a worker's prefix cache; KV moved for PD
        "rollout/prefix_reuse": total(workers, "prefix_hit_tokens")
        / max(total(workers, "prefix_prompt_tokens"), 1),
        "rollout/kv_bytes_moved": total(workers, "kv_bytes_received"),
        # prefill: padding computed per token forwarded; rows that shared another's
        # forward (a group's equal first prompts)
        "rollout/prefill_padding": padding(total(workers, "prefill_padded"),
                                           total(workers, "prefill_tokens")),
        "rollout/prefill_shared": total(workers, "prefill_shared"),
    }


def padding(padded: int, tokens: int) -> float:
    """Padding computed per token forwarded (0 when nothing was forwarded)."""
    return padded / tokens - 1.0 if tokens else 0.0
