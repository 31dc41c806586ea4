"""TextArena adapter: its single-player games (GuessTheNumber, TowerOfHanoi, FrozenLake,
Minesweeper, Sudoku, …) behind rollart's ``Env`` contract.

``TextArenaEnv(env_id)`` makes ``textarena.make(env_id)`` (use the ``-raw`` ids: no
LLM-side wrappers), resets it for one player with the seed, and turns the messages the
game sends the player into the observation text. The model's text is wrapped in
``[...]`` when it has no brackets (so ``5`` plays ``[5]``). A move the game rejects
(its "invalid move" admin message) costs ``INVALID_PENALTY``; the game's own rules decide
when repeated invalid moves end the episode. At the end the game's reward for player 0
(1 for a win; some games pay partial credit) is the last step's reward; ``success``
is a win (reward 1, no invalid move).

TextArena seeds and draws from the process-global ``random``: every library call runs
under this env's private ``GlobalRNG`` state so threads do not disturb each other. Word
games that need corpora downloads (Wordle, Hangman, …) do not work offline.
"""

from __future__ import annotations

import random
import re
from functools import partial

from rollart.env.adapters.base import (
    INVALID_PENALTY,
    AdapterEnv,
    GlobalRNG,
    make_task,
    wrap_action,
)

_INVALID = re.compile(r"invalid move", re.I)


def _messages_text(messages) -> tuple[str, bool]:
    """The text of TextArena ``(sender, message, type)`` tuples and whether any says the
    move was invalid. Echoes of the player's own action are skipped."""
    parts, invalid = [], False
    for item in messages or []:
        text = str(item[1])
        if len(item) > 2 and getattr(item[2], "name", str(item[2])).endswith("PLAYER_ACTION"):
            continue
        invalid |= bool(_INVALID.search(text))
        parts.append(text.strip())
    return "\n".join(p for p in parts if p), invalid


class TextArenaEnv(AdapterEnv):
    """One TextArena single-player game; ``name`` is the rollart-side name in texts."""

    _live = ("_env",)

    def __init__(self, env_id: str = "GuessTheNumber-v0-raw", *, name: str = "textarena",
                 max_turns: int = 10) -> None:
        super().__init__(max_turns)
        self.env_id, self.name = env_id, name
        self._rng = GlobalRNG()

    def _reset(self, seed: int) -> str:
        import textarena

        self._rng = GlobalRNG()
        with self._rng.active():
            self._env = textarena.make(self.env_id)
            self._env.reset(num_players=1, seed=seed)
            _, messages = self._env.get_observation()
        text, _ = _messages_text(messages)
        return text

    def _step(self, action: str):
        move = wrap_action(action, "[", "[{}]") or "[]"
        with self._rng.active():
            done, _ = self._env.step(move)
            if done:
                rewards, game_info = self._env.close()
                self._env = None
            else:
                _, messages = self._env.get_observation()
        if not done:
            text, invalid = _messages_text(messages)
            return text, (-INVALID_PENALTY if invalid else 0.0), False, {"invalid": invalid}
        reward = float((rewards or {}).get(0, 0.0))
        info0 = dict((game_info or {}).get(0, {}))
        invalid = bool(info0.get("invalid_move", False))
        reason = str(info0.get("reason", "")).strip()
        won = reward >= 1.0 and not invalid  # an invalid-move ending may still pay a bit
        outcome = "success" if won else "failure"
        info = {"success": won, "invalid": invalid, "reason": reason}
        return (f"{self.name} : {outcome} . {reason}".strip(),
                reward - (INVALID_PENALTY if invalid else 0.0), True, info)

    def _close_library(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            with self._rng.active():
                env.close()


def digits_warmup_action(low: int, high: int, rng: random.Random, observation: str) -> str:
    """A uniformly random number in ``low..high`` (a valid guess, not a good one)."""
    return str(rng.randint(low, high))


def guess_the_number_task(name: str = "ta_guess", max_turns: int = 10,
                          top_p: float | None = None):
    """TextArena ``GuessTheNumber-v0-raw`` (1..20 in 10 turns) as a rollart task."""
    factory = partial(TextArenaEnv, "GuessTheNumber-v0-raw", name=name, max_turns=max_turns)
    return make_task(name, factory, max_turns=max_turns,
                     warmup_action=partial(digits_warmup_action, 1, 20), max_new_tokens=3,
                     extra_words=[str(n) for n in range(1, 21)],
                     description="TextArena GuessTheNumber: 1..20 with higher/lower hints",
                     top_p=top_p)


HANOI_MOVES = tuple(f"{a} {b}" for a in "ABC" for b in "ABC" if a != b)


def hanoi_warmup_action(rng: random.Random, observation: str) -> str:
    """A random tower move ``X Y`` (may break the rules; it is well-formed)."""
    return rng.choice(HANOI_MOVES)


def tower_of_hanoi_task(name: str = "ta_hanoi", max_turns: int = 10,
                        top_p: float | None = None):
    """TextArena ``TowerOfHanoi-v0-raw`` (3 disks) as a rollart task."""
    factory = partial(TextArenaEnv, "TowerOfHanoi-v0-raw", name=name, max_turns=max_turns)
    return make_task(name, factory, max_turns=max_turns, warmup_action=hanoi_warmup_action,
                     max_new_tokens=4, extra_words=("A", "B", "C"),
                     description="TextArena TowerOfHanoi with 3 disks", top_p=top_p)
