"""Built-in task ``boxpush``: push a box onto a target in a 1-D corridor (one file:
data + env + reward).

The corridor has 7 cells with walls at both ends. The target is always on the far side
of the box from the agent, on a random side (left or right). Observations are relative
to the agent: ``boxpush : box 2 right . target 4 right . act :``, so the good action is
a copy of the direction word. Actions: ``left right``; walking into the box pushes it
when the cell beyond is free (otherwise nothing moves); walking into a wall wastes the
turn. Success (env reward 1) when the box lands on the target. Puzzles need 2..4 moves
and ``MAX_TURNS = 6``, so a uniformly random walker succeeds ~25% of the time and a
direction-copying policy always does. Used by ``rollart.env.tasks``.
"""

from __future__ import annotations

import random

from rollart.env.builtin.base import TextGame
from rollart.reward.functions import success_with_invalid_penalty

NAME = "boxpush"
LENGTH = 7
MAX_TURNS = 6
ACTIONS = ("left", "right")
DESCRIPTION = "push the box onto the target in a corridor; the observation says where"
reward_fn = success_with_invalid_penalty
# (agent->box gap, box->target gap) pairs: 2..4 moves to solve.
_LAYOUTS = [(b, t) for b in range(1, 4) for t in range(1, 4) if 3 <= b + t <= 5]


def vocabulary() -> list[str]:
    """Every word an observation can contain plus every valid action."""
    words = [NAME, ":", ".", "box", "target", "act", "invalid", "success", "out", "of"]
    return words + ["turns", *ACTIONS] + [str(d) for d in range(10)]


def warmup_action(rng: random.Random, observation: str) -> str:
    """A uniformly random valid action (ignores the observation)."""
    return rng.choice(ACTIONS)


class BoxPushEnv(TextGame):
    """Sokoban in one dimension: cells ``0..LENGTH-1``, ``right`` = +1."""

    name, actions = NAME, ACTIONS

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        super().__init__(max_turns)
        self._agent = self._box = self._target = 0

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        gap_box, gap_target = rng.choice(_LAYOUTS)
        agent = rng.randint(0, LENGTH - 1 - gap_box - gap_target)
        cells = [agent, agent + gap_box, agent + gap_box + gap_target]
        if rng.random() < 0.5:  # mirror: the puzzle points left
            cells = [LENGTH - 1 - c for c in cells]
        self._agent, self._box, self._target = cells
        self._start()
        return self._text()

    @staticmethod
    def _rel(what: str, delta: int) -> str:
        return f"{what} {abs(delta)} {'right' if delta > 0 else 'left'} ."

    def _text(self) -> str:
        box = self._rel("box", self._box - self._agent)
        target = self._rel("target", self._target - self._agent)
        return f"{NAME} : {box} {target} act :"

    def _move(self, delta: int) -> None:
        nxt = self._agent + delta
        if not 0 <= nxt < LENGTH:
            return
        if nxt == self._box:
            beyond = nxt + delta
            if not 0 <= beyond < LENGTH:
                return
            self._box = beyond
        self._agent = nxt

    def _apply(self, action: str) -> bool:
        self._move(1 if action == "right" else -1)
        return self._box == self._target
