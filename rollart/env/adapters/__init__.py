"""Adapters that put outside environment libraries behind rollart's ``Env`` contract.

One module per source, each importing its library only when an env is made (so this
package imports without them): ``gym`` (gymnasium FrozenLake, ansi render), ``textarena``
(single-player games), ``gem`` (``gem-llm`` games), ``reasoning_gym`` (procedural tasks
scored by the library), ``skyrl`` (skyrl-gym gsm8k multi-turn and text2sql on local data),
``tool`` (a Python tool run by ``sandbox``: a process forked per call from a zygote), and
two shared formats: ``mcp`` (an MCP stdio server's tools added to any env) and ``openenv``
(Meta's OpenEnv environments, in process or over their server); ``servers/`` holds the
small servers their tasks run. Each offers ``*_task(...)`` functions that return a
``rollart.env.Task``; ``ADAPTER_TASKS`` lists the ones that need no data files by name, so
``Graph(tasks=("frozenlake", "calc", ...))`` works like the built-in names. Install the
libraries with ``pip install 'rollart[envs]'``. ``verifiers`` (a verifiers v1 taskset as
an ``AgentTask``; its example taskset in ``verifiers_example``) imports its library at
import, so it is imported from its module, not here (``rollart[agents]``).
"""

from __future__ import annotations

from functools import partial

from rollart.env.adapters import gem, gym, mcp, openenv, reasoning_gym, skyrl, textarena, tool
from rollart.env.adapters.base import AdapterEnv, GlobalRNG, make_task, sampled_vocabulary

#: one-digit arithmetic: the easy reasoning-gym setting the ecosystem graph uses
RG_EASY_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                      "operators": ("+", "-")}

#: task name -> function building the task with its defaults (explicit, no import magic)
ADAPTER_TASKS = {
    "calc": tool.calc_tool_task,
    "frozenlake": gym.frozenlake_task,
    "gem_guess": gem.guess_the_number_task,
    "gem_sokoban": gem.sokoban_task,
    "mcp_calc": mcp.mcp_calc_task,
    "openenv_calc": openenv.openenv_calc_task,
    "rg_arithmetic": partial(reasoning_gym.reasoning_gym_task, "basic_arithmetic",
                             name="rg_arithmetic", config=RG_EASY_ARITHMETIC),
    "rg_arithmetic_retry": partial(reasoning_gym.reasoning_gym_task, "basic_arithmetic",
                                   name="rg_arithmetic_retry", config=RG_EASY_ARITHMETIC,
                                   max_attempts=3),
    "ta_guess": textarena.guess_the_number_task,
    "ta_hanoi": textarena.tower_of_hanoi_task,
}

__all__ = ["ADAPTER_TASKS", "AdapterEnv", "GlobalRNG", "RG_EASY_ARITHMETIC", "gem", "gym",
           "make_task", "mcp", "openenv", "reasoning_gym", "sampled_vocabulary", "skyrl",
           "textarena", "tool"]
