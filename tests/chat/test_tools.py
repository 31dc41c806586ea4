"""rollart.chat.tools (tool-call parsing and checking, a generation's calls as rollout,
warm-up and evaluation handle them) and the calc task's python tool."""

import json
import pickle
import random

import pytest

from rollart.env.adapters.tool import (
    CalcToolEnv,
    calc_hermes_warmup_action,
    calc_tool_task,
)
from rollart.env.protocol import EnvOutputError, ToolEnv, check_tool_result, env_tools
from rollart.chat.tools import (
    ToolCall,
    ToolError,
    check_call,
    check_calls,
    format_tool_call,
    function_tool,
    parse_tool_calls,
    python_tool,
    tool_calls,
)

TOOLS = [python_tool(),
         function_tool("move", "Move on the grid.",
                       {"direction": {"type": "string", "enum": ["up", "down"]},
                        "steps": {"type": "integer"}}, required=("direction",))]


def call(body) -> str:
    return f"<tool_call>{body if isinstance(body, str) else json.dumps(body)}</tool_call>"


# -- parsing ----------------------------------------------------------------------------
def test_well_formed_call_with_text_around():
    text = "Let me compute.\n" + format_tool_call("python", {"code": "6 * 7"}) + "\nthanks"
    assert parse_tool_calls(text) == [ToolCall("python", {"code": "6 * 7"})]
    assert parse_tool_calls("the answer is 42") == []


def test_several_calls_in_order_and_bad_ones_do_not_hide_good_ones():
    text = (call({"name": "python", "arguments": {"code": "1"}}) + " and "
            + call("{not json") + call({"name": "move", "arguments": {"direction": "up"}}))
    out = parse_tool_calls(text)
    assert out[0] == ToolCall("python", {"code": "1"})
    assert isinstance(out[1], ToolError) and "not valid JSON" in out[1].message
    assert out[2] == ToolCall("move", {"direction": "up"})


@pytest.mark.parametrize("body, message", [
    ("{\"name\": \"python\", \"arguments\": {", "not valid JSON"),
    ({"arguments": {"code": "1"}}, 'no "name"'),
    ({"name": "", "arguments": {}}, 'no "name"'),
    ({"name": 3, "arguments": {}}, 'no "name"'),
    ([1, 2], "must be a JSON object"),
    ({"name": "python", "arguments": [1]}, '"arguments" must be a JSON object'),
    ({"name": "python", "arguments": "{broken"}, "arguments string is not valid JSON"),
    ({"name": "python", "arguments": "[1]"}, '"arguments" must be a JSON object'),
    ("[" * 100_000, "not valid JSON"),  # deep nesting: an error, not a RecursionError
])
def test_each_malformed_kind_is_an_error_not_an_exception(body, message):
    (out,) = parse_tool_calls(call(body))
    assert isinstance(out, ToolError) and message in out.message, out


def test_arguments_as_a_json_string_and_missing_arguments():
    args = json.dumps({"code": "2 + 2"})
    assert parse_tool_calls(call({"name": "python", "arguments": args})) == [
        ToolCall("python", {"code": "2 + 2"})]
    assert parse_tool_calls(call({"name": "python"})) == [ToolCall("python", {})]


def test_unclosed_tags():
    assert parse_tool_calls('<tool_call>{"name": "python"}') == [
        ToolError("tool call not closed: end it with </tool_call>")]
    # an opening tag before the previous one closed: that one is unclosed, the next parses
    text = "<tool_call>{\"name\": \"a\"" + call({"name": "python", "arguments": {}})
    first, second = parse_tool_calls(text)
    assert isinstance(first, ToolError) and "not closed" in first.message
    assert second == ToolCall("python", {})


# -- checking ---------------------------------------------------------------------------
def test_check_call_accepts_a_call_that_fits():
    ok = ToolCall("move", {"direction": "down", "steps": 2})
    assert check_call(ok, TOOLS) is ok
    assert check_call(ToolCall("move", {"direction": "up"}), TOOLS).name == "move"


@pytest.mark.parametrize("bad, message", [
    (ToolCall("shell", {"cmd": "ls"}), "unknown tool 'shell'; available: move, python"),
    (ToolCall("python", {}), "'code' is a required property"),
    (ToolCall("python", {"code": 7}), "at code: 7 is not of type 'string'"),
    (ToolCall("python", {"code": "1", "timeout": 3}), "Additional properties"),
    (ToolCall("move", {"direction": "left"}), "is not one of"),
    (ToolCall("move", {"direction": "up", "steps": "2"}), "is not of type 'integer'"),
])
def test_check_call_rejects(bad, message):
    out = check_call(bad, TOOLS)
    assert isinstance(out, ToolError) and message in out.message, out


def test_check_call_passes_parse_errors_through_and_knows_no_tools():
    err = ToolError("x")
    assert check_call(err, TOOLS) is err
    assert check_call(ToolCall("python", {"code": "1"}), []).message.endswith("available: none")


