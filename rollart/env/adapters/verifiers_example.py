"""A small verifiers (v1) environment written with verifiers' own classes: one-digit
sums, the reward verifiers' ``@vf.reward`` comparing the model's last reply with the
answer.

Consumed by ``graphs/verifiers.py`` and ``tests/env/test_verifiers.py`` through
``rollart.env.adapters.verifiers.verifiers_task(make_sums, name=...)``: ``make_sums``
(module level, so it pickles) builds the taskset on the worker. ``SumsTaskset`` is how
any verifiers taskset looks: a ``Taskset`` whose ``load()`` yields ``Task``\\ s carrying
their data (prompt, answer), the task class holding the rewards.

``sums_env_task`` is the same taskset as a plain rollart env task (``SumsEnv``: the
prompt as the observation, one answer, success when it is the task's answer), for the
chat toy: it is built from env tasks' text and warmed up on them, which an agent task
has none of. Needs ``verifiers``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

from rollart.env.adapters.base import ENDING_WORDS, AdapterEnv, make_task
from rollart.env.adapters.verifiers import load_tasks

__all__ = ["SumsData", "SumsEnv", "SumsTask", "SumsTaskset", "digit_warmup", "make_sums",
           "sums_env_task", "sums_vocabulary"]

SIZE = 20  # tasks in the taskset: seed s plays task s % SIZE


class SumsData(vf.TaskData):
    answer: str
    """The sum, as the model should write it."""


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        """1.0 when the last reply is the answer (whitespace aside), else 0.0."""
        return float(trace.last_reply.strip() == task.answer)


class SumsTaskset(vf.Taskset[SumsTask, vf.TasksetConfig]):
    """``SIZE`` sums ``a + b`` of digits, fixed by ``seed``."""

    def __init__(self, config: vf.TasksetConfig | None = None, seed: int = 0) -> None:
        super().__init__(config or vf.TasksetConfig())
        self.seed = seed

    def load(self) -> Iterator[SumsTask]:
        rng = random.Random(self.seed)
        for _ in range(SIZE):
            a, b = rng.randrange(5), rng.randrange(5)
            data = SumsData(prompt=f"sum : {a} plus {b} . answer :", answer=str(a + b))
            yield SumsTask(data, self.config.task)


def make_sums() -> SumsTaskset:
    """The taskset ``verifiers_task`` builds on the worker."""
    return SumsTaskset()


def sums_vocabulary() -> list[str]:
    """Every word the sums' prompts, answers and ``SumsEnv``'s endings use."""
    return sorted({"sum", "sums", "plus", "answer", *ENDING_WORDS, *map(str, range(10))})


class SumsEnv(AdapterEnv):
    """The sums as a rollart env: seed ``s`` asks task ``s % SIZE``; one answer."""

    name = "sums"
    _live = ("_env", "_task")

    def __init__(self) -> None:
        super().__init__(max_turns=1)
        self._task = None

    def _reset(self, seed: int) -> str:
        self._task = load_tasks(make_sums)[seed % SIZE]
        return self._task.data.prompt

    def _step(self, action: str):
        if action.strip() == self._task.data.answer:
            return "sums : success .", 1.0, True, {"success": True}
        return "sums : failure .", 0.0, True, {}


def digit_warmup(rng: random.Random, observation: str) -> str:
    """Warm-up action: a random sum of two digits below 5 (right format, random value)."""
    return str(rng.randrange(9))


def sums_env_task(name: str = "sums", max_new_tokens: int = 4):
    """``SumsEnv`` as a task (reward: the env's, 1 for the right sum)."""
    return make_task(name, SumsEnv, max_turns=1, warmup_action=digit_warmup,
                     max_new_tokens=max_new_tokens, vocabulary=sums_vocabulary,
                     description="one-digit sums (the verifiers example as an env)")
