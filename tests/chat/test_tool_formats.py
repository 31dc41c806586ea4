"""Tool-call formats per model family (``rollart.chat.tool_formats``): each family's chat
template (a small one written here in that family's style: how it renders ``tools=`` and
assistant ``tool_calls``) is recognised; well-formed, several and malformed calls parse
(malformed ones as ``ToolError``, never an exception); ``format`` writes what the
template renders and ``parse`` reads it back; ``content`` drops the calls; qwen3_coder
types its values by the tool's schema; ``Task.tool_format`` is checked; and a tool turn
in each non-hermes format reaches ``env.call_tool`` in the trajectory runner."""

import json
import pickle
import random

import pytest

from rollart.env.adapters.tool import CalcToolEnv, calc_tool_task
from rollart.chat.conversation import ConversationFormat
from rollart.env.tasks import Task
from rollart.chat.template_support import tools_header, tools_prompt
from rollart.chat.tool_formats import (TOOL_FORMATS, ToolCall, ToolError, detect_tool_format,
                                      get_tool_format, tool_format_of)
from rollart.chat.tools import (check_call, check_calls, format_tool_call, function_tool,
                               has_tool_call, parse_tool_calls, python_tool, tool_calls)
from rollart.env.trajectory import TrajectoryRunner
from rollart.testing import ADD_TOOL, CHATML, bpe_tokenizer, play_episode
from rollart.types import GenResult
from test_conversation import AddEnv  # tests/chat/
from tool_families import FAMILIES  # tests/

TOOLS = [ADD_TOOL, python_tool(),
         function_tool("move", "Move on the grid.",
                       {"direction": {"type": "string"}, "steps": {"type": "integer"},
                        "fast": {"type": "boolean"}, "speed": {"type": "number"},
                        "path": {"type": "array", "items": {"type": "string"}},
                        "opts": {"type": "object"}}, required=("direction",))]



@pytest.fixture(scope="module")
def tokenizers():
    out = {}
    for name, (template, specials, eos) in FAMILIES.items():
        tok = bpe_tokenizer(specials, template, eos=eos)
        if "<s>" in specials:
            tok.bos_token = "<s>"
        out[name] = tok
    return out


def assistant_turn(tok, calls: list[tuple[str, dict]]) -> str:
    """What the template renders for an assistant turn making ``calls``."""
    user = [{"role": "user", "content": "what is 2 plus 3 ?"}]
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    prompt = tok.apply_chat_template(user, tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    full = tok.apply_chat_template(user + [msg], tools=TOOLS, tokenize=False)
    if not full.startswith(prompt):  # mistral's prompt has no generation prompt
        prompt = tok.apply_chat_template(user, tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt):]


# -- detection ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_familys_template_is_detected(name, tokenizers):
    assert detect_tool_format(FAMILIES[name][0]) == name
    assert ConversationFormat(tokenizers[name], "chat").tool_format == name


@pytest.mark.parametrize("template, name", [
    (None, "hermes"), ("", "hermes"), (CHATML, "hermes"),  # CHATML shows no tool syntax
    ("{{ '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3"),
    ("[AVAILABLE_TOOLS] [TOOL_CALLS]{{ name }}[ARGS]{{ args | tojson }}", "mistral"),
])
def test_detection_of_other_template_text(template, name):
    assert detect_tool_format(template) == name


def test_raw_mode_is_hermes_and_the_task_overrides_the_template(tokenizers):
    raw = ConversationFormat(tokenizers["llama3"], "raw")
    assert raw.tool_format == "hermes"
    chat = ConversationFormat(tokenizers["llama3"], "chat")
    task = Task("t", AddEnv, _reward, max_turns=2)
    assert tool_format_of(chat, task) == "llama3"
    assert tool_format_of(chat, Task("t", AddEnv, _reward, 2, tool_format="mistral")) == (
        "mistral")


