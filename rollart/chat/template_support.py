"""What a chat template can do, found before any rollout: a system role, a tool list.

Consumes a tokenizer's chat template (through a ``ConversationFormat``'s renders) and a
task; produces the format's ``system_role`` / ``tools_rendered`` answers (probed once
when ``rollart.chat.conversation.ConversationFormat`` is built), the text a conversation
uses instead where the template falls short, and ``check_task``, one task against the
template. The start check over a graph's tasks, ``check_templates``, is
``rollart.config.templates`` (it makes the tasks' envs, which live above chat).

* **No system role** (Gemma's templates raise "System role not supported"): the system
  prompt is folded into the first user turn, ``fold_system``: the system text, a blank
  line, then the user text (the convention chat libraries use). One warning at start
  says so; ``Policy.strict_template=True`` makes it a ``ChatTemplateError`` instead.
  Rollout, warm-up and evaluation fold alike (they share ``Conversation``).
* **Tools ignored** (the template renders the same ids with and without ``tools=``):
  a task whose env declares tools would never show the model its tools, so the start
  check raises a ``ChatTemplateError`` naming the fix, unless the task sets
  ``Task.tools_in_prompt=True``: its tool schemas are then written into the system prompt
  (folded too, where there is no system role) as ``tools_prompt`` states: one line of
  text naming the call syntax of the task's tool format (``tools_header``), then one
  JSON schema per line.
"""

from __future__ import annotations

import json
import logging

from rollart.chat.tool_formats import get_tool_format, tool_format_of

logger = logging.getLogger(__name__)

_SYSTEM_PROBE = "rollart probe system"
_PROBE_TOOL = {"type": "function", "function": {
    "name": "rollart_probe", "description": "rollart probe tool",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
_NOTED: set[str] = set()  # templates whose fold was logged (once per process)


def tools_header(tool_format: str = "hermes") -> str:
    """The line before the tool schemas of ``Task.tools_in_prompt``: it names the call
    syntax of ``tool_format`` (``rollart.chat.tool_formats``).

    >>> tools_header("llama3").split("; ")[1]
    'call one with {"name": ..., "parameters": {...}}:'
    """
    return ("You can call these tools, one JSON schema per line; call one with "
            f"{get_tool_format(tool_format).syntax}:")


#: the line before the tool schemas of ``Task.tools_in_prompt`` (hermes calls)
TOOLS_HEADER = tools_header("hermes")


class ChatTemplateError(ValueError):
    """The model's chat template cannot do what the run asks; says what to change."""


# -- probes (run once per format) ---------------------------------------------------------
def probe(fmt) -> tuple[bool, bool]:
    """``(system_role, tools_rendered)`` of ``fmt``'s chat template: does it render a
    system message (neither raising nor dropping it), and does ``tools=`` change its
    ids?"""
    user = [{"role": "user", "content": "probe"}]
    try:
        text = fmt.tokenizer.apply_chat_template(
            [{"role": "system", "content": _SYSTEM_PROBE}] + user,
            add_generation_prompt=True, tokenize=False)
        system_role = _SYSTEM_PROBE in text
    except Exception:  # noqa: BLE001 - jinja's TemplateError, or a template's own raise
        system_role = False
    try:
        tools_rendered = fmt.render(user, True, [_PROBE_TOOL]) != fmt.render(user, True)
    except Exception:  # noqa: BLE001 - a template that fails on tools= cannot show them
        tools_rendered = False
    return system_role, tools_rendered


# -- what a conversation renders instead ---------------------------------------------------
def fold_system(system: str, text: str) -> str:
    """The first user turn of a template without a system role.

    >>> fold_system("you play a game", "guess : pick 1 to 9 .")
    'you play a game\\n\\nguess : pick 1 to 9 .'
    """
    return f"{system}\n\n{text}"


def tools_prompt(tools: list[dict], system: str | None = None,
                 tool_format: str = "hermes") -> str:
    """``system`` (if any), a blank line, then the tools as ``Task.tools_in_prompt``
    writes them: ``tools_header(tool_format)`` (``TOOLS_HEADER`` for hermes), then one
    JSON schema per line.

    >>> lines = tools_prompt([{"type": "function", "function": {"name": "f"}}], "hi")
    >>> lines = lines.split("\\n")
    >>> lines[:3] == ["hi", "", TOOLS_HEADER], lines[3:]
    (True, ['{"type": "function", "function": {"name": "f"}}'])
    """
    text = "\n".join([tools_header(tool_format)] + [json.dumps(t) for t in tools])
    return f"{system}\n\n{text}" if system else text


def opening(fmt, task, tools) -> tuple[str | None, list | None]:
    """The system prompt and ``tools=`` a conversation of ``task`` starts with in
    ``fmt`` (``ConversationFormat.start``): ``Task.tools_in_prompt`` moves the tools into
    the system prompt; a template without a system role folds it (``Conversation``),
    logged once, or raises where ``fmt.strict``."""
    system = getattr(task, "system_prompt", None) or fmt.system_prompt
    if fmt.mode != "chat":
        return system, tools
    if tools and getattr(task, "tools_in_prompt", False):
        system, tools = tools_prompt(tools, system, tool_format_of(fmt, task)), None
    if system and not fmt.system_role:
        if fmt.strict:
            raise no_system_role(fmt.name)
        note_fold(fmt.name)
    return system, tools


def agent_opening(fmt, task, messages: list[dict], tools) -> tuple[list[dict], list | None]:
    """An agent's request as ``opening`` places its tools (``rollart.agents.agent``):
    with ``Task.tools_in_prompt`` (chat) the tool schemas join the request's system
    message, or open one, as ``tools_prompt`` writes them, and ``tools=`` is None; the
    system text's fold, where the template has no system role, is ``Conversation``'s.

    >>> class Fmt: mode, tool_format = "chat", "hermes"
    >>> class Task: tools_in_prompt, tool_format = True, None
    >>> tool = {"type": "function", "function": {"name": "f"}}
    >>> msgs, tools = agent_opening(Fmt, Task, [{"role": "user", "content": "hi"}], [tool])
    >>> [m["role"] for m in msgs], tools, msgs[0]["content"] == tools_prompt([tool])
    (['system', 'user'], None, True)
    """
    if fmt.mode != "chat" or not tools or not getattr(task, "tools_in_prompt", False):
        return messages, tools
    fmt_name = tool_format_of(fmt, task)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": tools_prompt(
            tools, messages[0].get("content") or None, fmt_name)}
        return [first] + list(messages[1:]), None
    return [{"role": "system", "content": tools_prompt(tools, None, fmt_name)}] + list(
        messages), None


