"""What every library adapter shares: turn bookkeeping, invalid-output handling, pickling.

An adapter wraps one environment of an outside library (gymnasium, TextArena, GEM,
reasoning-gym, skyrl-gym) or a tool sandbox behind rollart's ``Env`` contract
(``reset(seed) -> str``, ``step(text) -> StepResult``, ``close()``). ``AdapterEnv`` does
the part that is the same for all of them:

* a library call that raises on odd model text costs the turn and ``INVALID_PENALTY``
  (``info["invalid"]``) instead of crashing the trajectory;
* the episode ends on the library's own end, or after ``max_turns`` (``truncated``);
  stepping after the end raises ``RuntimeError``; ``close`` is idempotent;
* instances run where env managers run: ``affinity = CPU_ENV``; per-env limits are
  ``max_turns`` (and the tool sandbox's ``ToolLimits``), per-step wall time is the
  graph's ``Rollout.env_step_timeout``;
* pickling keeps the configuration only: the live library env is rebuilt at the next
  ``reset`` (envs cross process boundaries as factories, never mid-episode).

``GlobalRNG`` gives each env a private copy of the process-global ``random`` /
``numpy.random`` state for libraries that seed and draw from those (TextArena, GEM), so
envs running in the env manager's threads stay deterministic per seed.
``sampled_vocabulary`` makes a task's words known to the built-in word-level tokenizer by
playing a few random episodes. ``make_task`` builds the ``Task`` record.
"""

from __future__ import annotations

import abc
import random
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable

from rollart.env.tasks import Task
from rollart.reward.functions import INVALID_PENALTY, env_return
from rollart.types import CPU_ENV, StepResult

ENDING_WORDS = ("invalid", "success", "failure", "out", "of", "turns", ".", ":")


class GlobalRNG:
    """A private state of ``random`` and ``numpy.random`` swapped in around library calls.

    >>> import random
    >>> a, b = GlobalRNG(), GlobalRNG()
    >>> with a.active(): random.seed(1); x = random.random()
    >>> with b.active(): random.seed(2); _ = random.random()
    >>> with a.active(): y = random.random()
    >>> random.seed(1); _ = random.random(); y == random.random()
    True
    """

    _lock = threading.RLock()  # the globals are process-wide: one user at a time

    def __init__(self) -> None:
        self._state: tuple | None = None

    @contextmanager
    def active(self):
        import numpy as np

        with GlobalRNG._lock:
            saved = random.getstate(), np.random.get_state()
            if self._state is not None:
                random.setstate(self._state[0])
                np.random.set_state(self._state[1])
            try:
                yield
            finally:
                self._state = random.getstate(), np.random.get_state()
                random.setstate(saved[0])
                np.random.set_state(saved[1])


class AdapterEnv(abc.ABC):
    """Base of the library adapters. Subclasses implement ``_reset``, ``_step`` and
    ``_close_library``; ``_step`` returns ``(observation, reward, done, info)`` with
    ``info["success"]`` on a win and ``info["invalid"]`` when the text was not a move."""

    name: str = "adapter"
    #: where instances run: env managers on the CPU env pool (no adapter needs a GPU)
    affinity: str = CPU_ENV
    _live: tuple[str, ...] = ("_env",)  # attributes holding library objects (not pickled)

    def __init__(self, max_turns: int) -> None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be an int >= 1, "
                             f"got {max_turns!r}")
        self.max_turns = max_turns
        self._env = None
        self._turn = 0
        self._num_invalid = 0
        self._done = True

    # -- subclass hooks -------------------------------------------------------------------
    @abc.abstractmethod
    def _reset(self, seed: int) -> str:
        """Start the library episode for ``seed``; return the first observation."""

    @abc.abstractmethod
    def _step(self, action: str) -> tuple[str, float, bool, dict]:
        """Play ``action`` in the library env."""

    def _close_library(self) -> None:
        env, self._env = self._env, None
        if env is not None and hasattr(env, "close"):
            env.close()

    # -- the Env contract -----------------------------------------------------------------
    def reset(self, seed: int) -> str:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{self.name}: seed must be an int >= 0, got {seed!r}")
        self._close_quietly()
        self._turn, self._num_invalid, self._done = 0, 0, False
        return self._reset(seed)

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("episode is over; call reset(seed) to start a new one")
        self._turn += 1
        text = action if isinstance(action, str) else str(action)
        try:
            obs, reward, done, info = self._step(text)
            info = dict(info)
        except Exception as e:  # the library choked on the text: an invalid move
            obs, reward, done = f"invalid . {self.name} : try again .", -INVALID_PENALTY, False
            info = {"invalid": True, "error": f"{type(e).__name__}: {e}"[:500]}
        invalid = bool(info.get("invalid", False))
        self._num_invalid += invalid
        success = bool(info.get("success", False))
        truncated = not done and self._turn >= self.max_turns
        if truncated:
            obs = f"{obs} {self.name} : out of turns ."
        self._done = bool(done) or truncated
        info.update(success=success, invalid=invalid, turn=self._turn, truncated=truncated,
                    num_invalid=self._num_invalid)
        if self._done:
            self._close_quietly()
        return StepResult(obs, float(reward), self._done, info)

    def close(self) -> None:
        self._done = True
        self._close_quietly()

    def _close_quietly(self) -> None:
        try:
            self._close_library()
        except Exception:
            pass
        for attr in self._live:
            setattr(self, attr, None)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for attr in self._live:
            state[attr] = None
        state["_done"] = True  # a copy starts with reset(seed)
        return state