# -- the template's rendering: format() writes it, parse() reads it ---------------------
CALLS = [("add", {"a": 2, "b": 3}), ("python", {"code": "print('a;b')\n6 * 7"}),
         ("move", {"direction": "up", "steps": 2, "path": ["l", "r"], "opts": {"x": 1}})]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_format_is_what_the_template_renders_and_parses_back(name, tokenizers):
    fmt = get_tool_format(name)
    tok = tokenizers[name]
    for call in CALLS:
        rendered = assistant_turn(tok, [call])
        assert fmt.format(*call) in rendered, rendered
        assert fmt.parse(rendered, TOOLS) == [ToolCall(*call)]
        assert fmt.has_call(rendered)
        assert fmt.parse(fmt.format(*call), TOOLS) == [ToolCall(*call)]
        assert parse_tool_calls(format_tool_call(*call, fmt=name), name, TOOLS) == [
            ToolCall(*call)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_several_calls_in_one_turn(name, tokenizers):
    fmt = get_tool_format(name)
    two = CALLS[:2]
    if name != "llama3":  # Llama-3.1's template renders one call per turn
        rendered = assistant_turn(tokenizers[name], two)
        assert fmt.parse(rendered, TOOLS) == [ToolCall(*c) for c in two]
    joined = {"hermes": "\n", "llama3": "; ", "mistral": "", "qwen3_coder": "\n"}[name]
    text = joined.join(fmt.format(*c) for c in two)
    if name == "mistral":  # one [TOOL_CALLS] per call, the newer templates' way
        text = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in two)
    assert fmt.parse(text, TOOLS) == [ToolCall(*c) for c in two]


def test_call_variants_python_tag_lines_arguments_lists_and_call_ids():
    fmt = get_tool_format("llama3")
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}\n'
            '{"name": "add", "arguments": {"a": 3, "b": 4}}')
    assert fmt.parse(text) == [ToolCall("add", {"a": 1, "b": 2}),
                               ToolCall("add", {"a": 3, "b": 4})]
    # a list of calls in one mistral [TOOL_CALLS]
    text = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "f"}]'
    assert get_tool_format("mistral").parse(text) == [ToolCall("add", {"a": 1}),
                                                      ToolCall("f", {})]
    text = '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1}[TOOL_CALLS] f {"b": 2}'
    assert get_tool_format("mistral").parse(text) == [ToolCall("add", {"a": 1}),
                                                      ToolCall("f", {"b": 2})]


@pytest.mark.parametrize("name, text, content", [
    ("hermes", 'Let me add. <tool_call>{"name": "add"}</tool_call> ok', "Let me add.  ok"),
    ("llama3", 'I will add.\n{"name": "add", "parameters": {}}', "I will add."),
    ("llama3", 'Sure <|python_tag|>{"name": "add", "parameters": {}}', "Sure"),
    ("mistral", 'Adding. [TOOL_CALLS] [{"name": "add", "arguments": {}}]', "Adding."),
    ("qwen3_coder", "Hm.\n<tool_call>\n<function=add>\n</function>\n</tool_call>\n", "Hm."),
    ("qwen3_coder", "  just text  ", "just text"),
])
def test_content_is_the_text_without_its_calls(name, text, content):
    assert get_tool_format(name).content(text) == content


@pytest.mark.parametrize("name, text", [
    ("llama3", '{"answer": 5}'), ("llama3", "the answer is 5"),
    ("llama3", 'I would write {"name": "add"} here'),  # not at a line's start
    ("mistral", '[{"name": "add", "arguments": {}}]'), ("hermes", "5"),
    ("qwen3_coder", "<function=add></function>"),
])
def test_text_without_a_call_is_no_call(name, text):
    fmt = get_tool_format(name)
    assert not fmt.has_call(text) and fmt.parse(text) == [] and not has_tool_call(text, name)


