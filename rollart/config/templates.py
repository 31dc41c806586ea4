"""The start check of a graph's tasks against the model's chat template.

Consumes a ``Graph`` and a model folder; produces nothing (or a ``ChatTemplateError``
naming the fix) and one warning where system prompts are folded into the first user
turn. ``rollart.control.loop.execute`` (and ``rollart eval``) run it on the driver once
the model folder is known, before a cluster starts. What a template can do and how a
task falls back is ``rollart.chat.template_support`` (``check_task``); this module only
walks the graph's tasks, each env made once to read its tools (an agent task's are
those it declares, ``AgentTask.tools``).
"""

from __future__ import annotations

import logging

from rollart.chaos.faults import without_faults
from rollart.chat.conversation import ConversationFormat
from rollart.chat.template_support import ChatTemplateError, check_task, note_fold
from rollart.env.protocol import env_tools
from rollart.env.tasks import is_agent_task

__all__ = ["check_templates"]


def check_templates(graph, model_path: str) -> None:
    """The start check (driver, before a cluster): every task of ``graph`` against the
    chat template of ``model_path`` as ``Policy`` asks (``check_task``; each task's env
    is made once to read its tools). One warning where system prompts are folded."""
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
    folded = [t.name for t in graph.tasks if (
        check_task(fmt, t, list(t.tools), own_system=False) if is_agent_task(t)
        else check_task(fmt, t, _tools(t)))]
    if folded:
        note_fold(f"{fmt.name} (tasks {', '.join(folded)})", logging.WARNING)


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
