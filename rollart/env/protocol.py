"""The environment contract and the checks that turn a bad env return into a clear error.

An ``Env`` is a multi-turn text environment: ``reset(seed) -> observation`` then
``step(action) -> StepResult`` until ``done``. The env manager (rollout stage) calls
``check_observation`` / ``check_step_result`` on everything an env returns, so a buggy
user env fails with an ``EnvOutputError`` that says exactly which field is wrong.
An env may also offer tools (``ToolEnv``: ``tools`` + ``call_tool``; the section at the
end); ``env_tools`` / ``check_tool_result`` check those for the runner's tool turn.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, runtime_checkable

from rollart.types import StepResult

_EXPECTED = (
    "expected rollart.types.StepResult(observation: str, reward: float, done: bool, "
    "info: dict) or a 4-tuple (observation, reward, done, info)"
)


class EnvOutputError(TypeError):
    """An env's ``reset``/``step`` returned something of the wrong type or value."""


@runtime_checkable
class Env(Protocol):
    """A multi-turn text environment (one episode at a time).

    * ``reset(seed)`` starts an episode, deterministic given ``seed``, and returns the
      first observation (a ``str``).
    * ``step(action)`` takes the policy's text for one turn and returns a ``StepResult``
      (a 4-tuple ``(observation, reward, done, info)`` is accepted and converted).
      ``info`` should carry ``success`` (bool) on the final step. Stepping after ``done``
      should raise ``RuntimeError``.
    * ``close()`` releases resources.

    Optionally an env may also define ``async def areset(seed)`` and
    ``async def astep(action)`` (for envs that wait on I/O); the env manager prefers them
    over the sync methods when present. ``isinstance(obj, Env)`` only checks that the
    three sync methods exist.
    """

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


def _env_name(env: object | str | None) -> str:
    if env is None:
        return "Env"
    if isinstance(env, str):
        return env
    return type(env).__name__


def check_observation(obj: object, env: object | str | None = None) -> str:
    """Return ``obj`` if it is a ``str`` observation, else raise ``EnvOutputError``.

    ``env`` (the env object or its name) only serves the error message.
    """
    if not isinstance(obj, str):
        raise EnvOutputError(
            f"env {_env_name(env)}.reset returned {type(obj).__name__}; "
            "expected a str observation"
        )
    return obj


def _check_reward(reward: Any, where: str) -> float:
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise EnvOutputError(
            f"{where} reward is {type(reward).__name__} ({reward!r:.60}); "
            "expected a real number (int or float)"
        )
    value = float(reward)
    if not math.isfinite(value):
        raise EnvOutputError(f"{where} reward is {value}; expected a finite number")
    return value


def check_step_result(obj: object, env: object | str | None = None) -> StepResult:
    """Validate what ``env.step`` returned and return it as a ``StepResult``.

    Accepts a ``StepResult`` or a 4-tuple ``(observation, reward, done, info)``. Raises
    ``EnvOutputError`` naming the env and the offending field otherwise. ``reward`` is
    converted to ``float``; ``done`` may be ``bool`` or a NumPy bool.
    """
    name = _env_name(env)
    where = f"env {name}.step returned a result whose"
    if isinstance(obj, tuple) and len(obj) == 4:
        obj = StepResult(*obj)
    if not isinstance(obj, StepResult):
        shape = f"a {len(obj)}-tuple" if isinstance(obj, tuple) else type(obj).__name__
        raise EnvOutputError(f"env {name}.step returned {shape}; {_EXPECTED}")
    if not isinstance(obj.observation, str):
        raise EnvOutputError(
            f"{where} observation is {type(obj.observation).__name__}; expected str"
        )
    reward = _check_reward(obj.reward, where)
    done = obj.done
    if not isinstance(done, bool) and type(done).__name__ != "bool_":
        raise EnvOutputError(f"{where} done is {type(done).__name__}; expected bool")
    if not isinstance(obj.info, dict):
        raise EnvOutputError(f"{where} info is {type(obj.info).__name__}; expected dict")
    return StepResult(obj.observation, reward, bool(done), obj.info)


# -- tools ------------------------------------------------------------------------------
# An env may offer tools to a chat model. It declares them in ``tools`` (OpenAI-style
# dicts: ``{"type": "function", "function": {"name", "description", "parameters"}}``,
# ``parameters`` a JSON schema; they reach the chat template as ``tools=``) and runs one
# in ``call_tool(name, arguments) -> str``. The trajectory runner parses the model's tool
# calls (``rollart.chat.tools``), checks them against ``tools``, calls ``call_tool`` and
# returns its text (or the error of a malformed call, unknown tool or bad arguments) as a
# ``tool`` message; ``step(action)`` then only receives the final, non-tool answer.


@runtime_checkable
class ToolEnv(Env, Protocol):
    """An ``Env`` that also offers tools: ``tools`` and ``call_tool``."""

    tools: list

    def call_tool(self, name: str, arguments: dict) -> str: ...


def env_tools(env: object) -> list[dict]:
    """The tools ``env`` declares (``[]`` if none), checked: ``EnvOutputError`` says
    which entry is malformed, or that ``call_tool`` is missing."""
    tools = getattr(env, "tools", None)
    if tools is None or (isinstance(tools, (list, tuple)) and not tools):
        return []
    name = _env_name(env)
    if not isinstance(tools, (list, tuple)):
        raise EnvOutputError(f"env {name}.tools is {type(tools).__name__}; expected a list "
                             "of OpenAI-style tool dicts")
    if not callable(getattr(env, "call_tool", None)):
        raise EnvOutputError(f"env {name} declares tools but has no call_tool(name, "
                             "arguments) -> str method")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]
                and isinstance(fn.get("parameters", {}), dict)):
            raise EnvOutputError(
                f"env {name}.tools[{i}] is not a tool declaration; expected "
                '{"type": "function", "function": {"name": str, "description": str, '
                '"parameters": <JSON schema dict>}}')
    return [dict(t) for t in tools]


def check_tool_result(obj: object, env: object | str | None = None,
                      tool: str = "") -> str:
    """Return ``obj`` if it is the ``str`` a ``call_tool`` must return, else raise
    ``EnvOutputError``."""
    if not isinstance(obj, str):
        raise EnvOutputError(f"env {_env_name(env)}.call_tool({tool!r}) returned "
                             f"{type(obj).__name__}; expected a str result")
    return obj
