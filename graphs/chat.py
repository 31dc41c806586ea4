"""The chat graph: the three built-in games and a tool-calling task, in chat format.

Like the default graph, but every trajectory is a chat conversation rendered by the
tokenizer's template (``Policy(conversation="chat")``, ``rollart.env.conversation``):
each observation a ``user`` message, each generation the ``assistant`` message ending
with its end-of-turn token. The fourth task, ``calc``, declares a sandboxed ``python``
tool: the model writes ``<tool_call>{"name": "python", "arguments": {"code": ...}}
</tool_call>``, the runner runs it and the result comes back as a ``tool`` message
(masked out of the loss); the final ``answer <n>`` goes to the env.

With ``Policy(model=None)`` the built-in model is the chat toy
(``build_tiny_model(..., chat=True)``: a byte-level BPE trained on these tasks' text by
``rollart.env.corpus.chat_corpus``, ChatML template with tools), after a format warm-up
in chat form. Point ``Policy.model`` (or ``--model``) at any Hugging Face chat folder to
train that instead; ``warmup_steps`` then does not apply.
"""

from dataclasses import replace

from rollart import GRPO, Graph, Policy
from rollart.env.adapters.tool import calc_tool_task
from rollart.env.tasks import BUILTIN_TASKS

#: room for one game action (1-2 BPE tokens) plus the end-of-turn token
GAME_TOKENS = 8
#: a python tool call in the Hermes format is ~21 toy tokens
TOOL_TOKENS = 32


def tasks() -> tuple:
    games = tuple(replace(BUILTIN_TASKS[name], max_new_tokens=GAME_TOKENS)
                  for name in ("gridnav", "guess", "boxpush"))
    calc = calc_tool_task(max_turns=3, tool_format="hermes", max_new_tokens=TOOL_TOKENS,
                          top_p=1.0)
    return games + (calc,)


def graph() -> Graph:
    return Graph(
        name="chat",
        tasks=tasks(),
        task_weights=(1.0, 1.0, 1.0, 1.5),  # calc needs two right turns (call, copy)
        policy=Policy(model=None, conversation="chat", warmup_steps=300),
        algo=GRPO(group_size=8, groups_per_step=12, lr=5e-4, alpha=1, kl_coef=0.05),
        steps=120,
    )
