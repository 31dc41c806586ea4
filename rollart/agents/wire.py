"""The OpenAI chat wire format of an agent's requests: parsed, checked, and compared with
what rollart generated.

Consumes a chat-completions request body (messages, tools, ``max_tokens``, ``stop``);
produces rollart's internal messages and settings, or an ``AgentError`` (an HTTP 400 the
agent sees), and decides whether a request's history continues the trajectory's token
log (``continues``, ``same_turn``: replayed replies keep their tokens trained; only real
edits restart the prompt). Used by ``rollart.agents.agent.AgentSession`` (and re-exported
there).
"""

from __future__ import annotations

import json

_ROLES = ("system", "user", "assistant", "tool")


class AgentError(ValueError):
    """A request the endpoint refuses; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _list(body: dict, key: str) -> list:
    value = body.get(key)
    if not isinstance(value, list):
        raise AgentError(f"{key} must be a list, got {type(value).__name__}")
    return value


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise AgentError(f"{where}: only text content parts are supported, got "
                                 f"{kind!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise AgentError(f"{where}: content must be a string or a list of text parts")


def _message(m, i: int) -> dict:
    """A request message, normalised: role, text content, tool calls (arguments parsed),
    tool_call_id / name where given."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES + ("developer",):
        raise AgentError(f"{where} must be an object with a role in {_ROLES}")
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": _text(m.get("content"), where)}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]")
                             for j, c in enumerate(m["tool_calls"])]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key):
                out[key] = str(m[key])
    return out


def _call(c, where: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise AgentError(f"{where} must be {{'type': 'function', 'function': {{'name', "
                         "'arguments'}}}")
    args = fn.get("arguments") or "{}"
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise AgentError(f"{where}: arguments is not valid JSON") from None
    return {"id": str(c.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": json.dumps(args)}}


def continues(messages: list[dict], tools, wire: list[dict], wire_tools) -> bool:
    """Whether a request (``messages``, ``tools``) continues the conversation the
    endpoint last answered (``wire``: that request's messages, then the reply, sent
    with ``wire_tools``), so its new messages are only added: the same tools, every
    message of ``wire`` resent as the same turn (``same_turn``), and after them only
    ``user`` / ``tool`` messages or ``assistant`` messages the agent wrote itself (a
    replayed or scripted tool-call exchange: context the policy reads, not trained).
    Anything else (an edited, dropped or inserted message, other tools) is a new prompt.

    >>> wire = [{"role": "user", "content": "go"},
    ...         {"role": "assistant", "content": "up", "generated": "up"}]
    >>> more = [{"role": "assistant", "content": "left"}, {"role": "user", "content": "?"}]
    >>> continues(wire + more, None, wire, None), continues(more, None, wire, None)
    (True, False)
    """
    n = len(wire)
    if tools != wire_tools or len(messages) <= n:
        return False
    if not all(same_turn(sent, kept) for sent, kept in zip(messages, wire)):
        return False
    return all(m["role"] in ("user", "tool", "assistant") for m in messages[n:])


def same_turn(sent: dict, kept: dict) -> bool:
    """Whether ``sent`` (a resent message) is the turn ``kept``: the same role and tool
    calls (names and arguments as JSON values: key order and spacing aside; call ids
    aside) and the same content. A reply the endpoint generated (``kept["generated"]``:
    its raw text) is also the same turn replayed with that raw text as content, or,
    when it made tool calls, with its calls and no content.

    >>> kept = {"role": "assistant", "content": None, "generated": "<call>", "tool_calls": [
    ...     {"function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
    >>> replay = {"role": "assistant", "content": "", "tool_calls": [
    ...     {"id": "x", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]}
    >>> same_turn(replay, kept), same_turn({**replay, "content": "I add"}, kept)
    (True, False)
    """
    if sent["role"] != kept["role"] or _call_values(sent) != _call_values(kept):
        return False
    content = sent.get("content") or ""
    if content == (kept.get("content") or ""):
        return True
    if "generated" not in kept:
        return False
    return content == kept["generated"] or (not content and bool(kept.get("tool_calls")))


def _call_values(m: dict) -> list[tuple]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in m.get("tool_calls") or ()]


def _internal(m: dict) -> dict:
    """A message as the chat template gets it (tool call arguments as objects)."""
    out = dict(m)
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                               "arguments": json.loads(
                                                   c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
    return out


def _tools(tools) -> list | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str)
            for t in tools):
        raise AgentError("tools must be a list of {'type': 'function', 'function': "
                         "{'name', 'description', 'parameters'}}")
    return tools


def _max_tokens(body: dict, limit: int) -> int:
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if asked is None:
        return limit
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise AgentError(f"max_tokens must be an int >= 1, got {asked!r}")
    return min(asked, limit)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise AgentError("stop must be a string or a list of non-empty strings")
    return tuple(stops)
