"""gymnasium adapter: FrozenLake (and other discrete-action envs with an ansi renderer).

``GymTextEnv`` makes ``gymnasium.make(env_id, render_mode="ansi")``, renders each state
as text and maps the model's first word onto a ``Discrete`` action by name. A word that
names no action costs the turn and ``INVALID_PENALTY`` (the library env does not move).
The library's rewards are the per-step rewards; ``terminated`` with a positive reward is
a success. ``FrozenLakeEnv`` is the ready-made one: a random map per seed
(``generate_random_map(size, p, seed=seed)``), not slippery by default, rendered as
``frozenlake : P F F / F H F / F F G . act :`` (``P`` = the player, rows split by ``/``).
Consumed by the env manager through ``frozenlake_task()``; needs ``gymnasium``.
"""

from __future__ import annotations

import random
import re
from functools import partial

from rollart.env.adapters.base import INVALID_PENALTY, AdapterEnv, make_task

FROZENLAKE_ACTIONS = ("left", "down", "right", "up")  # gymnasium's action indices 0..3
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HIGHLIGHT = re.compile(r"\x1b\[41m(.)\x1b\[0m")


def ansi_grid(text: str, player: str = "P") -> list[list[str]]:
    """Rows of cells of a gymnasium ansi grid render; the highlighted cell becomes
    ``player`` and the ``  (Action)`` header line is dropped.

    >>> ansi_grid("  (Right)\\nS\\x1b[41mF\\x1b[0mF\\nFHG\\n")
    [['S', 'P', 'F'], ['F', 'H', 'G']]
    """
    text = _ANSI.sub("", _HIGHLIGHT.sub(player, text))
    rows = [r for r in text.splitlines() if r.strip() and not r.lstrip().startswith("(")]
    return [list(r.strip()) for r in rows]


class GymTextEnv(AdapterEnv):
    """A gymnasium env with ``Discrete`` actions named by ``action_words`` (by index)."""

    def __init__(self, env_id: str, action_words: tuple[str, ...], *, name: str = "gym",
                 max_turns: int = 8, make_kwargs: dict | None = None) -> None:
        super().__init__(max_turns)
        self.env_id, self.action_words, self.name = env_id, tuple(action_words), name
        self.make_kwargs = dict(make_kwargs or {})

    def _make(self, seed: int):
        import gymnasium

        return gymnasium.make(self.env_id, render_mode="ansi", **self.make_kwargs)

    def _text(self) -> str:
        rows = ansi_grid(self._env.render())
        cells = " / ".join(" ".join(r) for r in rows)
        return f"{self.name} : {cells} . act :"

    def _reset(self, seed: int) -> str:
        self._env = self._make(seed)
        self._env.reset(seed=seed)
        self._env.action_space.seed(seed)
        return self._text()

    def _step(self, action: str):
        words = action.strip().lower().split()
        word = words[0] if words else ""
        if word not in self.action_words:
            return (f"invalid . {self._text()}", -INVALID_PENALTY, False,
                    {"invalid": True})
        _, reward, terminated, truncated, info = self._env.step(self.action_words.index(word))
        done = bool(terminated or truncated)
        success = bool(terminated and reward > 0)
        if success:
            obs = f"{self.name} : success ."
        elif done:
            obs = f"{self.name} : failure ."
        else:
            obs = self._text()
        return obs, float(reward), done, {"success": success, "library_info": dict(info)}


class FrozenLakeEnv(GymTextEnv):
    """gymnasium's FrozenLake on a random ``size`` × ``size`` map chosen by the seed."""

    def __init__(self, size: int = 3, frozen_p: float = 0.8, is_slippery: bool = False,
                 max_turns: int = 6) -> None:
        super().__init__("FrozenLake-v1", FROZENLAKE_ACTIONS, name="frozenlake",
                         max_turns=max_turns, make_kwargs={"is_slippery": is_slippery})
        self.size, self.frozen_p = size, frozen_p

    def _make(self, seed: int):
        import gymnasium
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        desc = generate_random_map(size=self.size, p=self.frozen_p, seed=seed)
        return gymnasium.make(self.env_id, render_mode="ansi", desc=desc, **self.make_kwargs)


def frozenlake_warmup_action(rng: random.Random, observation: str) -> str:
    """A uniformly random valid FrozenLake action."""
    return rng.choice(FROZENLAKE_ACTIONS)


def frozenlake_task(name: str = "frozenlake", size: int = 3, max_turns: int = 6,
                    is_slippery: bool = False, top_p: float | None = None):
    """FrozenLake as a rollart task (reward: the env's return, minus invalid moves)."""
    factory = partial(FrozenLakeEnv, size=size, is_slippery=is_slippery, max_turns=max_turns)
    return make_task(name, factory, max_turns=max_turns,
                     warmup_action=frozenlake_warmup_action, max_new_tokens=3,
                     extra_words=("S", "F", "H", "G", "P", "/", "act", "frozenlake",
                                  *FROZENLAKE_ACTIONS),
                     description=f"gymnasium FrozenLake {size}x{size}: walk to G, avoid H",
                     top_p=top_p)
