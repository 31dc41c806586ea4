"""Built-in task ``guess``: find a secret number in 1..9 (data + env + reward, one file).

First observation: ``guess : pick 1 to 9 . left 1 2 3 4 6 7 8 9 5 . act :``. After a
wrong guess: ``guess : higher . left 6 8 9 7 . act :`` (or ``lower``), where ``left``
lists the numbers still consistent with all feedback so far: ascending, except that the
bisecting choice (the middle candidate) is listed last, the way a careful player would
note "these remain; try this next". Actions: one digit 1..9 (a digit outside ``left`` is
valid but wasted). Success (env reward 1) on the right guess. With ``MAX_TURNS = 4`` a
uniformly random guesser succeeds ~38% of the time, a random pick from ``left`` ~80%, and
bisection always wins (at most 4 guesses for 9 numbers).

Why the list order: the decisive word sits in the same place as in the other built-in
tasks (four words from the end), so the built-in ~1M-parameter model can learn the task
from reward within minutes on two CPU cores; the dynamics (feedback, shrinking candidate
set) are the game's own. Used by ``rollart.env.tasks``.
"""

from __future__ import annotations

import random

from rollart.env.builtin.base import TextGame
from rollart.reward.functions import success_with_invalid_penalty

NAME = "guess"
MAX_TURNS = 4
ACTIONS = tuple(str(d) for d in range(1, 10))
DESCRIPTION = "guess a secret number in 1..9; feedback says higher or lower"
reward_fn = success_with_invalid_penalty


def vocabulary() -> list[str]:
    """Every word an observation can contain plus every valid action."""
    words = [NAME, ":", ".", "pick", "to", "left", "act", "higher", "lower", "invalid"]
    words += ["success", "out", "of", "turns"]
    return words + [str(d) for d in range(10)]


def warmup_action(rng: random.Random, observation: str) -> str:
    """A uniformly random valid action: any digit 1..9 (ignores the observation)."""
    return rng.choice(ACTIONS)


class GuessEnv(TextGame):
    """Guess the number with higher/lower feedback and the consistent candidates listed."""

    name, actions = NAME, ACTIONS

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        super().__init__(max_turns)
        self._secret = 0
        self._left: list[int] = []
        self._feedback = "pick 1 to 9"

    def reset(self, seed: int) -> str:
        self._secret = random.Random(seed).randint(1, 9)
        self._left = list(range(1, 10))
        self._feedback = "pick 1 to 9"
        self._start()
        return self._text()

    def _text(self) -> str:
        pick = self._left[(len(self._left) - 1) // 2]
        left = " ".join(str(n) for n in [*(n for n in self._left if n != pick), pick])
        return f"{NAME} : {self._feedback} . left {left} . act :"

    def _apply(self, action: str) -> bool:
        g = int(action)
        if g == self._secret:
            return True
        self._feedback = "higher" if self._secret > g else "lower"
        self._left = [n for n in self._left if (n > g if self._secret > g else n < g)]
        return False
