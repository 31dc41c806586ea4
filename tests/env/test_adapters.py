"""Library adapters on real environments, offline: reset / step / close, seeding, invalid
model output, pickling, the sandboxed tool's limits, and loss masking of tool tokens."""

import pickle
import random

import pytest

from rollart.env.protocol import Env, check_observation, check_step_result
from rollart.reward.functions import INVALID_PENALTY
from rollart.types import Episode

GARBAGE = ["", "   ", "\\boxed{", "[[[", "<sql>", "zzz qqq", "\x00\x01 ünïcode ☃", "x9" * 200]


def play(env, seed, actions):
    """Reset and play ``actions`` until done; every return goes through the env checks."""
    obs = [check_observation(env.reset(seed), env)]
    steps = []
    for a in actions:
        step = check_step_result(env.step(a), env)
        steps.append(step)
        obs.append(step.observation)
        if step.done:
            break
    return obs, steps


def check_adapter(task, seed, good_actions, garbage=GARBAGE):
    """The contract every adapter meets, on the task's real env."""
    env = task.env_factory()
    assert isinstance(env, Env)
    # seeding: same seed, same actions -> same texts and rewards
    a = play(env, seed, good_actions)
    b = play(env, seed, good_actions)
    assert a[0] == b[0] and [s.reward for s in a[1]] == [s.reward for s in b[1]]
    # invalid model output: penalised or played by the library's rules, never a crash
    env.reset(seed)
    for text in garbage:
        step = check_step_result(env.step(text), env)
        assert step.reward <= 0.0 and not step.info["success"]
        if step.done:
            env.reset(seed)
    # stepping after the end raises; close is idempotent
    _, steps = play(env, seed, good_actions * 20)
    assert steps[-1].done
    with pytest.raises(RuntimeError):
        env.step(good_actions[0])
    env.close()
    env.close()
    # pickling: the task (factories, reward) and an env, which resets after the trip
    task2 = pickle.loads(pickle.dumps(task))
    env2 = pickle.loads(pickle.dumps(env))
    assert play(env2, seed, good_actions)[0] == a[0]
    env2.close()
    # the tokenizer words: the task's vocabulary covers its first observations
    vocab = set(task2.vocabulary())
    first = env.reset(seed).split()
    env.close()
    assert sum(w in vocab for w in first) >= 0.9 * len(first)
    return a


# -- gymnasium ------------------------------------------------------------------------------
def test_frozenlake_maps_text_to_actions_and_penalises_invalid():
    pytest.importorskip("gymnasium")
    from rollart.env.adapters.gym import frozenlake_task

    task = frozenlake_task(size=3, max_turns=6)
    obs, _ = check_adapter(task, 5, ["right", "down"])
    assert obs[0].startswith("frozenlake : P ") and obs[0].endswith(". act :")
    # different seeds give different random maps
    env = task.env_factory()
    assert len({env.reset(s) for s in range(12)}) > 1
    # an invalid word costs the turn and the penalty; the player does not move
    first = env.reset(5)
    step = env.step("jump")
    assert step.info["invalid"] and step.reward == -INVALID_PENALTY
    assert step.observation == f"invalid . {first}"
    # a solved map: the library's reward 1 is a success
    for seed in range(50):
        env.reset(seed)
        for a in ["right", "right", "down", "down"]:
            step = env.step(a)
            if step.done:
                break
        if step.info["success"]:
            assert step.reward == 1.0 and task.reward_fn(
                Episode("frozenlake", seed, [], [], [step.reward], step.info)) == 1.0
            break
    else:
        pytest.fail("right-right-down-down never solved a 3x3 map")
    env.close()


# -- TextArena ------------------------------------------------------------------------------
def test_textarena_guess_the_number_offline():
    pytest.importorskip("textarena")
    from rollart.env.adapters.textarena import guess_the_number_task, tower_of_hanoi_task

    task = guess_the_number_task(max_turns=20)
    obs, steps = check_adapter(task, 3, [str(g) for g in range(1, 21)])
    assert "Guess The Number" in obs[0]
    assert steps[-1].info["success"] and steps[-1].reward == 1.0  # the sweep finds it
    assert "higher" in steps[0].observation or steps[0].done
    # the secret depends on the seed (private RNG state per env, not the global one)
    env = task.env_factory()
    turns = set()
    for seed in range(6):
        random.seed(123)
        env.reset(seed)
        for g in range(1, 21):
            if env.step(str(g)).done:
                turns.add(g)
                break
    assert len(turns) > 1
    env.close()
    hanoi = tower_of_hanoi_task()
    obs, steps = check_adapter(hanoi, 0, ["A C", "A B", "C B", "A C", "B A", "B C", "A C"])
    assert steps[-1].info["success"], obs[-1]


