"""Built-in task ``gridnav``: walk to a goal on a 5x5 grid (data + env + reward, one file).

Each observation gives the goal relative to the agent, e.g.
``gridnav : goal 2 right 1 up . act :`` (zero parts omitted), so a good action is a copy
of one direction word. Actions: ``up down left right``; walking off the grid wastes the
turn. Success (env reward 1) on reaching the goal; at most ``MAX_TURNS`` turns. Start and
goal are at Manhattan distance 2..3, so a uniformly random walker succeeds ~20% of the
time (farther goals push it below 15%) and a direction-copying policy always does.
Used by ``rollart.env.tasks``."""

from __future__ import annotations

import random

from rollart.env.builtin.base import TextGame
from rollart.reward.functions import success_with_invalid_penalty

NAME = "gridnav"
SIZE = 5
MAX_TURNS = 8
MIN_DIST, MAX_DIST = 2, 3  # Manhattan distance start -> goal
ACTIONS = ("up", "down", "left", "right")
MOVES = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}
DESCRIPTION = "walk to the goal on a 5x5 grid; the observation says where the goal is"
reward_fn = success_with_invalid_penalty


def vocabulary() -> list[str]:
    """Every word an observation can contain plus every valid action."""
    words = [NAME, ":", ".", "goal", "act", "invalid", "success", "out", "of", "turns"]
    return words + list(ACTIONS) + [str(d) for d in range(10)]


def warmup_action(rng: random.Random, observation: str) -> str:
    """A uniformly random valid action (ignores the observation)."""
    return rng.choice(ACTIONS)


class GridNavEnv(TextGame):
    """5x5 grid navigation; ``(x, y)`` with ``up`` = +y and ``right`` = +x."""

    name, actions = NAME, ACTIONS

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        super().__init__(max_turns)
        self._pos = self._goal = (0, 0)

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        cells = [(x, y) for x in range(SIZE) for y in range(SIZE)]
        self._pos = rng.choice(cells)
        x, y = self._pos
        ok = [c for c in cells if MIN_DIST <= abs(c[0] - x) + abs(c[1] - y) <= MAX_DIST]
        self._goal = rng.choice(ok)
        self._start()
        return self._text()

    def _text(self) -> str:
        dx, dy = self._goal[0] - self._pos[0], self._goal[1] - self._pos[1]
        parts = []
        if dx:
            parts += [str(abs(dx)), "right" if dx > 0 else "left"]
        if dy:
            parts += [str(abs(dy)), "up" if dy > 0 else "down"]
        return " ".join([NAME, ":", "goal", *parts, ".", "act", ":"])

    def _apply(self, action: str) -> bool:
        x, y = self._pos[0] + MOVES[action][0], self._pos[1] + MOVES[action][1]
        if 0 <= x < SIZE and 0 <= y < SIZE:  # off the grid: the turn is wasted
            self._pos = (x, y)
        return self._pos == self._goal
