"""Chat templates whose rendering moves as a conversation grows: found, then appended to.

Consumes a ``rollart.chat.conversation.ConversationFormat`` (its ``render``, end-of-turn
token and stop ids); produces ``stable`` (does a probe conversation with this system
message and these tools render prefix-stably?), ``turn_delta`` (the ids new messages add
after an assistant turn, measured on a probe conversation) and ``check_task`` (one
task's part of the start check, ``rollart.config.templates``). Used by
``rollart.chat.conversation.Conversation``.

Some templates re-render history as a conversation grows: Qwen3's drops past
``<think>`` blocks; Mistral v0.3's puts its ``[AVAILABLE_TOOLS]`` block before the last
user turn (it moves with each new user turn), may fold a system message into a user
turn, and raises unless user and assistant turns alternate (an assistant turn that called
a tool, kept as text, breaks the alternation). Rendering such a conversation again would
change ids the policy already saw, or fail. A conversation under such a template is kept
in delta mode, as ROLL's and verl's token-in-token-out rollouts do: its ids are the ids
the policy saw, and each new message appends what the template writes after an
assistant turn, measured by rendering a probe conversation ``[user, assistant, *new]``
and keeping the ids after the probe assistant's end-of-turn token (no system message in
the probe: the system prompt stays where the opening prompt put it; under Mistral
v0.3's template a new user turn's delta carries the tool list again, as the template
puts it before the newest user turn, while a tool result's does not). Generated ids are
never decoded and re-encoded: the next prompt is exactly the previous ids plus the delta,
and a training row is exactly those ids. Where the template cannot render the probe, a
``ConversationError`` names the template and the fix, at start where the check runs.

A note says once per template and process that delta mode is on: at INFO where a
conversation finds it (the env managers, the warm-up), as the one WARNING console line
where the start check finds it (the driver, before a cluster starts).
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)

_PROBE_THINK = "<think>probe thought</think>probe answer"
_REPLY = "rollart probe reply"  # the probe assistant's content, found in the render
_NOTED: set[tuple[str, int]] = set()  # (template name, level) already noted
_MAX_KINDS = 512  # (system?, tools) kinds whose answer a format keeps


class ConversationError(ValueError):
    """The tokenizer cannot serve the asked-for conversation format."""


def stable(fmt, system: bool, tools=None) -> bool:
    """Whether ``fmt``'s template renders a probe conversation (a system message when
    ``system``, rendered with ``tools``: user, assistant, [tool, assistant,] user, …)
    prefix by prefix, each render a prefix of the next; a render that raises counts as
    not stable. Probed once per format and kind; not stable is noted once (INFO)."""
    key = (bool(system), json.dumps(tools, sort_keys=True) if tools else None)
    found = fmt.stable_kinds.get(key)
    if found is None:
        if len(fmt.stable_kinds) >= _MAX_KINDS:  # bounded memory (an agent's tool lists)
            fmt.stable_kinds.clear()
        found = fmt.stable_kinds[key] = _probe(fmt, bool(system), tools)
        if not found:
            note(fmt.name)
    return found


def _probe(fmt, system: bool, tools) -> bool:
    msgs = [{"role": "system", "content": "probe"}] if system else []
    turns = [{"role": "user", "content": "probe one"},
             {"role": "assistant", "content": _PROBE_THINK}]
    if tools:  # a tool turn too: a template may insist on alternating user / assistant
        turns += [tool_message(fmt, "probe result"),
                  {"role": "assistant", "content": _PROBE_THINK}]
    turns += [{"role": "user", "content": "probe two"},
              {"role": "assistant", "content": _PROBE_THINK},
              {"role": "user", "content": "probe three"}]
    prev: list[int] = []
    for m in turns:
        msgs.append(m)
        try:
            ids = fmt.render(msgs, m["role"] != "assistant", tools)
        except Exception:  # noqa: BLE001 - jinja's TemplateError, or a template's raise
            return False
        if ids[:len(prev)] != prev:
            return False
        prev = ids
    return True


def turn_delta(fmt, new: list[dict], tools=None, ended: bool = True) -> list[int]:
    """The ids appended after an assistant turn for the messages ``new``: the rest of
    the turn after its end-of-turn token (the token itself too unless the generation
    ``ended`` with it), the new messages and the generation prompt, as the template
    renders them after the assistant turn of ``[user, assistant, *new]``."""
    tail = _tail(fmt, new, tools)
    end = fmt.end_id
    if end is not None and end in tail:
        at = tail.index(end)
        return tail[at + 1:] if ended else tail[at:]
    return tail if ended else [fmt.stop_ids[0]] + tail  # a turn without a special end


def _tail(fmt, new: list[dict], tools) -> list[int]:
    """The ids after the probe assistant's content in the render of
    ``[user, assistant, *new]`` (encoded alone, checked against the whole render)."""
    roles = ", ".join(m["role"] for m in new)
    probe = [{"role": "user", "content": "rollart probe"},
             {"role": "assistant", "content": _REPLY}] + new
    try:
        text = fmt.render_text(probe, True, tools)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or a template's raise
        raise unrenderable(fmt.name, roles, f"it raises {type(e).__name__}: {e}") from e
    at = text.find(_REPLY)
    if at < 0:
        raise unrenderable(fmt.name, roles, "it drops the assistant's text")
    tail = fmt.encode(text[at + len(_REPLY):])
    whole = fmt.encode(text)
    if not tail or whole[len(whole) - len(tail):] != tail:
        raise unrenderable(fmt.name, roles, "the assistant's text and what follows it "
                           "share a token, so the new messages have no ids of their own")
    return tail


def unrenderable(name: str, roles: str, why: str) -> ConversationError:
    return ConversationError(
        f"the chat template of {name} renders a conversation differently once a message "
        f"is added, so rollart appends each new message's ids to the ids the policy saw, "
        f"measured on a probe conversation [user, assistant, {roles}]; but {why}. Make the "
        "template render a user turn, an assistant turn and then this message "
        "(tokenizer.chat_template = '...', then save_pretrained), or use "
        "Policy.conversation='raw'")


def note(name: str, level: int = logging.INFO, tasks: str = "") -> None:
    """Say once per process, template and level that conversations are appended to."""
    if (name, level) in _NOTED:
        return
    _NOTED.add((name, level))
    logger.log(level, "the chat template of %s%s renders a conversation differently once "
               "a message is added (it re-renders past turns, e.g. moves a tool list or "
               "drops <think> blocks): rollart appends each new message's ids to the ids "
               "the policy saw, so a trajectory's ids differ from apply_chat_template of its "
               "messages", name, f" (tasks {tasks})" if tasks else "")


def tool_message(fmt, content: str, k: int = 0) -> dict:
    """A tool result as a ``tool`` message; with a ``tool_call_id`` (``call00000``,
    ``call00001``, ... by the call's place in the conversation: nine alphanumeric
    characters, as Mistral v0.3's template insists) where ``fmt``'s template reads one
    (``ConversationFormat.call_ids``), plain elsewhere (the template cache keys plain
    messages only)."""
    m = {"role": "tool", "content": content}
    if getattr(fmt, "call_ids", False):
        m["tool_call_id"] = f"call{k % 100000:05d}"
    return m


def check_task(fmt, system: bool, tools, tool_messages: bool = True) -> bool:
    """Whether conversations with a system message (``system``) and ``tools`` are kept
    in delta mode under ``fmt``; raise ``ConversationError`` where the deltas they need
    (a user message, and a tool message with tools unless not ``tool_messages``: an
    agent's messages are its own, checked at its requests) cannot be rendered."""
    if fmt.mode != "chat" or stable(fmt, system, tools):
        return False
    turn_delta(fmt, [{"role": "user", "content": "probe"}], tools)
    if tools and tool_messages:
        turn_delta(fmt, [tool_message(fmt, "probe")], tools)
    return True
