"""Tool calls as each model family writes them: parse, detect, write.

Consumes an assistant turn's text (and, for value types, the env's declared tools);
produces ``ToolCall`` / ``ToolError`` records, never raising: a malformed call becomes a
``ToolError`` whose message is what the model is shown. One ``ToolFormat`` per family:

* ``hermes`` (Qwen2.5, Hermes, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call;
* ``llama3`` (Llama-3.1/3.2 JSON tool calls): ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` accepted too) as the turn, or after ``<|python_tag|>``; several calls
  separated by ``;`` or newlines;
* ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or the newer
  templates' ``[TOOL_CALLS]name[ARGS]{...}`` (one ``[TOOL_CALLS]`` per call);
* ``qwen3_coder`` (Qwen3-Coder's XML): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>
  \\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``. Values are text; ``parse``
  given ``tools`` turns a value into the JSON type its parameter's schema declares
  (integer, number, boolean, object, array, null: the value read as JSON; a value that
  does not read stays a string, so ``check_call`` reports the type error). Without
  ``tools`` values stay strings. The conversion lives here, not in ``check_call``, so
  the JSON formats keep their strict checks ("3" is no integer there).

Each format has ``parse(text, tools=None)``, ``has_call(text)``, ``content(text)`` (the
text without its calls, stripped: the ``content`` of an OpenAI-style reply beside its
``tool_calls``), ``format(name, arguments)`` (a call as the template renders it and the
model should write it: warm-up actions) and ``syntax`` (one line naming the syntax, for
``Task.tools_in_prompt``). ``TOOL_FORMATS`` holds them by name; ``get_tool_format``
resolves a name; ``detect_tool_format(chat_template)`` tells the family from the template's
text (hermes when nothing matches); ``tool_format_of(fmt, task)`` is the one rule for
which format a conversation uses (``Task.tool_format``, else the one detected from the
tokenizer). Used by ``rollart.chat.tools`` (checking, the hermes-default helpers), the
conversation format, the trajectory runner, the warm-up and evaluation.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOL_FORMATS", "ToolCall", "ToolError", "ToolFormat", "detect_tool_format",
           "get_tool_format", "tool_format_of"]


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's ``name`` and its ``arguments`` (a dict)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolError:
    """A call that cannot run; ``message`` is returned to the model as the tool result."""

    message: str


_JSON = json.JSONDecoder()


def _loads(body: str, example: str) -> tuple[Any, ToolError | None]:
    try:
        return json.loads(body), None
    except (json.JSONDecodeError, RecursionError) as e:
        msg = getattr(e, "msg", type(e).__name__)
        return None, ToolError(f"tool call is not valid JSON ({msg}): write {example}")


def _from_object(obj, keys=("arguments", "parameters")) -> ToolCall | ToolError:
    """A call from a decoded ``{"name": ..., "arguments"/"parameters": {...}}``."""
    if not isinstance(obj, dict):
        return ToolError(f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolError('tool call has no "name" (a non-empty string)')
    key = next((k for k in keys if k in obj), keys[0])
    args = obj.get(key, {})
    if isinstance(args, str):  # OpenAI-style: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ToolError(f"tool {name!r}: arguments string is not valid JSON")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolError(f'tool {name!r}: "{key}" must be a JSON object, '
                         f"got {type(args).__name__}")
    return ToolCall(name, args)


def _spans(text: str, open_: str, close: str) -> list[tuple[int, int, str | None]]:
    """``(start, end, body)`` of each ``open_ … close`` block; ``body`` None where the
    block is not closed (before the next ``open_`` or at all)."""
    out: list[tuple[int, int, str | None]] = []
    pos = 0
    while (start := text.find(open_, pos)) >= 0:
        body_start = start + len(open_)
        end = text.find(close, body_start)
        nested = text.find(open_, body_start)
        if end < 0 or 0 <= nested < end:
            stop = len(text) if end < 0 else nested
            out.append((start, stop, None))
            pos = stop
            continue
        out.append((start, end + len(close), text[body_start:end]))
        pos = end + len(close)
    return out


class ToolFormat(abc.ABC):
    """One family's tool-call syntax. Subclasses set ``name``, ``syntax`` and
    implement ``parse``, ``format`` and ``_regions`` (where the calls are)."""

    name = ""
    syntax = ""

    @abc.abstractmethod
    def parse(self, text: str, tools=None) -> list[ToolCall | ToolError]:
        """Every call in ``text``, in order; ``[]`` if none. Never raises."""

    @abc.abstractmethod
    def format(self, name: str, arguments: dict) -> str:
        """A call as this family's templates render it."""

    @abc.abstractmethod
    def _regions(self, text: str) -> list[tuple[int, int]]:
        """The spans of ``text`` that hold calls."""

    def has_call(self, text: str) -> bool:
        """Whether ``text`` holds a call (well-formed or not)."""
        return bool(self._regions(text))

    def content(self, text: str) -> str:
        """``text`` without its calls, stripped."""
        out, pos = [], 0
        for start, end in self._regions(text):
            out.append(text[pos:start])
            pos = end
        out.append(text[pos:])
        return "".join(out).strip()

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"


class HermesFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    >>> f = HermesFormat()
    >>> f.parse('hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    [ToolCall(name='f', arguments={'x': 1})]
    >>> f.parse('<tool_call>{"name": "f"')
    [ToolError(message='tool call not closed: end it with </tool_call>')]
    """

    name = "hermes"
    syntax = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools=None) -> list[ToolCall | ToolError]:
        return [self._one(body) if body is not None else
                ToolError(f"tool call not closed: end it with {self.CLOSE}")
                for _, _, body in _spans(text, self.OPEN, self.CLOSE)]

    def _one(self, body: str) -> ToolCall | ToolError:
        obj, err = _loads(body, '{"name": <tool name>, "arguments": {...}}')
        return err or _from_object(obj)

    def format(self, name: str, arguments: dict) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.OPEN}\n{body}\n{self.CLOSE}"

    def has_call(self, text: str) -> bool:
        return self.OPEN in text

    def _regions(self, text: str) -> list[tuple[int, int]]:
        return [(s, e) for s, e, _ in _spans(text, self.OPEN, self.CLOSE)]


class Llama3Format(ToolFormat):
    """Llama-3.1/3.2 JSON calls: the turn (or what follows ``<|python_tag|>``) is one
    or more ``{"name": ..., "parameters": {...}}`` objects, split by ``;`` or newlines.
    Calls start at ``<|python_tag|>`` or at the first line that opens ``{"name":``.

    >>> f = Llama3Format()
    >>> f.parse('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}')
    [ToolCall(name='f', arguments={'x': 1}), ToolCall(name='g', arguments={})]
    >>> f.has_call('{"answer": 5}'), f.content('Let me see.\\n{"name": "f", "parameters": {}}')
    (False, 'Let me see.')
    """

    name = "llama3"
    syntax = '{"name": ..., "parameters": {...}}'
    TAG = "<|python_tag|>"
    _START = re.compile(r'^[ \t]*\{\s*"name"\s*:', re.MULTILINE)
    _SEP = re.compile(r"[\s;]*")
    _NEXT = re.compile(r"[;\n]\s*(?=\{)")

    def _start(self, text: str) -> int:
        tag = text.find(self.TAG)
        if tag >= 0:
            return tag
        found = self._START.search(text)
        return found.start() if found else -1

    def _regions(self, text: str) -> list[tuple[int, int]]:
        start = self._start(text)
        return [(start, len(text))] if start >= 0 else []

    def parse(self, text: str, tools=None) -> list[ToolCall | ToolError]:
        start = self._start(text)
        if start < 0:
            return []
        if text.startswith(self.TAG, start):
            start += len(self.TAG)
        calls: list[ToolCall | ToolError] = []
        pos = self._SEP.match(text, start).end()
        while pos < len(text):
            if text[pos] != "{":
                break  # trailing text after the calls
            try:
                obj, end = _JSON.raw_decode(text, pos)
            except (json.JSONDecodeError, RecursionError) as e:
                msg = getattr(e, "msg", type(e).__name__)
                calls.append(ToolError(f"tool call is not valid JSON ({msg}): write "
                                       f"{self.syntax}, calls separated by ';'"))
                nxt = self._NEXT.search(text, pos + 1)
                if nxt is None:
                    break
                pos = nxt.end()
                continue
            calls.append(_from_object(obj, ("parameters", "arguments")))
            pos = self._SEP.match(text, end).end()
        return calls or [ToolError(f"tool call must be a JSON object: write {self.syntax}")]

    def format(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


class MistralFormat(ToolFormat):
    """``[TOOL_CALLS]`` then a JSON list of calls, or ``[TOOL_CALLS]name[ARGS]{...}``
    (the newer templates; ``name{...}`` and a ``[CALL_ID]id`` before ``[ARGS]`` too).

    >>> f = MistralFormat()
    >>> f.parse('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]')
    [ToolCall(name='f', arguments={'x': 1})]
    >>> f.parse('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}')
    [ToolCall(name='f', arguments={'x': 1}), ToolCall(name='g', arguments={})]
    """

    name = "mistral"
    syntax = '[TOOL_CALLS] [{"name": ..., "arguments": {...}}]'
    TAG = "[TOOL_CALLS]"
    _NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]*\s*)?"
                        r"(?:\[ARGS\])?\s*")

    def _regions(self, text: str) -> list[tuple[int, int]]:
        start = text.find(self.TAG)
        return [(start, len(text))] if start >= 0 else []

    def parse(self, text: str, tools=None) -> list[ToolCall | ToolError]:
        start = text.find(self.TAG)
        if start < 0:
            return []
        calls: list[ToolCall | ToolError] = []
        for chunk in text[start + len(self.TAG):].split(self.TAG):
            calls += self._chunk(chunk.strip())
        return calls

    def _chunk(self, chunk: str) -> list[ToolCall | ToolError]:
        if not chunk:
            return [ToolError(f"{self.TAG} with no call after it: write {self.syntax}")]
        if chunk[0] in "[{":
            obj, err = self._decode(chunk, 0)
            if err:
                return [err]
            items = obj if isinstance(obj, list) else [obj]
            return [_from_object(o) for o in items] or [
                ToolError(f"{self.TAG} with an empty list: write {self.syntax}")]
        named = self._NAMED.match(chunk)
        if not named or named.end() >= len(chunk) or chunk[named.end()] != "{":
            return [ToolError(f"cannot read the call after {self.TAG}: write {self.syntax} "
                              "or name[ARGS]{...}")]
        args, err = self._decode(chunk, named.end())
        return [err or _from_object({"name": named.group(1), "arguments": args})]

    def _decode(self, chunk: str, pos: int) -> tuple[Any, ToolError | None]:
        try:
            return _JSON.raw_decode(chunk, pos)[0], None
        except (json.JSONDecodeError, RecursionError) as e:
            msg = getattr(e, "msg", type(e).__name__)
            return None, ToolError(f"tool call is not valid JSON ({msg}): write "
                                   + self.syntax)

    def format(self, name: str, arguments: dict) -> str:
        body = json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)
        return f"{self.TAG} {body}"


class Qwen3CoderFormat(HermesFormat):
    """Qwen3-Coder's XML calls; values typed by the tool's schema when ``tools`` given.

    >>> f = Qwen3CoderFormat()
    >>> text = f.format("move", {"direction": "up", "steps": 2})
    >>> print(text)
    <tool_call>
    <function=move>
    <parameter=direction>
    up
    </parameter>
    <parameter=steps>
    2
    </parameter>
    </function>
    </tool_call>
    >>> f.parse(text)
    [ToolCall(name='move', arguments={'direction': 'up', 'steps': '2'})]
    >>> steps = {"type": "function", "function": {"name": "move", "parameters": {
    ...     "type": "object", "properties": {"steps": {"type": "integer"}}}}}
    >>> f.parse(text, [steps])
    [ToolCall(name='move', arguments={'direction': 'up', 'steps': 2})]
    """

    name = "qwen3_coder"
    syntax = ("<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>"
              "</tool_call>")
    _FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)

    def parse(self, text: str, tools=None) -> list[ToolCall | ToolError]:
        return [self._typed(c, tools) for c in super().parse(text)]

    def _one(self, body: str) -> ToolCall | ToolError:
        found = self._FUNCTION.match(body)
        if not found:
            return ToolError(f"tool call has no <function=NAME>...</function>: write "
                             f"{self.syntax}")
        name, inner = found.group(1).strip(), found.group(2)
        if not name:
            return ToolError(f"tool call has an empty function name: write {self.syntax}")
        args, pos = {}, 0
        for param in self._PARAM.finditer(inner):
            if inner[pos:param.start()].strip():
                break
            args[param.group(1).strip()] = _strip_newline(param.group(2))
            pos = param.end()
        if inner[pos:].strip():
            return ToolError(f"tool {name!r}: cannot read its parameters (each "
                             "<parameter=KEY>VALUE</parameter>, closed)")
        return ToolCall(name, args)

    def _typed(self, call: ToolCall | ToolError, tools) -> ToolCall | ToolError:
        if isinstance(call, ToolError) or not tools:
            return call
        props = _properties(call.name, tools)
        return ToolCall(call.name, {k: _typed_value(v, props.get(k))
                                    for k, v in call.arguments.items()})

    def format(self, name: str, arguments: dict) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            "\n</parameter>\n" for k, v in arguments.items())
        return f"{self.OPEN}\n<function={name}>\n{params}</function>\n{self.CLOSE}"


def _strip_newline(value: str) -> str:
    """A parameter's value without the one newline the template puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _properties(name: str, tools) -> dict:
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _typed_value(value: str, schema) -> Any:
    """``value`` read as JSON when ``schema`` declares no string type, else as is.

    >>> _typed_value("3", {"type": "integer"}), _typed_value("3", {"type": "string"})
    (3, '3')
    >>> _typed_value("True", {"type": "boolean"}), _typed_value("x", {"type": "number"})
    (True, 'x')
    """
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or "string" in types:
        return value
    text = value.strip()
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return value


#: the tool-call formats by name
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    HermesFormat(), Llama3Format(), MistralFormat(), Qwen3CoderFormat())}


