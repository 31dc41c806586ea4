"""Tool calls in model text: parse the Hermes/Qwen format, check calls against schemas.

A chat model asks for a tool by writing, inside its assistant turn::

    <tool_call>
    {"name": "python", "arguments": {"code": "6 * 7"}}
    </tool_call>

(the format of Qwen2.5's and Hermes' chat templates; several calls may follow each
other). ``parse_tool_calls(text)`` returns one ``ToolCall`` or ``ToolError`` per
``<tool_call>`` block, never raising: malformed JSON, a missing name, arguments that are
not an object (a JSON *string* holding an object is accepted, as OpenAI-style APIs send
it) and an unclosed tag each become a ``ToolError`` whose message is what the model is
shown. ``check_call(call, tools)`` checks a parsed call against the env's declared tools
(OpenAI-style ``{"type": "function", "function": {"name", "description",
"parameters"}}`` dicts; ``parameters`` is a JSON schema, checked with ``jsonschema``).
``format_tool_call`` writes a call the way the templates render one (used by warm-up
actions). Consumed by the trajectory runner's tool turn and by tool-using envs
(``rollart.env.adapters.tool``); the env side of the contract is in
``rollart.env.protocol``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's ``name`` and its ``arguments`` (a dict)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolError:
    """A call that cannot run; ``message`` is returned to the model as the tool result."""

    message: str


def has_tool_call(text: str) -> bool:
    """Whether ``text`` contains a tool-call opening tag.

    >>> has_tool_call('<tool_call>{"name": "f", "arguments": {}}</tool_call>'), has_tool_call("42")
    (True, False)
    """
    return OPEN in text


def parse_tool_calls(text: str) -> list[ToolCall | ToolError]:
    """Every ``<tool_call>…</tool_call>`` block of ``text``, in order; ``[]`` if none.

    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    [ToolCall(name='f', arguments={'x': 1})]
    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}')
    [ToolError(message='tool call not closed: end it with </tool_call>')]
    """
    calls: list[ToolCall | ToolError] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            return calls
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        nested = text.find(OPEN, body_start)
        if end < 0 or 0 <= nested < end:
            calls.append(ToolError(f"tool call not closed: end it with {CLOSE}"))
            if end < 0:
                return calls
            pos = nested
            continue
        calls.append(_parse_one(text[body_start:end]))
        pos = end + len(CLOSE)


def strip_tool_calls(text: str) -> str:
    """``text`` without its tool-call blocks, stripped.

    >>> strip_tool_calls('let me see <tool_call>{"name": "f"}</tool_call>')
    'let me see'
    """
    out, pos = [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        out.append(text[pos:start])
        end = text.find(CLOSE, start)
        if end < 0:
            return "".join(out).strip()
        pos = end + len(CLOSE)
    out.append(text[pos:])
    return "".join(out).strip()


def _parse_one(body: str) -> ToolCall | ToolError:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        msg = getattr(e, "msg", type(e).__name__)
        return ToolError(f"tool call is not valid JSON ({msg}): write "
                         '{"name": <tool name>, "arguments": {...}}')
    if not isinstance(obj, dict):
        return ToolError(f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolError('tool call has no "name" (a non-empty string)')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI-style: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ToolError(f"tool {name!r}: arguments string is not valid JSON")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolError(f'tool {name!r}: "arguments" must be a JSON object, '
                         f"got {type(args).__name__}")
    return ToolCall(name, args)


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


def format_tool_call(name: str, arguments: dict) -> str:
    """A call as Qwen2.5-style templates render it (and as a model should write it).

    >>> format_tool_call("python", {"code": "6 * 7"})
    '<tool_call>\\n{"name": "python", "arguments": {"code": "6 * 7"}}\\n</tool_call>'
    """
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


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