# -- GEM ------------------------------------------------------------------------------------
def test_gem_games_offline():
    pytest.importorskip("gem")
    from rollart.env.adapters.gem import guess_the_number_task, sokoban_task

    task = guess_the_number_task(max_turns=10)
    obs, steps = check_adapter(task, 4, [str(g) for g in range(1, 11)])
    assert "\\boxed" in obs[0] and steps[-1].info["success"] and steps[-1].reward == 1.0
    env = task.env_factory()
    env.reset(4)
    step = env.step("no number here")  # GEM's own rule: an invalid guess ends the game
    assert step.done and step.reward < 0 and step.info["invalid"]
    env.close()
    check_adapter(sokoban_task(), 1, ["up", "left", "down", "right"])


# -- reasoning-gym --------------------------------------------------------------------------
def test_reasoning_gym_single_turn_and_retry_with_its_scorer():
    pytest.importorskip("reasoning_gym")
    from rollart.env.adapters import RG_EASY_ARITHMETIC
    from rollart.env.adapters.reasoning_gym import load_dataset, reasoning_gym_task

    one = reasoning_gym_task("basic_arithmetic", name="rg1", config=RG_EASY_ARITHMETIC)
    retry = reasoning_gym_task("basic_arithmetic", name="rg3", config=RG_EASY_ARITHMETIC,
                               max_attempts=3)
    data = load_dataset("basic_arithmetic", 200, 0, tuple(sorted(RG_EASY_ARITHMETIC.items())))
    seed = 7
    right = str(data[seed]["answer"])
    wrong = str(int(right) + 1)
    obs, steps = check_adapter(one, seed, [f"<answer>{right}</answer>"])
    assert obs[0].startswith(data[seed]["question"].strip())
    assert steps[-1].done and steps[-1].info["success"]
    env = one.env_factory()
    env.reset(seed)
    assert env.step(wrong).done  # single turn: one answer
    # retry with feedback: wrong, then right on the second attempt
    env = retry.env_factory()
    o0 = env.reset(seed)
    s1 = env.step(wrong)
    assert not s1.done and "incorrect" in s1.observation
    s2 = env.step(right)
    assert s2.done and s2.info["success"]
    # the reward is the library's scorer, re-run on the episode's answers
    ep = Episode("rg3", seed, [o0, s1.observation, s2.observation], [wrong, right],
                 [s1.reward, s2.reward], s2.info)
    assert retry.reward_fn(ep) == pytest.approx(0.8)
    ep1 = Episode("rg1", seed, [o0], [right], [1.0], {"success": True})
    assert one.reward_fn(ep1) == 1.0
    assert one.reward_fn(Episode("rg1", seed, [o0], [wrong], [0.0], {})) == 0.0
    assert pickle.loads(pickle.dumps(one.reward_fn))(ep1) == 1.0
    # the dataset's own scorer, not string equality: it accepts what the library accepts
    assert one.reward_fn(Episode("rg1", seed, [o0], [f" {right} "], [1.0], {})) == 1.0
    # the vocabulary holds every question and answer word of the dataset
    vocab = set(one.vocabulary())
    assert all(w in vocab for e in data for w in e["question"].split() + [str(e["answer"])])


# -- skyrl-gym -------------------------------------------------------------------------------
def test_skyrl_gsm8k_multi_turn_on_local_data(tmp_path):
    pytest.importorskip("skyrl_gym")
    import json

    from rollart.env.adapters.skyrl import gsm8k_task, write_gsm8k_data

    data = write_gsm8k_data(str(tmp_path / "gsm8k.jsonl"), n=16, seed=1)
    task = gsm8k_task(data, max_turns=3)
    truth = json.loads(open(data).readline())["reward_spec"]["ground_truth"]
    wrong = str(int(truth) + 1)
    obs, steps = check_adapter(task, 0, [wrong, f"#### {truth}"])
    assert steps[0].reward > 0 and not steps[0].done  # skyrl's format score per turn
    assert steps[1].done and steps[1].info["success"] and steps[1].reward == 1.0


def test_skyrl_text2sql_on_a_generated_sqlite_db(tmp_path):
    pytest.importorskip("skyrl_gym")
    from rollart.env.adapters.skyrl import text2sql_task, write_text2sql_data

    db_root, data = write_text2sql_data(str(tmp_path / "sql"))
    task = text2sql_task(db_root, data, max_turns=3)
    call = "<sql> SELECT count(*) FROM pets </sql>"
    final = "<think> six </think> <solution> SELECT count(*) FROM pets </solution>"
    obs, steps = check_adapter(task, 0, [call, final])
    assert "6" in steps[0].observation.split()  # the SQL tool ran on the real database
    assert steps[1].done and steps[1].info["success"] and steps[1].reward == 1.0
    env = task.env_factory()
    env.reset(1)  # "List the names of all dogs": a count is the wrong answer
    step = env.step(final)
    assert step.done and not step.info["success"] and step.reward == 0.0
    env.close()