def note_fold(name: str, level: int = logging.INFO) -> None:
    """Log once per process and template that system prompts are folded."""
    if name in _NOTED:
        return
    _NOTED.add(name)
    logger.log(level, "the chat template of %s has no system role: the system prompt is "
               "folded into the first user turn (system text, a blank line, then the user "
               "text); set Policy.strict_template=True to make this an error instead", name)


def no_system_role(name: str, who: str = "the system prompt") -> ChatTemplateError:
    return ChatTemplateError(
        f"the chat template of {name} has no system role (it raises on or drops a system "
        f"message), and {who} needs one while Policy.strict_template=True. Fold the prompt "
        "into the first user turn (set Policy.strict_template=False, "
        "--set policy.strict_template=false), drop the system prompt, or use a model folder "
        "whose chat template renders a system message")


# -- the start check ------------------------------------------------------------------------
def check_task(fmt, task, tools: list[dict], own_system: bool = True) -> bool:
    """Raise ``ChatTemplateError`` if ``fmt`` cannot render ``task`` (with its env's
    ``tools``, or the ones an agent task declares) as the run asks; return whether its
    system prompt is folded. ``own_system=False``: the task's system prompt is not
    rollart's to write (an agent sends its own messages), only its tools are checked."""
    if fmt.mode != "chat":
        return False
    tools_in_prompt = getattr(task, "tools_in_prompt", False)
    if tools and not fmt.tools_rendered and not tools_in_prompt:
        names = ", ".join(t["function"]["name"] for t in tools)
        raise ChatTemplateError(
            f"task {task.name!r} declares tools ({names}), but the chat template of "
            f"{fmt.name} ignores tools= (it renders the same ids with and without them), "
            "so the model would never be shown its tools. Use a model folder whose chat "
            "template renders tools (e.g. Qwen2.5's, Llama-3.1's), or set "
            f"{type(task).__name__}(tools_in_prompt=True) on {task.name!r} "
            "(dataclasses.replace(task, "
            "tools_in_prompt=True)): its tool schemas are then written into the system "
            "prompt, one JSON schema per line")
    system = (getattr(task, "system_prompt", None) or fmt.system_prompt) if own_system \
        else None
    folded = bool((system or (tools and tools_in_prompt)) and not fmt.system_role)
    if folded and fmt.strict:
        raise no_system_role(fmt.name, f"task {task.name!r}'s system prompt")
    return folded