def wrap_action(text: str, marker: str, template: str) -> str:
    """``text`` as the library expects it: wrapped in ``template`` unless it already
    contains ``marker`` (so a model may answer ``5`` where the library wants ``[5]``).

    >>> wrap_action("5", "[", "[{}]"), wrap_action("I say [5]", "[", "[{}]")
    ('[5]', 'I say [5]')
    """
    text = text.strip()
    if marker in text or not text:
        return text
    return template.format(text)


def sampled_vocabulary(env_factory: Callable[[], Any], warmup_action: Callable,
                       max_turns: int, seeds: Iterable[int] = range(16),
                       extra: Iterable[str] = ()) -> list[str]:
    """Every word seen in random episodes of the env (observations and actions), plus
    ``extra``: what the built-in word-level tokenizer needs to know for a task whose
    text comes from a library. Deterministic for fixed seeds."""
    words: set[str] = set(ENDING_WORDS) | set(extra)
    rng = random.Random(0)
    env = env_factory()
    try:
        for seed in seeds:
            obs = env.reset(seed)
            words.update(obs.split())
            for _ in range(max_turns):
                action = warmup_action(rng, obs)
                words.update(action.split())
                step = env.step(action)
                obs = step.observation
                words.update(obs.split())
                if step.done:
                    break
    finally:
        env.close()
    return sorted(words)


class SampledVocabulary:
    """A picklable ``Task.vocabulary``: ``sampled_vocabulary`` of a factory, cached."""

    def __init__(self, env_factory, warmup_action, max_turns: int, seeds=range(16),
                 extra: Iterable[str] = ()):
        self.env_factory, self.warmup_action = env_factory, warmup_action
        self.max_turns, self.seeds, self.extra = max_turns, tuple(seeds), tuple(extra)
        self._words: list[str] | None = None

    def __call__(self) -> list[str]:
        if self._words is None:
            self._words = sampled_vocabulary(self.env_factory, self.warmup_action,
                                             self.max_turns, self.seeds, self.extra)
        return list(self._words)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_words": None}


def make_task(name: str, env_factory, *, max_turns: int, warmup_action, max_new_tokens: int,
              reward_fn=env_return, vocabulary=None, description: str = "",
              vocab_seeds=range(16), extra_words: Iterable[str] = (),
              top_p: float | None = None, **task_fields) -> Task:
    """A ``Task`` for an adapter env; its vocabulary is sampled from random episodes
    unless given. ``reward_fn`` defaults to the sum of the env's own per-step rewards.
    Other ``Task`` fields (e.g. ``system_prompt``, ``stop``) pass through ``task_fields``."""
    if vocabulary is None:
        vocabulary = SampledVocabulary(env_factory, warmup_action, max_turns, vocab_seeds,
                                       extra_words)
    return Task(name=name, env_factory=env_factory, reward_fn=reward_fn, max_turns=max_turns,
                max_new_tokens=max_new_tokens, warmup_action=warmup_action,
                vocabulary=vocabulary, description=description, top_p=top_p, **task_fields)
