"""A step's metrics row, from one sample of the actors' figures. Pure.

``step_row`` is the one place a row is put together: the trainer's figures of the step
(``Trainer.train_step``), the ledger's counts (``traj/<state>``), the rollout figures
(``rollout_figures``: ``rollout/…``, ``env/…``, from the stats the inference workers
(``InferenceWorker.stats``) and env managers (``EnvManager.stats``) report), the tokens
generated, wasted and re-scored (``waste_figures``: those stats and the buffer's), each
inference pool's tokens and busy seconds, and what the caller adds (reward pools,
recovery counters), then ``time``. The sample is ``rollart.control.fleet.Sample``
(``Fleet.sample``, read once per step by ``rollart.control.loop``); a test or a simulator
can pass plain dicts.

Every figure is cumulative over the run (a replaced env manager starts again at 0),
but the trained batch's (``reward/…``, ``success/…``, ``trainer/…``: this step's).

Every task of the graph (``tasks``) has its keys in every row (``task_keys``):

* this step's batch: ``reward/<task>`` and ``success/<task>``, the mean over the task's
  trajectories in it, or ``None`` (JSON ``null``; trackers skip it) when it had none;
  ``trainer/rows/<task>``, how many (0 then), and ``trainer/trainable_groups/<task>``,
  its groups with unequal rewards (``rollart.buffer.schema.trainable_groups``), and
  ``entropy/<task>``, the mean −log μ of its generated tokens
  (``rollart.buffer.schema.sampled_entropy``), ``None`` when it had none;
* cumulative, from the buffer's arrivals (``rollart.buffer.arrivals.TASK_COUNTS``),
  like ``traj/<state>``: ``task/received/<task>`` trajectories that reached the buffer,
  ``task/failed/<task>`` failed ones, ``task/truncated/<task>`` truncated ones (context
  or turns ran out), ``task/invalid_tool_calls/<task>`` ones with at least one invalid
  tool call, and ``task/tool_calls/<task>`` tool calls made. A step's own count is
  the difference from the row before;
* cumulative, members lost to infrastructure and the groups they left too small
  (``rollart.buffer.infra.INFRA_COUNTS``): ``task/<count>/<task>`` per task, and
  ``rollout/<count>`` summed over the tasks (``rollout/infra_failed`` adds the members
  orphaned with their worker, whose task the buffer does not know: ``traj/orphaned``).

No key is also the prefix of others (``traj/failed`` and ``traj/failed/<task>``):
MLflow's file store keeps each key as a file path, and a key that is also a folder
made it drop the rest of the row; hence ``trainer/rows/<task>`` and ``task/…``.
"""

from __future__ import annotations

from rollart.buffer.infra import INFRA_COUNTS
from rollart.buffer.ledger import STATES

#: the agent endpoint's counters, summed over the env managers into every row
AGENT_KEYS = ("rollout/agent_calls", "rollout/agent_rewrites", "rollout/agent_dropped_tokens")
#: the buffer's slot figures copied into every row (``rollart.buffer.backpressure``)
SLOT_KEYS = ("slots_held", "slots_held_s", "slots_open_s")


def step_row(trainer: dict, sample, *, elapsed: float, driver_errors: int = 0,
             extra: dict | None = None, tasks=()) -> dict:
    """The metrics row of one trainer step (see the module doc); ``elapsed``: the run's
    time so far (``time``); ``tasks``: the graph's task names."""
    row = dict(trainer)
    row.update({f"traj/{k}": sample.buffer[k] for k in ("launched", *STATES)})
    row.update(task_keys(row, tasks, sample.buffer.get("tasks", {})))
    row.update(infra_keys(tasks, sample.buffer.get("infra", {}),
                          sample.buffer.get("orphaned", 0)))
    row.update(rollout_figures([s for _, _, s in sample.workers], sample.managers,
                               driver_errors))
    # async modes (0 in the others): groups holding a slot now, and the group-seconds
    # held and seconds open since the slots opened (their ratio: the mean in flight)
    row.update({f"rollout/{k}": sample.buffer.get(k, 0) for k in SLOT_KEYS})
    row.update(waste_figures([s for _, _, s in sample.workers], sample.managers,
                             sample.buffer))
    for tag, p in pool_totals(sample.workers).items():
        row[f"rollout/tokens/{tag}"] = p["tokens"]
        row[f"rollout/busy_s/{tag}"] = p["busy_s"]
    row.update(extra or {})
    row["time"] = elapsed
    return row


