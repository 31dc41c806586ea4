"""Scripted policies for the built-in tasks: the context every success figure needs.

Consumes a task (``rollart.env.tasks.get_task`` name or ``Task``) and episode seeds;
produces success rates of three scripted players per task, on the same held-out seeds
``rollart.observe.evaluate`` uses (``heldout_seeds``: ``rollart.types.EVAL_SEED_BASE`` on):

* ``random`` — a uniformly random valid action (the format warm-up's own policy:
  ``Task.warmup_action``), whatever the observation says;
* ``heuristic`` — one fixed rule a player would try first (``HEURISTICS``): in
  ``gridnav`` and ``boxpush`` "copy the first direction word" (already optimal there: the
  observation names the move), in ``guess`` "any number still listed as left" (picked
  at random), in ``calc`` "answer the sum of the two numbers";
* ``optimal`` — the best play: a breadth-first search over copies of the env itself
  (``gridnav``, ``boxpush``: the shortest plan under the env's own ``step``), bisection
  over the candidates the observation lists (``guess``), the sandboxed tool's result
  (``calc``: call ``python`` with the question, answer what it prints).

A policy is a plain object: ``start(env, seed)`` once per episode (the env after its
``reset``), then ``act(observation) -> action text`` per turn. ``success_rate(task,
policy, seeds)`` plays them; ``baselines(...)`` gives the whole table. Used by
``benchmarks/baselines.py`` and ``tests/env/test_scripted.py``.

>>> round(success_rate("guess", Optimal(), range(9)), 2)
1.0
"""

from __future__ import annotations

import copy
import random
import re
from collections import deque

from rollart.env.tasks import Task, get_task

POLICIES = ("random", "heuristic", "optimal")
TASKS = ("gridnav", "guess", "boxpush", "calc")
DIRECTIONS = ("up", "down", "left", "right")


def heldout_seeds(n: int) -> range:
    """The held-out seeds ``rollart train`` evaluates on (``EVAL_SEED_BASE`` ...)."""
    from rollart.types import EVAL_SEED_BASE

    return range(EVAL_SEED_BASE, EVAL_SEED_BASE + n)


def _words(observation: str) -> list[str]:
    return observation.lower().split()


# -- random -------------------------------------------------------------------------------
class RandomValid:
    """A uniformly random valid action: the task's ``warmup_action`` (what the format
    warm-up imitates), seeded per episode so a figure repeats exactly."""

    name = "random"

    def __init__(self, task: Task, sample_seed: int = 0) -> None:
        if task.warmup_action is None:
            raise ValueError(f"task {task.name!r} has no warmup_action: give one, or leave "
                             "the random policy out for it")
        self.task, self.sample_seed, self.rng = task, sample_seed, random.Random()

    def start(self, env, seed: int) -> None:
        self.rng = random.Random(f"{self.sample_seed}/{seed}")

    def act(self, observation: str) -> str:
        return self.task.warmup_action(self.rng, observation)


# -- heuristics ---------------------------------------------------------------------------
def first_direction(rng: random.Random, observation: str) -> str:
    """The first direction word the observation names (gridnav's goal, boxpush's box).

    >>> first_direction(random.Random(0), "gridnav : goal 2 right 1 up . act :")
    'right'
    """
    return next((w for w in _words(observation) if w in DIRECTIONS), "up")


def any_left(rng: random.Random, observation: str) -> str:
    """guess: a number still consistent with the feedback (the ``left`` list), at random.

    >>> any_left(random.Random(0), "guess : higher . left 6 8 9 7 . act :") in "6789"
    True
    """
    return str(rng.choice(_left(observation) or list(range(1, 10))))


def sum_of_question(rng: random.Random, observation: str) -> str:
    """calc: answer ``a + b`` whatever the operator is (right when it is ``+``).

    >>> sum_of_question(random.Random(0), "calc : what is 7 * 8 ? use python or answer . act :")
    'answer 15'
    """
    nums = [int(n) for n in re.findall(r"-?\d+", observation)]
    return f"answer {sum(nums[:2])}" if len(nums) >= 2 else "answer 0"


HEURISTICS = {"gridnav": first_direction, "boxpush": first_direction,
              "guess": any_left, "calc": sum_of_question}


class Heuristic:
    """One fixed rule ``(rng, observation) -> action`` (``HEURISTICS[task]``), its
    random choices seeded per episode."""

    name = "heuristic"

    def __init__(self, task: Task, sample_seed: int = 0) -> None:
        if task.name not in HEURISTICS:
            raise ValueError(f"no heuristic for task {task.name!r}; known: "
                             f"{', '.join(sorted(HEURISTICS))}")
        self.rule, self.sample_seed, self.rng = HEURISTICS[task.name], sample_seed, None

    def start(self, env, seed: int) -> None:
        self.rng = random.Random(f"{self.sample_seed}/{seed}")

    def act(self, observation: str) -> str:
        return self.rule(self.rng, observation)


