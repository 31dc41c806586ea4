"""OpenEnv environments as rollart envs (rollart.env.adapters.openenv): in process and
over OpenEnv's own server on 127.0.0.1, text and tool actions, success, pickling, a
misconfiguration's message, and the graph (graphs/shared_envs.py:openenv) trained for
two steps (slow)."""

import json
import pickle
import random

import pytest

pytest.importorskip("openenv.core", reason="the OpenEnv adapter needs openenv-core "
                    "(rollart[envs])")

from rollart.env.adapters.openenv import (OpenEnvEnv, OpenEnvServer,  # noqa: E402
                                          observation_text, openenv_calc_task,
                                          tool_result_text)
from rollart.env.adapters.servers.openenv_calc import SERVER_SCRIPT  # noqa: E402
from rollart.env.protocol import ToolEnv, env_tools  # noqa: E402


def _answer(observation: str) -> int:
    a, op, b = observation.split("what is ")[1].split()[:3]
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def _plays_with_tools(env) -> None:
    obs = env.reset(3)
    assert obs.startswith("openenv_calc : what is")
    assert isinstance(env, ToolEnv)
    (tool,) = env_tools(env)
    assert tool["function"]["name"] == "calculate"
    assert tool["function"]["parameters"]["required"] == ["expression"]
    expression = obs.split("what is ")[1].split(" ?")[0]
    assert env.call_tool("calculate", {"expression": expression}) == str(_answer(obs))
    assert env.call_tool("calculate", {"expression": "x"}).startswith(
        "error : cannot evaluate 'x'")
    assert env.call_tool("nope", {}).startswith("error : Unknown tool")
    step = env.step("what do you mean")  # not a number: the env's own invalid answer
    assert not step.done and step.reward < 0 and step.observation.startswith("invalid")
    step = env.step(f"answer {_answer(obs)}")
    assert step.done and step.reward == 1.0 and step.info["success"]
    obs = env.reset(4)
    step = env.step(f"answer {_answer(obs) + 1}")
    assert step.done and step.reward == 0.0 and not step.info["success"]
    assert env.tool_calls == 3


def test_in_process_environment_plays_with_its_mcp_tools():
    env = openenv_calc_task().env_factory()
    try:
        _plays_with_tools(env)
    finally:
        env.close()


def test_over_the_openenv_server_on_localhost():
    with OpenEnvServer(SERVER_SCRIPT) as server:
        assert server.base_url.startswith("http://127.0.0.1:")
        env = OpenEnvEnv(base_url=server.base_url, name="openenv_calc")
        try:
            _plays_with_tools(env)
        finally:
            env.close()
        proc = server.proc
    assert proc.poll() is not None  # the server is stopped with the block


def test_task_and_env_pickle_as_configuration():
    task = pickle.loads(pickle.dumps(openenv_calc_task(max_turns=2)))
    env = task.env_factory()
    env.reset(0)
    clone = pickle.loads(pickle.dumps(env))
    assert clone._env is None and clone._tools is None
    assert clone.reset(0) == env.reset(0)
    env.close(), clone.close()


def test_misconfiguration_says_what_to_give():
    from rollart.env.adapters.servers.openenv_calc import CalcEnvironment

    with pytest.raises(ValueError, match="environment=.*or base_url="):
        OpenEnvEnv()
    with pytest.raises(ValueError, match="needs action_cls="):
        OpenEnvEnv(CalcEnvironment)


def test_observation_and_tool_texts():
    assert observation_text({"prompt": "hi", "n": 3}) == "hi"
    assert observation_text({"a": "x", "b": "y"}) == '{"a": "x", "b": "y"}'
    assert observation_text({"board": [1, 2], "prompt": "p"}, "board") == "[1, 2]"
    assert tool_result_text({"error": {"message": "boom"}}) == "error : boom"
    assert tool_result_text({"result": {"content": [{"type": "text", "text": "7"}],
                                        "is_error": False}}) == "7"
    assert tool_result_text({"result": None}) == "no output"


def test_warmup_episode_calls_the_tool_through_the_chat_format():
    from rollart.chat.conversation import ConversationFormat
    from rollart.testing import CHATML, CHATML_SPECIALS, bpe_tokenizer
    from rollart.trainer.warmup import play_random

    tok = bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    log = play_random(openenv_calc_task(), tok, 4, random.Random(0),
                      ConversationFormat(tok, "chat"))
    text = tok.decode(log.ids)
    call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
    assert call["name"] == "calculate"
    expected = _answer(f"what is {call['arguments']['expression']} ?")
    assert f"<tool_response>\n{expected}\n</tool_response>" in text


@pytest.mark.slow
def test_openenv_graph_trains_two_steps(tmp_path, monkeypatch):
    from graph_runs import train_briefly  # tests/

    calls = []
    real = OpenEnvEnv.call_tool
    monkeypatch.setattr(OpenEnvEnv, "call_tool",
                        lambda self, *a: calls.append(a) or real(self, *a))
    _, result, _ = train_briefly("shared_envs:openenv", tmp_path / "run",
                                 groups_per_step=2, eval_seeds=2, warmup_batch=4,
                                 warmup_bare_tool_steps=2)
    assert calls, "no OpenEnv tool call ran (warm-up episodes call calculate)"
    assert set(result.evaluation["trained"]) == {"openenv_calc"}
