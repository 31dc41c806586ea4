"""The chat toy's tokenizer corpus: the text of the tasks, played with their warm-up.

``chat_corpus(tasks)`` plays each task's env for a few seeds with its ``warmup_action``
and collects every text a chat conversation of that task contains: the system prompt,
the tools' JSON declarations, observations, actions, tool calls and tool results (a
tool call is run with ``call_tool`` and does not step the env, as in the runner's tool
turn). ``rollart.model.build_tiny_model(path, chat_corpus(tasks), chat=True)`` trains the
byte-level BPE on it (the template's own text is added there), so no task needs a
vocabulary list for chat. Called by ``rollart.control.prepare`` (the built-in model of a
chat graph), by tests and benchmarks. It sits at the top of the package beside
``rollart.model``, whose chat toy it feeds: it plays tasks (env, chat, chaos), so it
cannot live in ``model`` (the bottom layer) nor in any one of those packages.
"""

from __future__ import annotations

import json
import random
from typing import Iterable

from rollart.chaos.faults import without_faults
from rollart.env.protocol import env_tools
from rollart.env.tasks import Task, get_task
from rollart.chat.tool_formats import tool_format_of
from rollart.chat.tools import ToolError, check_call, parse_tool_calls


def chat_corpus(tasks: Iterable[str | Task], seeds: Iterable[int] = range(24)) -> list[str]:
    """Texts of ``tasks`` played with their ``warmup_action`` over ``seeds``, in a
    deterministic order. Repeats are kept: BPE merges follow how often a text occurs
    (a tool declaration is in every conversation of its task)."""
    seeds = tuple(seeds)
    texts: list[str] = []
    for item in tasks:
        task = get_task(item)
        if task.warmup_action is None:
            raise ValueError(f"task {task.name!r} has no warmup_action, so its text cannot be "
                             "sampled for the chat toy's tokenizer: give the Task a "
                             "warmup_action, or train a model folder (Policy.model)")
        texts += task_texts(task, seeds)
    return texts


def task_texts(task: Task, seeds: Iterable[int]) -> list[str]:
    """Every text of ``task``'s episodes for ``seeds`` (see ``chat_corpus``)."""
    out: list[str] = []
    system = getattr(task, "system_prompt", None)
    if system:
        out.append(system)
    rng = random.Random(0)
    env = without_faults(task).env_factory()
    try:
        for seed in seeds:
            obs = env.reset(seed)
            tools = env_tools(env)
            out += [json.dumps(t, ensure_ascii=False) for t in tools]
            for _ in range(task.max_turns):
                out.append(obs)
                action = task.warmup_action(rng, obs)
                out.append(action)
                # the chat toy's template writes hermes calls (no format given: hermes)
                calls = parse_tool_calls(action, tool_format_of(None, task),
                                         tools) if tools else []
                if calls:  # the runner's tool turn: results come back, the env waits
                    obs = "\n".join(_run(env, call, tools) for call in calls)
                    continue
                step = env.step(action)
                out.append(step.observation)
                if step.done:
                    break
                obs = step.observation
    finally:
        env.close()
    return out


def _run(env, call, tools) -> str:
    checked = check_call(call, tools)
    if isinstance(checked, ToolError):
        return checked.message
    return str(env.call_tool(checked.name, checked.arguments))