# -- malformed calls: errors the model reads, never exceptions ---------------------------
@pytest.mark.parametrize("name, text, message", [
    ("hermes", '<tool_call>{"name": "add", "arguments": {</tool_call>', "not valid JSON"),
    ("hermes", '<tool_call>{"name": "add"}', "not closed"),
    ("llama3", '{"name": "add", "parameters": {"a": 1,', "not valid JSON"),
    ("llama3", '{"name": "add", "parameters": [1]}', '"parameters" must be a JSON object'),
    ("llama3", '{"name": "", "parameters": {}}', 'no "name"'),
    ("llama3", '<|python_tag|>brave_search.call(query="x")', "must be a JSON object"),
    ("llama3", "<|python_tag|>", "must be a JSON object"),
    ("llama3", '{"name": "f", "parameters": ' + "[" * 100_000, "not valid JSON"),
    ("mistral", "[TOOL_CALLS]", "no call after it"),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": ', "not valid JSON"),
    ("mistral", "[TOOL_CALLS] []", "empty list"),
    ("mistral", "[TOOL_CALLS] [1]", "must be a JSON object"),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1', "not valid JSON"),
    ("mistral", "[TOOL_CALLS]!! add", "cannot read the call"),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]', 'no "name"'),
    ("qwen3_coder", "<tool_call>\n<function=add>\n", "not closed"),
    ("qwen3_coder", '<tool_call>{"name": "add"}</tool_call>', "no <function=NAME>"),
    ("qwen3_coder", "<tool_call><function=add><parameter=a>1</function></tool_call>",
     "cannot read its parameters"),
    ("qwen3_coder", "<tool_call><function=>\n</function></tool_call>", "empty function"),
])
def test_malformed_calls_are_errors_with_a_message(name, text, message):
    fmt = get_tool_format(name)
    assert fmt.has_call(text)
    out = fmt.parse(text, TOOLS)
    assert out and isinstance(out[0], ToolError) and message in out[0].message, out


def test_a_bad_call_does_not_hide_the_good_ones_after_it():
    llama = '{"name": "add", "parameters": {"a": 1, "b": 2}}\n{"name": oops}\n' \
            '{"name": "add", "parameters": {"a": 3, "b": 4}}'
    good, bad, good2 = get_tool_format("llama3").parse(llama)
    assert good == ToolCall("add", {"a": 1, "b": 2}) and isinstance(bad, ToolError)
    assert good2 == ToolCall("add", {"a": 3, "b": 4})
    mistral = '[TOOL_CALLS]add[ARGS]{"a": [TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
    bad, good = get_tool_format("mistral").parse(mistral)
    assert isinstance(bad, ToolError) and good == ToolCall("add", {"a": 1, "b": 2})


# -- qwen3_coder's values, typed by the schema --------------------------------------------
def test_qwen3_coder_values_take_their_schema_types():
    fmt = get_tool_format("qwen3_coder")
    text = ("<tool_call>\n<function=move>\n<parameter=direction>\nup\n</parameter>\n"
            "<parameter=steps>\n3\n</parameter>\n<parameter=fast>\nTrue\n</parameter>\n"
            "<parameter=speed>\n1.5\n</parameter>\n<parameter=path>\n[\"l\", \"r\"]\n"
            "</parameter>\n<parameter=opts>\n{\"x\": null}\n</parameter>\n"
            "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>")
    (call,) = fmt.parse(text, TOOLS)
    assert call.arguments == {"direction": "up", "steps": 3, "fast": True, "speed": 1.5,
                              "path": ["l", "r"], "opts": {"x": None},
                              "extra": "7"}  # not in the schema: stays text
    (untyped,) = fmt.parse(text)  # without tools: text
    assert untyped.arguments["steps"] == "3"
    # a string parameter keeps digits and multi-line text as written
    code = fmt.format("python", {"code": "x = 1\nprint(x)"})
    assert fmt.parse(code, TOOLS) == [ToolCall("python", {"code": "x = 1\nprint(x)"})]
    assert fmt.parse(fmt.format("python", {"code": "42"}), TOOLS)[0].arguments == {
        "code": "42"}


def test_a_qwen3_coder_value_of_the_wrong_type_is_reported_by_check_call():
    fmt = get_tool_format("qwen3_coder")
    (call,) = fmt.parse(fmt.format("move", {"direction": "up", "steps": "many"}), TOOLS)
    assert call.arguments["steps"] == "many"
    err = check_call(call, TOOLS)
    assert isinstance(err, ToolError) and "'many' is not of type 'integer'" in err.message


# -- names and tasks ---------------------------------------------------------------------
def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3, mistral, qwen3_coder"):
        get_tool_format("nope")
    with pytest.raises(ValueError, match="nope"):
        parse_tool_calls("x", "nope")


def _reward(ep):
    return 0.0


def test_task_tool_format_is_checked():
    with pytest.raises(ValueError, match="tool_format must be one of hermes, llama3, "
                                         "mistral, qwen3_coder or None"):
        Task("t", AddEnv, _reward, max_turns=2, tool_format="nope")
    assert Task("t", AddEnv, _reward, max_turns=2, tool_format="qwen3_coder").tool_format