# -- a generation's calls: parsed and checked (rollout, warm-up and evaluation) ---------
def test_tool_calls_and_check_calls_keep_order_and_turn_errors_into_text():
    text = ("first " + format_tool_call("python", {"code": "1 + 1"})
            + call({"name": "shell", "arguments": {"cmd": "ls"}})
            + call("{not json") + format_tool_call("move", {"direction": "up"}))
    calls = tool_calls(text, "hermes", TOOLS)
    assert len(calls) == 4 and isinstance(calls[2], ToolError)
    ok, unknown, malformed, move = check_calls(calls, TOOLS)
    assert ok == ToolCall("python", {"code": "1 + 1"}) and move == ToolCall("move", {
        "direction": "up"})
    assert unknown == "error : unknown tool 'shell'; available: move, python"
    assert malformed.startswith("error : ") and malformed[len("error : "):] == calls[2].message
    assert tool_calls("no call here", "hermes", TOOLS) == [] and check_calls([], TOOLS) == []


def test_check_calls_does_not_prefix_an_error_twice_and_reads_other_formats():
    assert check_calls([ToolError("Error: the sandbox is down")], TOOLS) == [
        "Error: the sandbox is down"]
    llama = format_tool_call("python", {"code": "6 * 7"}, "llama3")
    assert check_calls(tool_calls(llama, "llama3", TOOLS), TOOLS) == [
        ToolCall("python", {"code": "6 * 7"})]


def test_the_runner_path_still_exports_them():
    from rollart.env import trajectory

    assert trajectory.tool_calls is tool_calls and trajectory.check_calls is check_calls


# -- the env side -----------------------------------------------------------------------
def test_env_tools_checks_declarations():
    env = CalcToolEnv()
    assert isinstance(env, ToolEnv) and env_tools(env) == [python_tool()]

    class NoCall:
        tools = [python_tool()]

    class BadEntry:
        tools = [{"name": "python"}]

        def call_tool(self, name, arguments):
            return ""

    with pytest.raises(EnvOutputError, match="no call_tool"):
        env_tools(NoCall())
    with pytest.raises(EnvOutputError, match=r"tools\[0\] is not a tool declaration"):
        env_tools(BadEntry())
    assert env_tools(object()) == []
    with pytest.raises(EnvOutputError, match="expected a str result"):
        check_tool_result(42, env, "python")


def test_calc_call_tool_runs_the_sandbox():
    env = CalcToolEnv()
    obs = env.reset(5)
    question = obs.split("what is ")[1].split(" ?")[0]
    assert env.call_tool("python", {"code": question}) == str(eval(question))
    assert env.call_tool("python", {"code": "import os; print(os.getpid() != 0)"}) == "True"
    assert env.call_tool("python", {"code": "1 / 0"}) == "error ZeroDivisionError: division by zero"
    assert env.call_tool("python", {"code": "x = 1"}) == "no output"
    assert env.call_tool("python", {"code": 1}).startswith("error : tool 'python': bad")
    assert env.tool_calls == 4  # the rejected call never ran
    step = env.step(f"answer {eval(question)}")  # the final answer goes through step
    assert step.done and step.info["success"] and step.reward == 1.0


def test_calc_final_answers_and_invalid_text():
    env = CalcToolEnv()
    obs = env.reset(8)
    truth = eval(obs.split("what is ")[1].split(" ?")[0])
    assert env.step(str(truth)).info["success"]  # a bare number is an answer too
    env.reset(8)
    bad = env.step("I think so")
    assert bad.info["invalid"] and bad.reward < 0 and not bad.done
    assert env.step(f"answer {truth + 1}").info["success"] is False


def test_calc_runs_a_tool_call_in_step_when_nobody_else_did():
    """Raw mode has no runner tool turn: ``step`` runs the ``<tool_call>`` itself."""
    env = CalcToolEnv()
    env.reset(3)
    step = env.step(format_tool_call("python", {"code": "3 * 4"}))
    assert step.observation == "tool : 12 . act :" and step.info["role"] == "tool"
    assert not step.info["invalid"] and step.reward == 0.0
    step = env.step(call({"name": "shell", "arguments": {}}))
    assert step.info["invalid"] and "unknown tool 'shell'" in step.observation


def test_hermes_warmup_action_parses_as_a_valid_call():
    task = calc_tool_task(tool_format="hermes")
    env = task.env_factory()
    rng = random.Random(0)
    for seed in range(40):  # the question in view: always its call, well-formed and right
        obs = env.reset(seed)
        (one,) = parse_tool_calls(task.warmup_action(rng, obs))
        assert check_call(one, env_tools(env)) == one
        question = obs.split("what is ")[1].split(" ?")[0]
        assert env.call_tool(one.name, one.arguments) == str(eval(question))
    # after a tool result the answer copies it half the time: the baseline RL must beat
    after = [task.warmup_action(rng, "56") for _ in range(200)]
    assert set(after) <= {f"answer {n}" for n in range(-8, 82)}
    assert 70 < after.count("answer 56") < 130
    assert task.warmup_action is calc_hermes_warmup_action and task.max_new_tokens == 48
    assert calc_tool_task().max_new_tokens == 5  # the text format stays the default
    with pytest.raises(ValueError, match="tool_format"):
        calc_tool_task(tool_format="json")


def test_calc_env_pickles_with_its_tools():
    env = pickle.loads(pickle.dumps(calc_tool_task(tool_format="hermes").env_factory()))
    env.reset(1)
    assert env_tools(env) == [python_tool()]


def test_doctests():
    import doctest

    from rollart.chat import tools
    from rollart.env.adapters import tool

    for mod in (tools, tool):
        assert doctest.testmod(mod).failed == 0, mod.__name__
