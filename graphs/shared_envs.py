"""Environments from shared formats: MCP tools and an OpenEnv environment, in chat format.

| task          | source                                                  | turns | tokens |
|---------------|---------------------------------------------------------|-------|--------|
| mcp_calc      | an MCP stdio server's ``calculate`` tool (mcp SDK)       | 3     | 48     |
| openenv_calc  | an OpenEnv ``MCPEnvironment`` in process (openenv-core) | 3     | 48     |

Both ask ``a op b`` with one-digit operands; the model may call ``calculate`` (a
``<tool_call>`` block: the runner runs it through the env's ``call_tool`` and returns the
result as a ``tool`` message, masked out of the loss) and ends with ``answer <n>``;
reward 1 when exact. ``mcp()`` and ``openenv()`` train one source each, ``graph()`` both.
An MCP env starts its server process at first use (~1 s of Python start-up on 2 cores)
and stops it when the trajectory closes it.

The settings follow ``graphs/chat.py``'s ``calc`` (the same question and call shape),
which measured what the chat toy needs to copy a question into a call: the bare-tool
warm-up stage, the warm-up lr 1e-3, batch-scaled advantages. They were not measured on
these tasks. To train a real chat model, set ``Policy(model="path/to/hf-chat-model")``.
Needs ``pip install mcp openenv-core`` (``rollart[envs]``).
"""

from rollart import GRPO, Graph, Policy
from rollart.env.adapters.mcp import mcp_calc_task
from rollart.env.adapters.openenv import openenv_calc_task

TOOL_TOKENS = 48  # a calculate call in the Hermes format, with room
WARMUP_LR = 1e-3  # graphs/chat.py: the chat toy learns to copy at 1e-3, not 3e-3
BARE_TOOL_STEPS = 300  # graphs/chat.py: the copy of the question into the call


def tasks() -> tuple:
    return mcp_task(), openenv_task()


def graph(tasks_=None, name: str = "shared-envs") -> Graph:
    """Both tasks (or ``tasks_``) on the chat toy."""
    return Graph(
        name=name,
        tasks=tasks() if tasks_ is None else tasks_,
        policy=Policy(model=None, conversation="chat", warmup_steps=150,
                      warmup_bare_tool_steps=BARE_TOOL_STEPS, warmup_lr=WARMUP_LR,
                      warmup_episode_threads=4),
        algo=GRPO(group_size=8, groups_per_step=8, lr=5e-4, kl_coef=0.05,
                  scale_rewards="batch"),
        steps=60,
    )


def mcp() -> Graph:
    """The MCP task alone (needs only ``mcp``):
    ``python -m rollart train graphs/shared_envs.py:mcp``."""
    return graph((mcp_task(),), name="shared-envs-mcp")


def openenv() -> Graph:
    """The OpenEnv task alone: ``python -m rollart train graphs/shared_envs.py:openenv``."""
    return graph((openenv_task(),), name="shared-envs-openenv")


def mcp_task():
    return mcp_calc_task(max_turns=3, max_new_tokens=TOOL_TOKENS, top_p=1.0)


def openenv_task():
    return openenv_calc_task(max_turns=3, max_new_tokens=TOOL_TOKENS, top_p=1.0)
