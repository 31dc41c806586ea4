"""Tool calls in model text: parse them in the model's format, check them against schemas.

A chat model asks for a tool by writing a call in its family's syntax inside its
assistant turn; Qwen2.5's and Hermes' templates (the default, ``"hermes"``) write::

    <tool_call>
    {"name": "python", "arguments": {"code": "6 * 7"}}
    </tool_call>

(several calls may follow each other; the other families, ``llama3``, ``mistral`` and
``qwen3_coder``, are in ``rollart.chat.tool_formats``). ``parse_tool_calls(text, fmt)``
returns one ``ToolCall`` or ``ToolError`` per call, never raising: malformed JSON, a
missing name, arguments that are not an object (a JSON *string* holding an object is
accepted, as OpenAI-style APIs send it) and an unclosed tag each become a ``ToolError``
whose message is what the model is shown. ``check_call(call, tools)`` checks a parsed
call against the env's declared tools (OpenAI-style ``{"type": "function", "function":
{"name", "description", "parameters"}}`` dicts; ``parameters`` is a JSON schema, checked
with ``jsonschema``). ``format_tool_call`` writes a call the way the templates render one
(used by warm-up actions). ``tool_calls(text, fmt, tools)`` and ``check_calls(calls,
tools)`` are a generation's calls as rollout, the warm-up and evaluation all handle them
(one rule): parsed, then each either the ``ToolCall`` to run or, when invalid, the error
text the model reads back in its ``tool`` message. Consumed by the trajectory runner's
tool turn (``rollart.env.trajectory``), the trainer's warm-up, held-out evaluation and
tool-using envs (``rollart.env.adapters.tool``); the env side of the contract is in
``rollart.env.protocol``.
"""

from __future__ import annotations

import jsonschema

from rollart.chat.tool_formats import ToolCall, ToolError, ToolFormat, get_tool_format

__all__ = ["ToolCall", "ToolError", "check_call", "check_calls", "format_tool_call",
           "function_tool", "has_tool_call", "parse_tool_calls", "python_tool", "tool_calls"]


def has_tool_call(text: str, fmt: str | ToolFormat = "hermes") -> bool:
    """Whether ``text`` holds a call in format ``fmt`` (a tool-call opening tag, for
    hermes).

    >>> has_tool_call('<tool_call>{"name": "f", "arguments": {}}</tool_call>'), has_tool_call("42")
    (True, False)
    """
    return get_tool_format(fmt).has_call(text)


def parse_tool_calls(text: str, fmt: str | ToolFormat = "hermes",
                     tools=None) -> list[ToolCall | ToolError]:
    """Every call of ``text`` in format ``fmt``, in order; ``[]`` if none. ``tools``
    (the env's declarations) types the text values of ``qwen3_coder`` calls.

    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    [ToolCall(name='f', arguments={'x': 1})]
    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}')
    [ToolError(message='tool call not closed: end it with </tool_call>')]
    >>> parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', "llama3")
    [ToolCall(name='f', arguments={'x': 1})]
    """
    return get_tool_format(fmt).parse(text, tools)


def _function(tool: dict) -> dict:
    return tool.get("function", tool) if isinstance(tool, dict) else {}


def check_call(call: ToolCall | ToolError, tools) -> ToolCall | ToolError:
    """``call`` if it names one of ``tools`` and its arguments fit that tool's
    ``parameters`` schema, else a ``ToolError`` saying what is wrong.

    >>> tools = [python_tool()]
    >>> check_call(ToolCall("python", {"code": "1"}), tools)
    ToolCall(name='python', arguments={'code': '1'})
    >>> check_call(ToolCall("shell", {}), tools).message
    "unknown tool 'shell'; available: python"
    """
    if isinstance(call, ToolError):
        return call
    by_name = {_function(t).get("name"): _function(t) for t in tools or ()}
    spec = by_name.get(call.name)
    if spec is None:
        known = ", ".join(sorted(n for n in by_name if isinstance(n, str))) or "none"
        return ToolError(f"unknown tool {call.name!r}; available: {known}")
    schema = spec.get("parameters") or {"type": "object"}
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(call.arguments), key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].path)
        return ToolError(f"tool {call.name!r}: bad arguments"
                         f"{' at ' + where if where else ''}: {errors[0].message}"[:300])
    return call


def tool_calls(text: str, fmt: str | ToolFormat = "hermes", tools=None) -> list:
    """The tool calls (``ToolCall`` / ``ToolError``) in an assistant text written in
    tool format ``fmt`` (``rollart.chat.tool_formats``; ``tools`` types qwen3_coder's
    text values).

    >>> tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    [ToolCall(name='f', arguments={})]
    """
    return list(parse_tool_calls(text, fmt, tools))


def check_calls(calls, tools) -> list:
    """Each call checked against ``tools``: the ``ToolCall`` to run, or for an invalid
    one (malformed, unknown tool, bad arguments) the error text the model reads. Shared
    by rollout, the warm-up and evaluation.

    >>> ok, bad = check_calls([ToolCall("python", {"code": "1"}), ToolCall("shell", {})],
    ...                       [python_tool()])
    >>> ok
    ToolCall(name='python', arguments={'code': '1'})
    >>> bad
    "error : unknown tool 'shell'; available: python"
    """
    out = []
    for call in calls:
        checked = check_call(call, tools)
        if isinstance(checked, ToolError):
            msg = checked.message
            out.append(msg if msg.lower().startswith("error") else f"error : {msg}")
        else:
            out.append(checked)
    return out


def format_tool_call(name: str, arguments: dict, fmt: str | ToolFormat = "hermes") -> str:
    """A call as the templates of format ``fmt`` render it (and as a model should write
    it).

    >>> format_tool_call("python", {"code": "6 * 7"})
    '<tool_call>\\n{"name": "python", "arguments": {"code": "6 * 7"}}\\n</tool_call>'
    >>> format_tool_call("python", {"code": "6 * 7"}, "mistral")
    '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "6 * 7"}}]'
    """
    return get_tool_format(fmt).format(name, arguments)


def function_tool(name: str, description: str, properties: dict,
                  required: tuple[str, ...] | None = None) -> dict:
    """An OpenAI-style tool dict whose parameters are an object of ``properties``
    (all required unless ``required`` says otherwise; no other keys allowed)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": dict(properties),
                       "required": list(properties if required is None else required),
                       "additionalProperties": False}}}


def python_tool() -> dict:
    """The sandboxed Python tool's declaration (``rollart.env.adapters.tool``)."""
    return function_tool("python", "Run Python code in a sandbox and return what it "
                         "prints (a lone expression's value is printed).",
                         {"code": {"type": "string", "description": "Python source"}})
