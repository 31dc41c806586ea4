"""reasoning-gym adapter: its procedural tasks, single-turn or retry-with-feedback, with
the dataset's own scorer as the reward function.

``ReasoningGymEnv(dataset, size, dataset_seed, config)`` builds
``reasoning_gym.create_dataset(dataset, size=size, seed=dataset_seed, **config)``; seed
``s`` plays entry ``s % size``. The observation is the question; the model's answer is
the text inside ``<answer>...</answer>`` when present, else the whole reply. Each answer
is scored by ``dataset.score_answer``; a full score ends the episode with success. With
``max_attempts > 1`` a wrong answer gets feedback (``incorrect . try again .``) and
another try. An empty reply is invalid (``INVALID_PENALTY``).

``ReasoningGymScore`` is the task's reward function (it runs on the REWARD pool): it
rebuilds the dataset there and re-scores every answer of the episode with the library's
scorer, ``max_i score_i * retry_discount**i`` minus the invalid penalties — so the reward
never trusts numbers computed inside the env process. Needs ``reasoning-gym``.
"""

from __future__ import annotations

import random
import re
import threading
from functools import partial

from rollart.env.adapters.base import INVALID_PENALTY, AdapterEnv, make_task
from rollart.reward.functions import count_invalid
from rollart.types import Episode

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def load_dataset(dataset: str, size: int, seed: int, config: tuple = ()):
    """``reasoning_gym.create_dataset``, cached per process (datasets are deterministic)."""
    key = (dataset, size, seed, config)
    with _CACHE_LOCK:
        if key not in _CACHE:
            import reasoning_gym

            _CACHE[key] = reasoning_gym.create_dataset(dataset, size=size, seed=seed,
                                                       **dict(config))
        return _CACHE[key]


def extract_answer(text: str) -> str:
    """The model's answer: inside ``<answer>`` tags if any, else the stripped text.

    >>> extract_answer("I think <answer> 42 </answer>"), extract_answer(" 7 ")
    ('42', '7')
    """
    m = _ANSWER.search(text)
    return (m.group(1) if m else text).strip()


class ReasoningGymEnv(AdapterEnv):
    """One reasoning-gym dataset as a (retry-with-feedback) question-answer env."""

    _live = ()

    def __init__(self, dataset: str = "basic_arithmetic", *, size: int = 200,
                 dataset_seed: int = 0, config: tuple = (), max_attempts: int = 1,
                 name: str = "rg") -> None:
        super().__init__(max_attempts)
        self.dataset, self.size, self.dataset_seed = dataset, size, dataset_seed
        self.config, self.name = tuple(sorted(dict(config).items())), name
        self._entry: dict | None = None

    def _data(self):
        return load_dataset(self.dataset, self.size, self.dataset_seed, self.config)

    def _reset(self, seed: int) -> str:
        self._entry = self._data()[seed % self.size]
        return f"{self._entry['question'].strip()} answer :"

    def _step(self, action: str):
        answer = extract_answer(action)
        if not answer:
            return (f"invalid . {self.name} : give an answer . answer :", -INVALID_PENALTY,
                    False, {"invalid": True})
        score = float(self._data().score_answer(answer=answer, entry=self._entry))
        if score >= 1.0:
            return f"{self.name} : success .", 1.0, True, {"success": True, "score": score}
        if self._turn < self.max_turns:
            return (f"{self.name} : incorrect . try again . answer :", 0.0, False,
                    {"score": score})
        return f"{self.name} : failure .", score, True, {"score": score}


class ReasoningGymScore:
    """Reward function: the dataset's own scorer over the episode's answers.

    Picklable (plain attributes); the dataset is rebuilt and cached in the reward process.
    """

    def __init__(self, dataset: str, size: int, dataset_seed: int = 0, config: tuple = (),
                 retry_discount: float = 0.8) -> None:
        self.dataset, self.size, self.dataset_seed = dataset, size, dataset_seed
        self.config = tuple(sorted(dict(config).items()))
        self.retry_discount = retry_discount
        self.__name__ = f"reasoning_gym_score[{dataset}]"

    def __call__(self, ep: Episode) -> float:
        data = load_dataset(self.dataset, self.size, self.dataset_seed, self.config)
        entry = data[ep.seed % self.size]
        best, attempt = 0.0, 0
        for action in ep.actions:
            answer = extract_answer(action)
            if not answer:
                continue
            score = float(data.score_answer(answer=answer, entry=entry))
            best = max(best, score * self.retry_discount ** attempt)
            attempt += 1
        return best - INVALID_PENALTY * count_invalid(ep)


class AnswerWarmup:
    """Warm-up action: a random answer drawn from the dataset's answers (right format,
    random content). Picklable."""

    def __init__(self, dataset: str, size: int, dataset_seed: int = 0, config: tuple = ()):
        self.args = (dataset, size, dataset_seed, tuple(sorted(dict(config).items())))

    def __call__(self, rng: random.Random, observation: str) -> str:
        data = load_dataset(*self.args)
        return str(data[rng.randrange(len(data))]["answer"])


def dataset_vocabulary(dataset: str, size: int, dataset_seed: int = 0,
                       config: tuple = (), name: str = "") -> list[str]:
    """Every word of every question and answer of the dataset, plus the feedback words
    and the task ``name`` (it appears in the feedback)."""
    data = load_dataset(dataset, size, dataset_seed, tuple(sorted(dict(config).items())))
    words = {"answer", ":", ".", "success", "failure", "incorrect", "try", "again",
             "invalid", "give", "an", "out", "of", "turns", *name.split()}
    for entry in data:
        words.update(entry["question"].split())
        words.update(str(entry["answer"]).split())
    return sorted(words)


def reasoning_gym_task(dataset: str = "basic_arithmetic", *, name: str | None = None,
                       size: int = 200, dataset_seed: int = 0, config: dict | None = None,
                       max_attempts: int = 1, retry_discount: float = 0.8,
                       max_new_tokens: int = 4, top_p: float | None = None):
    """A reasoning-gym dataset as a rollart task (``max_attempts > 1``: retry with
    feedback). The reward is the dataset's scorer (``ReasoningGymScore``)."""
    cfg = tuple(sorted((config or {}).items()))
    name = name or f"rg_{dataset}" + ("_retry" if max_attempts > 1 else "")
    factory = partial(ReasoningGymEnv, dataset, size=size, dataset_seed=dataset_seed,
                      config=cfg, max_attempts=max_attempts, name=name)
    return make_task(
        name, factory, max_turns=max_attempts,
        warmup_action=AnswerWarmup(dataset, size, dataset_seed, cfg),
        max_new_tokens=max_new_tokens,
        reward_fn=ReasoningGymScore(dataset, size, dataset_seed, cfg, retry_discount),
        vocabulary=partial(dataset_vocabulary, dataset, size, dataset_seed, cfg, name),
        description=f"reasoning-gym {dataset}"
                    + (f", {max_attempts} attempts with feedback" if max_attempts > 1 else ""),
        top_p=top_p)