def task_keys(trainer: dict, tasks, per_task: dict) -> dict:
    """Each task's keys (module doc) from the trainer's figures and the buffer's
    per-task counts; a task missing from either gets ``None`` / 0.

    >>> keys = task_keys({"reward/a": 0.5}, ["a", "b"], {"b": {"received": 4}})
    >>> keys["reward/a"], keys["reward/b"], keys["trainer/rows/b"], keys["task/received/b"]
    (0.5, None, 0, 4)
    """
    out = {}
    for task in sorted(set(tasks) | set(per_task)):
        for key, none in (("reward", None), ("success", None), ("trainer/rows", 0),
                          ("trainer/trainable_groups", 0), ("entropy", None)):
            out[f"{key}/{task}"] = trainer.get(f"{key}/{task}", none)
        c = per_task.get(task, {})
        for k in ("received", "failed", "truncated", "invalid_tool_calls"):
            out[f"task/{k}/{task}"] = c.get(k, 0)
        out[f"task/tool_calls/{task}"] = c.get("tool_calls", 0)
    return out


def infra_keys(tasks, per_task: dict, orphaned: int = 0) -> dict:
    """Members lost to infrastructure and groups too small, per task and in all (module
    doc), from the buffer's ``stats()["infra"]``; a task missing there gets 0.

    >>> keys = infra_keys(["a"], {"b": {"infra_failed": 2, "infra_dropped": 2}}, 1)
    >>> keys["task/infra_failed/a"], keys["rollout/infra_failed"], keys["rollout/infra_dropped"]
    (0, 3, 2)
    """
    out = {f"task/{k}/{t}": per_task.get(t, {}).get(k, 0)
           for t in sorted(set(tasks) | set(per_task)) for k in INFRA_COUNTS}
    out.update({f"rollout/{k}": sum(c.get(k, 0) for c in per_task.values())
                for k in INFRA_COUNTS})
    out["rollout/infra_failed"] += orphaned
    return out


def pool_totals(workers: list[tuple]) -> dict[str, dict]:
    """Per inference pool: tokens generated, busy seconds and workers, from
    ``[(tag, address, stats)]``.

    >>> pool_totals([("H20", "a", {"tokens_generated": 3, "busy_seconds": 1.5}),
    ...              ("H20", "b", {"tokens_generated": 2, "busy_seconds": 0.5})])
    {'H20': {'tokens': 5, 'busy_s': 2.0, 'workers': 2}}
    """
    pools: dict[str, dict] = {}
    for tag, _, s in workers:
        p = pools.setdefault(tag, {"tokens": 0, "busy_s": 0.0, "workers": 0})
        p["tokens"] += s["tokens_generated"]
        p["busy_s"] += s["busy_seconds"]
        p["workers"] += 1
    return pools


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
        # context tokens re-prefilled after swaps (0 with Policy.weight_update="keep")
        # and the engines' time suspended for swaps (+ that re-prefill)
        "rollout/recompute_tokens": total(workers, "recompute_tokens"),
        "rollout/swap_stall_s": total(workers, "stall_seconds"),
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
        # agent tasks (rollart.agents.agent): chat completion calls; requests whose
        # history differed from what the endpoint returned (a new prompt each), and the
        # generated tokens those dropped from training
        **{key: total(managers, key) for key in AGENT_KEYS},
    }


def waste_figures(workers: list[dict], managers: list[dict], buffer: dict) -> dict:
    """Generated tokens never trained on, and tokens kept by re-scoring
    (``Rollout.stale_members``). Wasted are the tokens of members cancelled or aborted
    by their env manager (redundant, stale, shut down), of rows an engine dropped
    mid-generation (their caller went away), of rows that left the buffer ``dropped``
    (stale, late, too small a group), ``failed`` or ``lost_in_step``, and an agent's
    dropped tokens. Not counted: members lost with their worker (orphaned), and what is
    still in flight or buffered. ``rollout/wasted_share`` divides by the engines'
    ``tokens_generated`` (``rollout/generated_tokens``).

    >>> w = waste_figures([{"tokens_generated": 100, "abandoned_tokens": 5}],
    ...                   [{"wasted_tokens": 10, "rescored_tokens": 7}], {"wasted_tokens": 15})
    >>> w["rollout/wasted_tokens"], w["rollout/wasted_share"], w["rollout/rescored_tokens"]
    (30, 0.3, 7)
    """
    generated = sum(s.get("tokens_generated", 0) for s in workers)
    wasted = (sum(s.get("abandoned_tokens", 0) for s in workers)
              + sum(m.get("wasted_tokens", 0) + m.get("rollout/agent_dropped_tokens", 0)
                    for m in managers) + buffer.get("wasted_tokens", 0))
    return {"rollout/generated_tokens": generated, "rollout/wasted_tokens": wasted,
            "rollout/wasted_share": wasted / generated if generated else 0.0,
            "rollout/rescored_tokens": sum(m.get("rescored_tokens", 0) for m in managers),
            "rollout/rescore_failed": sum(m.get("rescore_failed", 0) for m in managers)}


def padding(padded: int, tokens: int) -> float:
    """Padding computed per token forwarded (0 when nothing was forwarded)."""
    return padded / tokens - 1.0 if tokens else 0.0
