"""The verifiers adapter (rollart.env.adapters.verifiers): a verifiers (v1) taskset built
with verifiers' own classes plays one rollout per trajectory against rollart's
OpenAI-compatible endpoint, served here by the scripted policy of test_agent.py (each
call generates the ids of a given text through the real tokenizer). The reward is the
one verifiers' ``@vf.reward`` computed: the right sum scores 1, a wrong one 0; a rollout
verifiers marks failed (a reward that raises, a refused model call) raises with
verifiers' message; the task pickles. The graph file trains in test_verifiers_graph.py."""

import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest

vf = pytest.importorskip("verifiers.v1", reason="the verifiers adapter needs verifiers")
pytest.importorskip("openai", reason="the verifiers adapter's harness uses openai")

# the fixtures of test_agent.py: a ChatML format, a loop thread, the endpoint on it
from test_agent import Script, fmt, loop, on, server  # noqa: E402,F401 (tests/agents/)

from rollart.env.adapters.verifiers import (  # noqa: E402
    VerifiersRolloutError, load_tasks, verifiers_task)
from rollart.env.adapters.verifiers_example import (  # noqa: E402
    SIZE, SumsEnv, SumsTask, SumsTaskset, make_sums)
from rollart.agents.agent import agent_session, run_agent  # noqa: E402
from rollart.chat.conversation import TokenLog  # noqa: E402


class BrokenSumsTask(SumsTask):
    @vf.reward
    async def broken(self, task, trace) -> float:
        raise ValueError("the answer key is missing")


class BrokenSums(SumsTaskset):
    def load(self):
        for task in super().load():
            yield BrokenSumsTask(task.data, self.config.task)


def make_broken_sums():
    return BrokenSums()


def not_a_taskset():
    return {"prompt": "2 + 2"}


def play(fmt, server, loop, task, seed, texts, close_first=False):
    """One trajectory of ``task``: the agent against a route served with ``texts``."""
    script = Script(fmt, texts)
    s = agent_session(task, fmt, TokenLog(), script)
    ep = server.open(s, seed=seed)
    if close_first:
        server.close(ep)
    with ThreadPoolExecutor(1) as pool:
        returned = on(loop, run_agent(task.agent, ep, s, 30.0, pool))
    server.close(ep)
    return s.episode(task.name, seed, returned), s


def test_the_right_sum_scores_1_by_verifiers_reward_and_a_wrong_one_0(fmt, server, loop):
    task = verifiers_task(make_sums, name="sums_vf", max_new_tokens=4)
    answer = load_tasks(make_sums)[3].data
    right, s = play(fmt, server, loop, task, 3, [answer.answer])
    assert right.env_rewards == [1.0] and right.info["success"] is True
    assert right.info["verifiers_rewards"] == {"correct": 1.0}
    assert right.info["agent_calls"] == 1 and not right.truncated
    # the trajectory is the task's prompt as the user turn and the policy's answer
    text = fmt.tokenizer.decode(s.log.ids)
    assert text == (f"<|im_start|>user\n{answer.prompt}<|im_end|>\n"
                    f"<|im_start|>assistant\n{answer.answer}<|im_end|>")
    assert sum(s.log.loss_mask) == len(fmt.tokenizer.encode(answer.answer)) + 1
    wrong, _ = play(fmt, server, loop, task, 3 + SIZE, ["9"])  # seed % SIZE: same task
    assert wrong.env_rewards == [0.0] and wrong.info["success"] is False
    assert wrong.info["verifiers_rewards"] == {"correct": 0.0}


def test_a_failed_verifiers_rollout_raises_with_its_message(fmt, server, loop):
    task = verifiers_task(make_broken_sums, name="broken")
    with pytest.raises(VerifiersRolloutError, match="the answer key is missing"):
        play(fmt, server, loop, task, 0, ["1"])
    # a model call the endpoint refuses (the trajectory's route is closed): 410
    task = verifiers_task(make_sums, name="sums_vf")
    with pytest.raises(VerifiersRolloutError, match="410"):
        play(fmt, server, loop, task, 0, ["1"], close_first=True)


def test_the_task_pickles_and_a_bad_factory_is_named():
    task = verifiers_task(make_sums, name="sums_vf", max_turns=1)
    back = pickle.loads(pickle.dumps(task))
    assert back.agent.args[0].factory is make_sums and back.max_turns == 1
    with pytest.raises(TypeError, match="verifiers.v1.Taskset"):
        load_tasks(not_a_taskset)
    with pytest.raises(TypeError, match="factory must be"):
        verifiers_task(make_sums(), name="x")


class TwoAgentEnv(vf.Env):
    async def run(self, task, agents):
        await agents.solver.run(task)
        await agents.checker.run(task)


def test_a_single_agent_env_plays_its_taskset_and_a_multi_agent_one_is_refused():
    single = object.__new__(vf.SingleAgentEnv)  # built as verifiers' loaders would
    single.taskset = SumsTaskset()
    assert [t.data.prompt for t in load_tasks(lambda: single)] == [
        t.data.prompt for t in load_tasks(make_sums)]
    with pytest.raises(TypeError, match="multi-agent verifiers Env"):
        load_tasks(lambda: object.__new__(TwoAgentEnv))


def test_the_env_twin_asks_the_same_tasks():
    tasks = load_tasks(make_sums)
    env = pickle.loads(pickle.dumps(SumsEnv()))
    assert env.reset(7) == tasks[7].data.prompt
    assert env.step(tasks[7].data.answer).info["success"] is True
