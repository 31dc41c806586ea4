"""MCP tools as a ToolEnv's tools (rollart.env.adapters.mcp): the calculator server's
tools listed and converted, calls and tool errors as text, a dead server as a clear error,
no leaked server process, pickling, the warm-up's chat episode through the tools, and the
graph (graphs/shared_envs.py:mcp) trained for two steps (slow)."""

import json
import pickle
import random
import sys
import time

import pytest

pytest.importorskip("mcp", reason="the MCP adapter needs the mcp SDK (rollart[envs])")
psutil = pytest.importorskip("psutil")

from rollart.env.adapters.mcp import (CALC_SERVER, ArithmeticEnv, MCPClient,  # noqa: E402
                                      MCPServerError, MCPToolEnv, mcp_calc_task)
from rollart.env.protocol import ToolEnv, env_tools  # noqa: E402


def _servers() -> list:
    return [p for p in psutil.Process().children(recursive=True)
            if CALC_SERVER in " ".join(p.cmdline())]


@pytest.fixture
def env():
    env = mcp_calc_task().env_factory()
    yield env
    env.close()


def test_tools_are_listed_and_converted(env):
    assert env.reset(3).startswith("mcp_calc : what is")
    assert isinstance(env, ToolEnv)
    tools = env_tools(env)  # the runner's own check passes
    assert [t["function"]["name"] for t in tools] == ["calculate", "add", "multiply"]
    calc = tools[0]["function"]
    assert calc["description"].startswith("Evaluate an integer")
    assert calc["parameters"]["required"] == ["expression"]
    assert calc["parameters"]["properties"]["expression"]["type"] == "string"


def test_call_round_trip_and_errors_come_back_as_text(env):
    env.reset(0)
    assert env.call_tool("calculate", {"expression": "7 * (8 - 2)"}) == "42"
    assert env.call_tool("add", {"a": 2, "b": 3}) == "5"
    assert env.call_tool("calculate", {"expression": "1 // 0"}) == (
        "error : Error executing tool calculate: division by zero")
    assert env.call_tool("calculate", {"expression": "__import__('os')"}).startswith("error :")
    assert env.call_tool("add", {"a": "x"}).startswith("error : ")  # malformed arguments
    assert env.call_tool("nope", {}) == "error : Unknown tool: nope"
    assert env.tool_calls == 6


def test_a_dead_server_is_a_clear_error(env):
    env.reset(0)
    (proc,) = _servers()
    proc.kill()
    proc.wait(5)
    with pytest.raises(MCPServerError, match="MCP server `python .*servers/mcp_calc.py`"):
        env.call_tool("add", {"a": 1, "b": 2})


def test_a_server_that_cannot_start_says_so():
    client = MCPClient(sys.executable, ["-c", "import sys; sys.exit('no such server')"],
                       timeout=10)
    with pytest.raises(MCPServerError, match="(?s)did not start.*no such server"):
        client.start()


def test_close_stops_the_server_and_a_copy_starts_its_own(env):
    env.reset(1)
    (proc,) = _servers()
    clone = pickle.loads(pickle.dumps(env))  # configuration only: no live server
    assert clone._client is None and clone._inner is None
    env.close()
    proc.wait(10)  # gone, not a zombie of ours
    assert not _servers()
    env.close()  # idempotent
    assert clone.reset(1) == env.reset(1)
    assert len(_servers()) == 2
    clone.close()


def test_the_task_pickles_and_answers_are_scored():
    task = pickle.loads(pickle.dumps(mcp_calc_task(max_turns=2)))
    inner = ArithmeticEnv(max_turns=2)
    obs = inner.reset(5)
    a, op, b = obs.split("what is ")[1].split()[:3]
    right = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert inner.step(f"answer {right}").info["success"]
    inner.reset(5)
    step = inner.step("seven")
    assert step.info["invalid"] and not step.done
    assert isinstance(task.env_factory(), MCPToolEnv)


def test_warmup_episode_calls_the_tool_through_the_chat_format():
    """The format warm-up's episode (rollart.trainer.warmup.play_random) as the chat
    toy's template renders it: the call reached the server, its result came back."""
    from rollart.chat.conversation import ConversationFormat
    from rollart.testing import CHATML, CHATML_SPECIALS, bpe_tokenizer
    from rollart.trainer.warmup import play_random

    tok = bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    task = mcp_calc_task()
    log = play_random(task, tok, 4, random.Random(0), ConversationFormat(tok, "chat"))
    text = tok.decode(log.ids)
    assert '"name": "calculate"' in text
    call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
    expected = str(eval(call["arguments"]["expression"]))
    assert f"<tool_response>\n{expected}\n</tool_response>" in text


@pytest.mark.slow
def test_mcp_graph_trains_two_steps(tmp_path, monkeypatch):
    from graph_runs import train_briefly  # tests/

    calls = []
    real = MCPClient.call
    monkeypatch.setattr(MCPClient, "call", lambda self, *a: calls.append(a) or real(self, *a))
    t0 = time.time()
    train_briefly("shared_envs:mcp", tmp_path / "run", groups_per_step=2, eval_seeds=2,
                  warmup_batch=4, warmup_bare_tool_steps=2)
    assert calls, "no MCP tool call ran (warm-up episodes call calculate)"
    assert not _servers(), f"leaked MCP servers after {time.time() - t0:.0f}s"
