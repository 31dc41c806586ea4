"""GEM (``gem-llm``) adapter: its text games (GuessTheNumber, Sokoban, Minesweeper,
Game2048, Mastermind, …) behind rollart's ``Env`` contract.

``GemEnv(env_id)`` makes ``gem.make(env_id)`` and resets it with the seed. GEM's
observation is the game text and ``info["suffix"]`` carries the board and the prompt for
the next move; the adapter shows both. The model's text is wrapped in ``\\boxed{...}``
when it has none (so ``5`` plays ``\\boxed{5}``). GEM's own rewards are the per-step
rewards (its invalid-move penalty and ending included); a step that terminates with
reward ≥ 1 is a success. A GEM reply that marks the move not valid is flagged
``info["invalid"]``.

GEM seeds the process-global ``random`` and ``numpy.random``: every library call runs
under this env's private ``GlobalRNG`` state. Needs ``gem-llm``.
"""

from __future__ import annotations

import random
import re
from functools import partial

from rollart.env.adapters.base import AdapterEnv, GlobalRNG, make_task, wrap_action

_NOT_VALID = re.compile(r"\bnot\b[^.]*\bvalid\b|invalid", re.I)


class GemEnv(AdapterEnv):
    """One GEM game; ``name`` is the rollart-side name used in texts."""

    def __init__(self, env_id: str = "game:GuessTheNumber-v0-easy", *, name: str = "gem",
                 max_turns: int = 8, make_kwargs: dict | None = None) -> None:
        super().__init__(max_turns)
        self.env_id, self.name = env_id, name
        self.make_kwargs = dict(make_kwargs or {})
        self._rng = GlobalRNG()

    @staticmethod
    def _text(obs, info) -> str:
        suffix = (info or {}).get("suffix", "")
        return "\n".join(p for p in (str(obs).strip(), str(suffix).strip()) if p)

    def _reset(self, seed: int) -> str:
        import gem

        self._rng = GlobalRNG()
        with self._rng.active():
            self._env = gem.make(self.env_id, **self.make_kwargs)
            obs, info = self._env.reset(seed=seed)
        return self._text(obs, info)

    def _step(self, action: str):
        move = wrap_action(action, "\\boxed", "\\boxed{{{}}}") or "\\boxed{}"
        with self._rng.active():
            obs, reward, terminated, truncated, info = self._env.step(move)
        done = bool(terminated or truncated)
        invalid = reward < 0 and bool(_NOT_VALID.search(str(obs)))
        success = bool(terminated) and reward >= 1.0
        text = str(obs).strip() if done else self._text(obs, info)
        if done:
            text = f"{text} {self.name} : {'success' if success else 'failure'} ."
        return text, float(reward), done, {"success": success, "invalid": invalid}


def digits_warmup_action(low: int, high: int, rng: random.Random, observation: str) -> str:
    """A uniformly random number in ``low..high``."""
    return str(rng.randint(low, high))


def guess_the_number_task(name: str = "gem_guess", max_turns: int = 4,
                          top_p: float | None = None):
    """GEM ``game:GuessTheNumber-v0-easy`` (1..10 in 4 turns) as a rollart task."""
    factory = partial(GemEnv, "game:GuessTheNumber-v0-easy", name=name, max_turns=max_turns)
    return make_task(name, factory, max_turns=max_turns,
                     warmup_action=partial(digits_warmup_action, 1, 10), max_new_tokens=3,
                     extra_words=[str(n) for n in range(1, 11)],
                     description="GEM GuessTheNumber (easy): 1..10 in 4 turns", top_p=top_p)


SOKOBAN_MOVES = ("up", "down", "left", "right")


def sokoban_warmup_action(rng: random.Random, observation: str) -> str:
    """A uniformly random Sokoban move."""
    return rng.choice(SOKOBAN_MOVES)


def sokoban_task(name: str = "gem_sokoban", max_turns: int = 8, top_p: float | None = None):
    """GEM ``game:Sokoban-v0-easy`` as a rollart task."""
    factory = partial(GemEnv, "game:Sokoban-v0-easy", name=name, max_turns=max_turns)
    return make_task(name, factory, max_turns=max_turns, warmup_action=sokoban_warmup_action,
                     max_new_tokens=3, extra_words=SOKOBAN_MOVES,
                     description="GEM Sokoban (easy)", top_p=top_p, vocab_seeds=range(8))
