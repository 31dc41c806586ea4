"""Built-in envs, the env protocol checks and task records (rollart.env)."""

from __future__ import annotations

import math
import pickle
import random
import re

import pytest

from rollart.env import (
    BUILTIN_TASKS,
    Env,
    EnvOutputError,
    Task,
    UnknownTaskError,
    check_observation,
    check_step_result,
    get_task,
    task_corpus,
)
from rollart.reward import success_with_invalid_penalty
from rollart.types import StepResult

TASK_NAMES = sorted(BUILTIN_TASKS)
WORD = re.compile(r"^([a-z]+|[0-9]|[.:])$")


# -- oracle policies: read the current observation only ----------------------------
def _word_after(words: list[str], key: str, skip: int) -> str:
    return words[words.index(key) + skip]


def oracle_gridnav(obs: str) -> str:
    return _word_after(obs.split(), "goal", 2)  # "goal 2 right ..." -> "right"


def oracle_guess(obs: str) -> str:
    words = obs.split()
    start = words.index("left") + 1
    left = sorted(words[start : words.index(".", start)], key=int)
    return left[(len(left) - 1) // 2]


def oracle_boxpush(obs: str) -> str:
    return _word_after(obs.split(), "box", 2)  # "box 2 right ." -> "right"


ORACLES = {"gridnav": oracle_gridnav, "guess": oracle_guess, "boxpush": oracle_boxpush}


def rollout(task: Task, seed: int, policy) -> tuple[list[str], list[StepResult]]:
    env = task.env_factory()
    obs = [env.reset(seed)]
    results = []
    while True:
        res = check_step_result(env.step(policy(obs[-1])), env)
        results.append(res)
        obs.append(res.observation)
        if res.done:
            env.close()
            return obs, results


def success_rate(task: Task, policy_for_seed, seeds=range(300)) -> float:
    wins = sum(rollout(task, s, policy_for_seed(s))[1][-1].info["success"] for s in seeds)
    return wins / len(seeds)


def random_policy(task: Task):
    def make(seed: int):
        rng = random.Random(10_000 + seed)
        return lambda obs: task.warmup_action(rng, obs)

    return make


# -- per-task behaviour ------------------------------------------------------------
@pytest.mark.parametrize("name", TASK_NAMES)
def test_random_vs_oracle_gap(name):
    task = BUILTIN_TASKS[name]
    rand = success_rate(task, random_policy(task))
    oracle = success_rate(task, lambda seed: ORACLES[name])
    print(f"{name}: random {rand:.3f}  oracle {oracle:.3f}  (max_turns {task.max_turns})")
    assert rand <= 0.55
    assert rand >= 0.10  # RL needs some signal from a format-only policy
    assert oracle >= 0.95


@pytest.mark.parametrize("name", TASK_NAMES)
def test_determinism_per_seed(name):
    task = BUILTIN_TASKS[name]
    pol = random_policy(task)
    a, _ = rollout(task, 7, pol(0))
    b, _ = rollout(task, 7, pol(0))
    assert a == b
    # the same action stream for every seed
    runs = {tuple(rollout(task, s, random_policy(task)(123))[0]) for s in range(20)}
    assert len(runs) > 1, "different seeds should give different episodes"


@pytest.mark.parametrize("name", TASK_NAMES)
def test_vocabulary_closure_and_format(name):
    task = BUILTIN_TASKS[name]
    vocab = set(task.vocabulary())
    assert all(WORD.match(w) for w in vocab), vocab
    for seed in range(200):
        rng = random.Random(seed)

        def policy(obs, rng=rng):  # mostly valid, sometimes garbage
            return rng.choice(["", "jump !", "10"]) if rng.random() < 0.1 else (
                task.warmup_action(rng, obs))

        obs, results = rollout(task, seed, policy)
        assert obs[0].startswith(f"{name} :")
        assert len(results) <= task.max_turns <= 8
        for text in obs:
            assert set(text.split()) <= vocab, text
        assert set(task.warmup_action(rng, obs[0]) for _ in range(50)) <= vocab


@pytest.mark.parametrize("name", TASK_NAMES)
def test_invalid_action_costs_a_turn(name):
    task = BUILTIN_TASKS[name]
    env = task.env_factory()
    first = env.reset(3)
    for turn, bad in enumerate(["", "   ", "dance", "0"], start=1):
        res = env.step(bad)
        assert res.info["invalid"] is True and res.info["turn"] == turn
        assert res.reward == pytest.approx(-0.1)
        assert res.observation.split()[:2] == ["invalid", "."]
        if res.done:
            break
        assert res.observation == "invalid . " + first  # state unchanged
    assert res.info["num_invalid"] == turn


@pytest.mark.parametrize("name", TASK_NAMES)
def test_truncation_and_step_after_done(name):
    task = BUILTIN_TASKS[name]
    env = task.env_factory()
    env.reset(0)
    for _ in range(task.max_turns):
        res = env.step("nope")
    assert res.done and res.info["truncated"] and not res.info["success"]
    assert res.info["turn"] == task.max_turns
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("up")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_success_info_and_reward(name):
    obs, results = rollout(BUILTIN_TASKS[name], 1, ORACLES[name])
    last = results[-1]
    assert last.done and last.info["success"] is True and last.info["truncated"] is False
    assert last.reward == 1.0
    assert set(last.info) >= {"success", "invalid", "turn", "truncated"}


def test_action_parsing_uses_first_word_case_insensitive():
    env = BUILTIN_TASKS["gridnav"].env_factory()
    obs = env.reset(5)
    res = env.step(f"  {oracle_gridnav(obs).upper()} please ")
    assert not res.info["invalid"]
    assert res.observation != obs


def test_observation_examples():
    env = BUILTIN_TASKS["guess"].env_factory()
    assert env.reset(0) == "guess : pick 1 to 9 . left 1 2 3 4 6 7 8 9 5 . act :"
    res = env.step("5")
    assert re.fullmatch(r"(guess : (higher|lower) \. left( \d)+ \. act :)|guess : success \.",
                        res.observation)
    box = BUILTIN_TASKS["boxpush"].env_factory().reset(0)
    assert re.fullmatch(r"boxpush : box \d (left|right) \. target \d \1 \. act :", box)
    grid = BUILTIN_TASKS["gridnav"].env_factory().reset(0)
    assert re.fullmatch(r"gridnav : goal( \d (left|right))?( \d (up|down))? \. act :", grid)


def test_boxpush_sides_are_random_and_pushing_works():
    sides = {oracle_boxpush(BUILTIN_TASKS["boxpush"].env_factory().reset(s)) for s in range(20)}
    assert sides == {"left", "right"}
    env = BUILTIN_TASKS["boxpush"].env_factory()
    env.reset(0)
    env._agent, env._box, env._target = 0, 1, 3  # push the box one cell right
    assert env.step("right").observation == "boxpush : box 1 right . target 2 right . act :"
    env._agent, env._box, env._target = 5, 6, 3  # box against the wall: no move
    assert env.step("right").observation == "boxpush : box 1 right . target 2 left . act :"


# -- protocol checks ---------------------------------------------------------------
class _Dummy:
    def reset(self, seed):
        return "x"

    def step(self, action):
        return 3

    def close(self):
        pass


def test_env_protocol_runtime_check():
    assert isinstance(_Dummy(), Env)
    for task in BUILTIN_TASKS.values():
        assert isinstance(task.env_factory(), Env)
    assert not isinstance(object(), Env)


def test_check_step_result_messages():
    with pytest.raises(EnvOutputError, match=r"env _Dummy\.step returned int; expected "
                       r"rollart\.types\.StepResult"):
        check_step_result(_Dummy().step("a"), _Dummy())
    bad = {
        "observation is bytes": StepResult(b"x", 0.0, False, {}),
        "reward is str": StepResult("x", "1", False, {}),
        "reward is nan": StepResult("x", math.nan, False, {}),
        "reward is bool": StepResult("x", True, False, {}),
        "done is int": StepResult("x", 0.0, 1, {}),
        "info is NoneType": StepResult("x", 0.0, True, None),
    }
    for msg, res in bad.items():
        with pytest.raises(EnvOutputError, match=msg):
            check_step_result(res, "MyEnv")
    with pytest.raises(EnvOutputError, match="returned a 3-tuple"):
        check_step_result(("x", 0.0, True))
    assert issubclass(EnvOutputError, TypeError)


def test_check_step_result_accepts_tuple_and_converts():
    res = check_step_result(("obs", 1, True, {"success": True}))
    assert res == StepResult("obs", 1.0, True, {"success": True})
    assert isinstance(res.reward, float)
    assert check_observation("hi") == "hi"
    with pytest.raises(EnvOutputError, match=r"env GridNavEnv\.reset returned NoneType"):
        check_observation(None, "GridNavEnv")


# -- tasks ---------------------------------------------------------------------------
def test_task_validation_messages():
    ok = dict(env_factory=_Dummy, reward_fn=success_with_invalid_penalty, max_turns=3)
    with pytest.raises(ValueError, match="non-empty str without whitespace"):
        Task(name="two words", **ok)
    with pytest.raises(ValueError, match="non-empty"):
        Task(name="", **ok)
    with pytest.raises(ValueError, match="max_turns must be an int >= 1, got 0"):
        Task(name="t", **{**ok, "max_turns": 0})
    with pytest.raises(TypeError, match="env_factory must be callable.*not an instance"):
        Task(name="t", **{**ok, "env_factory": _Dummy()})
    with pytest.raises(TypeError, match="reward_fn must be callable"):
        Task(name="t", **{**ok, "reward_fn": 1.0})
    with pytest.raises(TypeError, match="vocabulary must be callable"):
        Task(name="t", vocabulary=["a"], **ok)
    assert Task(name="t", **ok).max_new_tokens == 4


def test_get_task_and_unknown_message():
    task = get_task("gridnav")
    assert task is BUILTIN_TASKS["gridnav"] and get_task(task) is task
    with pytest.raises(UnknownTaskError) as info:
        get_task("sokoban")
    from rollart.env.adapters import ADAPTER_TASKS  # library-adapter names are listed too

    assert str(info.value) == (
        "unknown task 'sokoban'; known tasks: boxpush, gridnav, guess, "
        + ", ".join(sorted(ADAPTER_TASKS)) + " (or pass a rollart.env.Task object)"
    )
    assert isinstance(info.value, KeyError)
    with pytest.raises(TypeError, match="task name"):
        get_task(3)


def test_task_corpus_is_union():
    corpus = task_corpus(TASK_NAMES)
    assert corpus == sorted(set(corpus))
    for task in BUILTIN_TASKS.values():
        assert set(task.vocabulary()) <= set(corpus)
    assert {"up", "higher", "box", "invalid", "0", "9", ":", "."} <= set(corpus)
    with pytest.raises(ValueError, match="no vocabulary"):
        task_corpus([Task("t", _Dummy, success_with_invalid_penalty, 2)])


def test_tasks_pickle():
    for name, task in BUILTIN_TASKS.items():
        back = pickle.loads(pickle.dumps(task))
        assert back == task
        env = pickle.loads(pickle.dumps(task.env_factory))()
        assert env.reset(11) == task.env_factory().reset(11)
        assert pickle.loads(pickle.dumps(task.reward_fn)) is task.reward_fn
