"""The start check of a graph's tasks against the model's chat template.

Consumes a ``Graph`` and a model folder; produces nothing (or a ``ChatTemplateError`` /
``ConversationError`` naming the fix) and one warning line each where system prompts are
folded into the first user turn, where the template re-renders a growing conversation
(its conversations are then appended to in delta mode: ``rollart.chat.deltas``), and
where a task's ``tool_format`` is not the one its template's family writes.
``rollart.control.loop.execute`` (and ``rollart eval``) run it on the driver once the
model folder is known, before a cluster starts. What a template can do and how a
task falls back is ``rollart.chat.template_support`` (``check_task``); this module only
walks the graph's tasks, each env made once to read its tools (an agent task's are
those it declares, ``AgentTask.tools``).
"""

from __future__ import annotations

import logging

from rollart.chaos.faults import without_faults
from rollart.chat import deltas
from rollart.chat.conversation import ConversationFormat
from rollart.chat.template_support import ChatTemplateError, check_task, note_fold, opening
from rollart.env.protocol import env_tools
from rollart.env.tasks import is_agent_task

__all__ = ["check_templates"]

logger = logging.getLogger(__name__)
_NOTED: set[tuple[str, str, str]] = set()  # (template, task, its tool format) warned


def check_templates(graph, model_path: str) -> None:
    """The start check (driver, before a cluster): every task of ``graph`` against the
    chat template of ``model_path`` as ``Policy`` asks (``check_task``; each task's env
    is made once to read its tools; ``rollart.chat.deltas.check_task`` where the template
    re-renders a growing conversation). One warning line each where system prompts are
    folded, where conversations are appended to in delta mode, and per task whose
    ``tool_format`` differs from the template's family."""
    from rollart.model import load_tokenizer  # torch loads only when the check runs

    policy = graph.policy
    agents = [t.name for t in graph.tasks if is_agent_task(t)]
    if policy.conversation == "raw":
        if agents:
            raise _agents_need_chat(agents, "Policy.conversation='raw'")
        return
    tokenizer = load_tokenizer(model_path)
    if not getattr(tokenizer, "chat_template", None):
        if agents:
            raise _agents_need_chat(agents, f"the tokenizer of {model_path} has no chat "
                                    "template")
        return  # "auto" without a template is raw; "chat" fails in the format below
    opts = policy.conversation_options()
    fmt = ConversationFormat(tokenizer, opts["conversation"], system_prompt=opts[
        "system_prompt"], max_context=opts["max_context"] or 2048, model_path=model_path,
        strict=policy.strict_template, cache=False)
    # an agent's tools come per call: those it declares (AgentTask.tools) are checked
    # here, the others at its first request (rollart.agents.agent)
    folded, moving = [], []
    for t in graph.tasks:
        agent = is_agent_task(t)
        tools = list(t.tools) if agent else _tools(t)
        if check_task(fmt, t, tools, own_system=not agent):
            folded.append(t.name)
        system, shown = (None, tools) if agent else opening(fmt, t, tools)
        if deltas.check_task(fmt, bool(system) and fmt.system_role, shown,
                             tool_messages=not agent):
            moving.append(t.name)
        if shown:
            _note_tool_format(fmt, t)
    if folded:
        note_fold(f"{fmt.name} (tasks {', '.join(folded)})", logging.WARNING)
    if moving:
        deltas.note(fmt.name, logging.WARNING, ", ".join(moving))


def _note_tool_format(fmt, task) -> None:
    """One warning line where ``task`` sets a tool format other than the one its
    template's family writes (``ConversationFormat.tool_format``)."""
    own = getattr(task, "tool_format", None)
    key = (fmt.name, task.name, own)
    if own is None or own == fmt.tool_format or key in _NOTED:
        return
    _NOTED.add(key)
    logger.warning("task %r sets tool_format=%r, but the chat template of %s writes %r "
                   "tool calls: the model's calls are parsed as %r (leave the task's "
                   "tool_format unset to use the template's)", task.name, own, fmt.name,
                   fmt.tool_format, own)


def _agents_need_chat(names: list[str], why: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"agent tasks ({', '.join(names)}) send chat messages, but {why}: use a model "
        "folder with a chat template and Policy.conversation='chat' or 'auto' (the "
        "built-in chat toy: Policy(model=None, conversation='chat'))")


def _tools(task) -> list[dict]:
    env = without_faults(task).env_factory()
    try:
        return env_tools(env)
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