def get_tool_format(name: str | ToolFormat) -> ToolFormat:
    """The format called ``name`` (a ``ToolFormat`` passes through).

    >>> get_tool_format("llama3").format("f", {})
    '{"name": "f", "parameters": {}}'
    >>> get_tool_format("json")
    Traceback (most recent call last):
    ValueError: unknown tool format 'json'; choose one of hermes, llama3, mistral, qwen3_coder
    """
    if isinstance(name, ToolFormat):
        return name
    found = TOOL_FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown tool format {name!r}; choose one of "
                         f"{', '.join(TOOL_FORMATS)}")
    return found


def detect_tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template's family uses, from its text; ``"hermes"``
    when nothing matches (or there is no template).

    >>> detect_tool_format("{{ '<tool_call>\\\\n<function=' + name }}")
    'qwen3_coder'
    >>> detect_tool_format("{{ '[TOOL_CALLS] [' }}"), detect_tool_format(None)
    ('mistral', 'hermes')
    """
    text = chat_template if isinstance(chat_template, str) else ""
    if "<tool_call>" in text and "<function=" in text:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("ipython" in text and '"parameters": ' in text):
        return "llama3"
    return "hermes"


def tool_format_of(fmt, task) -> str:
    """The format a conversation of ``task`` uses: ``Task.tool_format`` when set, else
    the one ``fmt`` (a ``ConversationFormat``) detected from its tokenizer."""
    return getattr(task, "tool_format", None) or getattr(fmt, "tool_format", "hermes")
