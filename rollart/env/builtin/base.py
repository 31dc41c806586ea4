"""Turn bookkeeping shared by the built-in text games.

A game subclasses ``TextGame`` and supplies its words (``name``, ``actions``), ``reset``
(which calls ``_start``), ``_text`` (the observation) and ``_apply`` (one valid action →
solved?). ``step`` does the rest the same way for every game: only the first word of the
model's text counts; an invalid word costs the turn and 0.1 reward and is announced with
``invalid .``; the episode ends on success (reward 1) or after ``max_turns``.
"""

from __future__ import annotations

import abc

from rollart.types import StepResult


class TextGame(abc.ABC):
    name: str = ""
    actions: tuple[str, ...] = ()

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        self._turn = 0
        self._num_invalid = 0
        self._done = True

    @abc.abstractmethod
    def reset(self, seed: int) -> str:
        """Set up the episode for ``seed`` (call ``_start``) and return ``_text()``."""

    @abc.abstractmethod
    def _text(self) -> str:
        """The current observation."""

    @abc.abstractmethod
    def _apply(self, action: str) -> bool:
        """Play one valid action; return whether the game is now won."""

    def _start(self) -> None:
        self._turn, self._num_invalid, self._done = 0, 0, False

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("episode is over; call reset(seed) to start a new one")
        self._turn += 1
        words = str(action).strip().lower().split()
        word = words[0] if words else ""
        invalid = word not in self.actions
        success = False
        if invalid:
            self._num_invalid += 1
        else:
            success = self._apply(word)
        truncated = not success and self._turn >= self.max_turns
        self._done = success or truncated
        if success:
            obs = f"{self.name} : success ."
        elif truncated:
            obs = f"{self.name} : out of turns ."
        else:
            obs = self._text()
        reward = (1.0 if success else 0.0) - (0.1 if invalid else 0.0)
        info = {"success": success, "invalid": invalid, "turn": self._turn,
                "truncated": truncated, "num_invalid": self._num_invalid}
        return StepResult(("invalid . " if invalid else "") + obs, reward, self._done, info)

    def close(self) -> None:
        self._done = True