# -- tool use ---------------------------------------------------------------------------------
def test_tool_sandbox_limits():
    from rollart.env.adapters.tool import ToolLimits, run_python

    assert run_python("6 * 7").output == "42"
    assert run_python("print('hi')").output == "hi"
    assert not run_python("raise ValueError('x')").ok
    slow = run_python("import time; time.sleep(30)", ToolLimits(wall_seconds=1.0))
    assert not slow.ok and "timeout" in slow.output
    spin = run_python("while True: pass", ToolLimits(cpu_seconds=1, wall_seconds=60))
    assert not spin.ok and "cpu time limit" in spin.output
    big = run_python("x = bytearray(1 << 31)", ToolLimits(memory_mb=200))
    assert not big.ok and "MemoryError" in big.output
    env = run_python("import os; print(sorted(os.environ))")
    assert env.ok and "HOME" not in env.output  # no inherited environment
    assert len(run_python("print('a' * 10000)").output) <= ToolLimits().max_output


def test_calc_tool_env_returns_tool_messages():
    from rollart.env.adapters.tool import calc_tool_task

    task = calc_tool_task()
    env = task.env_factory()
    first = env.reset(11)
    question = first.split("what is ")[1].split(" ?")[0]
    truth = eval(question)
    obs, steps = check_adapter(task, 11, [f"python {question}", f"answer {truth}"])
    assert steps[0].observation == f"tool : {truth} . act :"
    assert steps[0].info["role"] == "tool" and steps[0].reward == 0.0
    assert steps[1].done and steps[1].info["success"] and steps[1].reward == 1.0
    env.reset(11)
    err = env.step("python 1 / 0")
    assert err.info["role"] == "tool" and "error ZeroDivisionError" in err.observation
    assert env.step("answer x").done  # a malformed number is a wrong answer


def test_tool_tokens_are_masked_out_of_the_loss():
    """A calc episode logged the way the trajectory runner logs it, collated by the
    trainer: the tool's output tokens get no loss, the model's actions do."""
    from rollart.env.adapters.tool import calc_tool_task
    from rollart.env.trajectory import TokenLog
    from rollart.model import build_tokenizer, encode
    from rollart.trainer.trainer import collate
    from rollart.types import Trajectory

    task = calc_tool_task()
    tok = build_tokenizer(task.vocabulary())
    env = task.env_factory()
    log = TokenLog()
    obs = env.reset(11)
    question = obs.split("what is ")[1].split(" ?")[0]
    log.add_observation(encode(tok, obs))
    tool_obs = None
    for action in [f"python {question}", f"answer {eval(question)}"]:
        log.add_generation(encode(tok, action) + [tok.eos_token_id], [-1.0] * 4)
        step = env.step(action)
        if step.done:
            break
        tool_obs = step.observation
        log.add_observation(encode(tok, tool_obs))
    traj = Trajectory("t", "calc", "g", 11, log.prompt_ids, log.response_ids, log.loss_mask,
                      log.logprobs, log.versions)
    ids, _, mask, _ = collate([traj], tok.pad_token_id)
    ids, mask = ids[0].tolist(), mask[0].tolist()
    tool_ids = encode(tok, tool_obs)
    start = next(i for i in range(len(ids)) if ids[i:i + len(tool_ids)] == tool_ids)
    assert all(m == 0 for m in mask[start:start + len(tool_ids)])
    python_id = encode(tok, "python")[0]
    assert mask[ids.index(python_id, len(log.prompt_ids))] == 1  # the model's call
    assert sum(mask) == len(encode(tok, f"python {question}")) + len(encode(tok, "answer 0")) + 2


def test_doctests():
    import doctest

    from rollart.env.adapters import base, gym, reasoning_gym, tool

    for mod in (base, gym, reasoning_gym, tool):
        assert doctest.testmod(mod).failed == 0, mod.__name__


def test_task_top_p_is_validated():
    from rollart.env.adapters.tool import calc_tool_task

    assert calc_tool_task(top_p=0.9).top_p == 0.9
    for bad in (0, 1.5, "x"):
        with pytest.raises(ValueError, match="top_p"):
            calc_tool_task(top_p=bad)


def test_make_task_passes_other_task_fields_through():
    from rollart.env.adapters.tool import calc_tool_task

    task = calc_tool_task(tool_format="hermes", system_prompt="Use the python tool.",
                          stop=("</answer>",), invalid_penalty=0.2)
    assert (task.system_prompt, task.stop, task.invalid_penalty) == (
        "Use the python tool.", ("</answer>",), 0.2)
    with pytest.raises(TypeError, match="colour"):
        calc_tool_task(colour="red")