# -- optimal ------------------------------------------------------------------------------
def _left(observation: str) -> list[int]:
    words = _words(observation)
    if "left" not in words:
        return []
    out = []
    for w in words[words.index("left") + 1:]:
        if not w.isdigit():
            break
        out.append(int(w))
    return out


def bisect(observation: str) -> str:
    """guess: the middle of the candidates left (sorted), as binary search picks.

    >>> bisect("guess : pick 1 to 9 . left 1 2 3 4 6 7 8 9 5 . act :")
    '5'
    """
    left = sorted(_left(observation)) or list(range(1, 10))
    return str(left[(len(left) - 1) // 2])


def _state_key(env) -> tuple:
    """What makes two copies of a game the same position (its fields, turn count aside)."""
    skip = {"_turn", "_num_invalid", "_done", "max_turns"}
    return tuple(sorted((k, repr(v)) for k, v in vars(env).items() if k not in skip))


def shortest_plan(env, actions, max_depth: int) -> list[str] | None:
    """Breadth-first search over deep copies of ``env`` (its own ``step`` as the model):
    the shortest action list that wins, or ``None`` within ``max_depth`` moves."""
    frontier = deque([(env, [])])
    seen = {_state_key(env)}
    while frontier:
        node, plan = frontier.popleft()
        if len(plan) >= max_depth:
            continue
        for a in actions:
            child = copy.deepcopy(node)
            step = child.step(a)
            if step.info.get("success"):
                return plan + [a]
            key = _state_key(child)
            if step.done or key in seen:
                continue
            seen.add(key)
            frontier.append((child, plan + [a]))
    return None


class Optimal:
    """The best play: BFS over env copies where the env is a plain game (``gridnav``,
    ``boxpush``), bisection for ``guess`` (it needs no hidden state), the tool's result
    for ``calc``."""

    name = "optimal"

    def __init__(self, task: Task | None = None) -> None:
        self.task_name = task.name if task is not None else "guess"
        self.plan: list[str] = []

    def start(self, env, seed: int) -> None:
        self.plan = []
        if self.task_name in ("gridnav", "boxpush"):
            self.plan = shortest_plan(env, env.actions, env.max_turns) or []

    def act(self, observation: str) -> str:
        if self.task_name == "guess":
            return bisect(observation)
        if self.task_name == "calc":
            words = _words(observation)
            if "what" in words:  # the question: ask the tool
                i = words.index("what")
                return "python " + " ".join(words[i + 2:i + 5])
            nums = re.findall(r"-?\d+", observation)
            return f"answer {nums[0] if nums else 0}"
        return self.plan.pop(0) if self.plan else "up"


def make_policy(name: str, task: Task, sample_seed: int = 0):
    """The scripted policy ``name`` (one of ``POLICIES``) for ``task``."""
    if name == "random":
        return RandomValid(task, sample_seed)
    if name == "heuristic":
        return Heuristic(task, sample_seed)
    if name == "optimal":
        return Optimal(task)
    raise ValueError(f"unknown scripted policy {name!r}; use one of {', '.join(POLICIES)}")


def play(task: Task | str, policy, seed: int) -> bool:
    """One episode of ``task`` from ``seed`` under ``policy``; True on a win."""
    task = get_task(task)
    env = task.env_factory()
    try:
        obs = env.reset(seed)
        policy.start(env, seed)
        for _ in range(task.max_turns):
            step = env.step(policy.act(obs))
            if step.done:
                return bool(step.info.get("success"))
            obs = step.observation
        return False
    finally:
        env.close()


def success_rate(task: Task | str, policy, seeds) -> float:
    """The share of ``seeds`` that ``policy`` wins."""
    seeds = list(seeds)
    return sum(play(task, policy, s) for s in seeds) / max(len(seeds), 1)


def task_for(name: str) -> Task:
    """A built-in game by name, or ``calc`` (the sandboxed-tool task, text tool format)."""
    if name == "calc":
        from rollart.env.adapters.tool import calc_tool_task

        return calc_tool_task()
    return get_task(name)


def baselines(tasks=TASKS, policies=POLICIES, n_seeds: int = 64) -> dict:
    """``{task: {policy: success}}`` on the first ``n_seeds`` held-out seeds."""
    seeds = heldout_seeds(n_seeds)
    out: dict = {}
    for name in tasks:
        task = task_for(name)
        out[name] = {p: success_rate(task, make_policy(p, task), seeds) for p in policies}
    return out
