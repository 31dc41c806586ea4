"""The audit of ``benchmarks/chaos.py``, apart from its run: ``lost`` and ``duplicated``
counted without the ledger or the journal, from the envs' own record (``RecordedEnv``'s
``env-*.jsonl``), the run's Parquet rows, the trainer's report of each step's batch
(its ``trainer/batch_size`` and ``trainer/batch_sha1``) and the run's group sequence,
replayed from its ``graph.json`` (task, seed, group size: which groups were drawn, in
order); ``chaos.py``'s docstring says what each figure means. ``chaos.py`` imports
these, and its tests through it.

Per (task, seed) group: a group trained, taken or buffered holds all its members, so it
must have at least ``size`` rows; env-finished episodes beyond its rows are excused only
by members beyond its size (redundant members, aborted and restarted ones, those lost
with a worker and restarted: each started an episode of its own), at most ``started -
size`` of them. A group with ``size`` rows otherwise (all failed, or dropped complete)
is held to the second rule only; one with fewer rows and none trained, taken or buffered
was still running at the end or dropped unfinished (``open_at_end``, reported). Every
episode of a (task, seed) the sequence never drew is lost. Rows of any outcome count: a
``truncated`` or ``failed`` row may follow an env that said done (the turn limit, a
reward that failed). What fails these rules is ``lost_completed``.
"""

from __future__ import annotations

from pathlib import Path


def read_env_log(log_dir: Path) -> list[dict]:
    """Every line the ``RecordedEnv``s wrote (a killed process's last line may be cut)."""
    import json

    out = []
    for path in sorted(log_dir.glob("env-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by SIGKILL
    return out


def digest_of(ids) -> str:
    """``rollart.trainer.trainer.batch_digest``, recomputed here from the rows."""
    import hashlib

    return hashlib.sha1("\n".join(sorted(ids)).encode()).hexdigest()[:16]


def reported_subset(ids: list[str], size: int, digest: str) -> list[str] | None:
    """The ``size`` ids among ``ids`` whose digest is the trainer's, if any: whole GRPO
    groups first (ids ``{group}-{k}``), then any combination while there are few."""
    import itertools
    import math
    from collections import defaultdict

    groups = defaultdict(list)
    for t in ids:
        groups[t.rsplit("-", 1)[0]].append(t)
    members = list(groups.values())
    for r in range(1, len(members) + 1):
        for pick in itertools.combinations(members, r):
            chosen = [t for g in pick for t in g]
            if len(chosen) == size and digest_of(chosen) == digest:
                return chosen
    if math.comb(len(ids), size) <= 200_000:
        return next((list(c) for c in itertools.combinations(sorted(ids), size)
                     if digest_of(c) == digest), None)
    return None


def check_trainer_record(trained_at: dict, metrics: list[dict]) -> tuple[int, int, int]:
    """The trainer's report of each step against the rows ``trained`` there: returns
    ``(lost_trained, trained_unreported, mismatched_steps)`` (module docstring)."""
    lost_trained = unreported = mismatched = 0
    for m in metrics:
        got, size = trained_at.get(m["step"], []), m["trainer/batch_size"]
        if digest_of(got) == m["trainer/batch_sha1"]:
            continue
        mismatched += 1
        if len(got) > size and reported_subset(got, size, m["trainer/batch_sha1"]):
            unreported += len(got) - size  # trained at this step by a lost trainer step
        elif len(got) >= size:  # the trainer's batch is not among them: none vouched for
            lost_trained += size
        else:
            lost_trained += size - len(got)
    unreported += sum(len(v) for k, v in trained_at.items()
                      if k not in {m["step"] for m in metrics})
    return lost_trained, unreported, mismatched


def drawn_groups(run_dir: Path, n: int) -> tuple[int, set]:
    """The group size and the ``(task, seed)`` of the first ``n`` groups the run's
    sequence draws (``rollart.policy.admission.GroupSequence``, from ``graph.json``)."""
    import json

    from rollart.policy.admission import GroupSequence

    g = json.loads((Path(run_dir) / "graph.json").read_text())
    names = [t if isinstance(t, str) else t["name"] for t in g["tasks"]]
    size = int(g["algo"]["group_size"])
    seq = GroupSequence(names, g.get("task_weights"), int(g["seed"]), size)
    return size, {seq.next()[:2] for _ in range(n)}


def audit(run_dir: Path, metrics: list[dict], env_events: list[dict]) -> dict:
    """``lost`` and ``duplicated`` from the env record, the rows and the trainer's
    report (module docstring), without the ledger's totals."""
    from collections import Counter, defaultdict

    from rollart.buffer import read_samples
    from rollart.buffer.schema import read_parts

    rows = read_samples(str(run_dir)).to_pydict()
    trained_at = defaultdict(list)  # step -> ids trained there (rows)
    rowed, whole = Counter(), set()  # per (task, seed)
    left, last_group = 0, -1
    for t, task, g, seed, state, step, outcome in zip(
            rows["traj_id"], rows["task"], rows["group_id"], rows["seed"], rows["state"],
            rows["trained_step"], rows["outcome"]):
        key = (task, seed)
        last_group = max(last_group, int(g[1:]) if g[1:].isdigit() else -1)
        rowed[key] += 1
        if state == "trained":
            trained_at[step].append(t)
        if state in ("trained", "taken", "buffered"):
            whole.add(key)  # taken whole, or waiting whole: every member arrived
        if state in ("buffered", "taken"):  # durable, still in the buffer: not lost
            left += 1
    lost_trained, unreported, mismatched = check_trainer_record(trained_at, metrics)
    ended = Counter((e["task"], e["seed"]) for e in env_events if e["ev"] == "end")
    started = Counter((e["task"], e["seed"]) for e in env_events if e["ev"] == "start")
    size, drawn = drawn_groups(run_dir, last_group + 1 + 1000)
    lost_completed = excused = open_at_end = 0
    for key in set(ended) | whole:
        unrowed = max(ended[key] - rowed[key], 0)
        extras = max(started[key] - size, 0)
        if key not in drawn:  # no group of this (task, seed) was ever drawn
            lost_completed += ended[key]
        elif key in whole or rowed[key] >= size:
            short = max(size - rowed[key], 0) if key in whole else 0
            lost_completed += max(short, unrowed - extras)
            excused += min(unrowed, extras)
        else:
            open_at_end += unrowed
    parts = read_parts(str(run_dir)).to_pydict()
    steps_of = defaultdict(set)
    for t, state, step in zip(parts["traj_id"], parts["state"], parts["trained_step"]):
        if state == "trained":
            steps_of[t].add(step)
    twice = sum(len(v) > 1 for v in steps_of.values())
    reported = sum(m["trainer/batch_size"] for m in metrics)
    distinct = len({t for ids in trained_at.values() for t in ids})
    excess = max(reported - (distinct - unreported) - lost_trained, 0)
    return {"lost": lost_trained + lost_completed,
            "duplicated": twice + excess, "lost_trained": lost_trained,
            "trained_unreported": unreported, "lost_completed": lost_completed,
            "left_buffered": left,
            "mismatched_steps": mismatched, "env_episodes": sum(
                e["ev"] == "start" for e in env_events),
            "env_ended": sum(ended.values()), "excused_extra": excused,
            "open_at_end": open_at_end}