def test_tools_in_prompt_names_the_tasks_syntax():
    assert "<tool_call>" in tools_header() and "parameters" in tools_header("llama3")
    assert tools_prompt([ADD_TOOL], None, "mistral").startswith(
        tools_header("mistral"))
    assert "[TOOL_CALLS]" in tools_header("mistral")
    assert "<function=NAME>" in tools_header("qwen3_coder")


@pytest.mark.parametrize("name", [n for n in TOOL_FORMATS if n != "hermes"])
def test_calc_task_warms_up_in_its_format_and_its_env_reads_it(name):
    task = calc_tool_task(tool_format=name)
    assert task.tool_format == name
    task = pickle.loads(pickle.dumps(task))
    action = task.warmup_action(random.Random(0), "calc : what is 3 * 4 ? use python")
    (call,) = tool_calls(action, name, [python_tool()])
    assert call == ToolCall("python", {"code": "3 * 4"})
    assert check_calls([call], [python_tool()]) == [call]
    env = task.env_factory()
    assert isinstance(env, CalcToolEnv) and env.tool_format == name
    env.reset(3)
    obs, reward, done, info = env._step(action)  # raw mode: step runs the call
    assert info["role"] == "tool" and info["tool_ok"] and obs == "tool : 12 . act :"
    env.close()


# -- a tool turn in the trajectory runner ------------------------------------------------
class RecordingAddEnv(AddEnv):
    """``AddEnv`` that keeps the calls that reached it."""

    def __init__(self):
        self.calls = []

    def call_tool(self, name, arguments):
        self.calls.append((name, arguments))
        return super().call_tool(name, arguments)


class ScriptedProxy:
    """Generates the given texts in turn (as the policy would, ending with ``stop``)."""

    def __init__(self, tok, texts, stop):
        self.tok, self.texts, self.stop = tok, list(texts), stop

    async def generate(self, traj_id, req, pools, task=None):
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.stop]
        return GenResult(ids, [0.0] * len(ids), [0] * len(ids), "stop")

    def release(self, traj_id):
        pass


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "hermes"])
def test_a_tool_turn_in_the_templates_format_reaches_call_tool(name, tokenizers):
    tok = tokenizers[name]
    call = get_tool_format(name).format("add", {"a": 2, "b": 3})
    envs = []

    def factory():
        envs.append(RecordingAddEnv())
        return envs[-1]

    task = Task("add", factory, _reward, max_turns=3, max_new_tokens=60)
    proxy = ScriptedProxy(tok, [call, "5"], tok.convert_tokens_to_ids(FAMILIES[name][2]))
    runner = TrajectoryRunner(proxy, tok, conversation="chat", max_context=1024)
    assert runner.format.tool_format == name
    ep, log = play_episode(runner, task)
    assert envs[0].calls == [("add", {"a": 2, "b": 3})]  # typed: qwen3_coder's "2" is 2
    assert ep.info["tool_calls"] == 1 and ep.info["invalid_tool_calls"] == 0
    assert ep.actions == ["5"] and ep.info["success"]
    text = tok.decode(log.ids, skip_special_tokens=False)
    assert call in text  # the call kept verbatim, its result rendered as a tool message
    assert runner.counts["tool_turns"] == 1


def test_a_task_format_overrides_the_templates_in_the_runner(tokenizers):
    """A mistral call under a llama3 template is text (the env's action) when the task
    says nothing, and a call when the task says mistral."""
    tok = tokenizers["llama3"]
    stop = tok.convert_tokens_to_ids("<|eot_id|>")
    mistral_call = format_tool_call("add", {"a": 2, "b": 3}, "mistral")
    results = {}
    for fmt_name in (None, "mistral"):
        task = Task("add", RecordingAddEnv, _reward, max_turns=3, max_new_tokens=60,
                    tool_format=fmt_name)
        runner = TrajectoryRunner(ScriptedProxy(tok, [mistral_call, "5"], stop), tok,
                                  conversation="chat", max_context=1024)
        ep, _ = play_episode(runner, task)
        results[fmt_name] = ep.info.get("tool_calls", 0)
    assert results == {None: 0, "mistral": 1}
