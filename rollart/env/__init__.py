"""Environments and tasks: the env contract, the tasks, and the actor that runs them.

Consumes task declarations (``Task``: an env factory, a reward function, turn limits;
the built-in games in ``builtin/``, outside libraries' envs through ``adapters/``, a
user's own) and the ``LLMProxy`` handles of the inference pools; produces scored
trajectories, delivered to the ``SampleBuffer``. ``protocol`` is the env contract and
its checks, ``tasks`` the ``Task`` record and the registry of names (``get_task``),
``manager`` the ``EnvManager`` actor on the ``CPU_ENV`` pool, ``trajectory`` one
trajectory turn by turn (env, generation, tool turns, reward), ``barrier`` the turn
barrier of lockstep batches, ``scripted`` the scripted players every success figure is
read against. Called by the control plane (which starts
the env managers), the config (which resolves task names), the warm-up and evaluation.

Chat rendering and tool-call parsing are ``rollart.chat``; agents played through the
OpenAI-compatible endpoint are ``rollart.agents``; fault and cost injection around a
task is ``rollart.chaos``; the chat toy's tokenizer corpus is ``rollart.corpus``. The
modules of those names still here (``conversation``, ``agent``, ``faults``, …) are
deprecated re-exports of their new homes, kept for one release.
"""

from rollart.env.protocol import Env, EnvOutputError, check_observation, check_step_result
from rollart.env.tasks import BUILTIN_TASKS, Task, UnknownTaskError, get_task, task_corpus

__all__ = [
    "BUILTIN_TASKS",
    "Env",
    "EnvOutputError",
    "Task",
    "UnknownTaskError",
    "check_observation",
    "check_step_result",
    "get_task",
    "task_corpus",
]
