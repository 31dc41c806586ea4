"""A small OpenEnv environment built with openenv's own classes: arithmetic with an MCP
``calculate`` tool, for ``rollart.env.adapters.openenv``'s task, graph and tests.

``CalcEnvironment`` is an ``openenv`` ``MCPEnvironment`` (its tools on a ``FastMCP``
server, reached through ``ListToolsAction`` / ``CallToolAction``); ``reset(seed)`` asks
``a op b`` with one-digit operands (``CalcObservation.prompt``), and a ``CalcAction``
whose ``message`` is ``answer <n>`` or a bare number ends the episode, reward 1 and
``success`` when exact. Run as a script (``python <this file> --port N``;
``SERVER_SCRIPT`` is its path) it serves the environment over OpenEnv's HTTP/WebSocket
server on 127.0.0.1 (``create_fastapi_app``, uvicorn); it then imports no rollart.
"""

from __future__ import annotations

import os
import random
import re
import uuid

from fastmcp import FastMCP
from fastmcp.exceptions import ToolError
from openenv.core.env_server import Action, MCPEnvironment, Observation, State

SERVER_SCRIPT = os.path.abspath(__file__)
_EXPRESSION = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")


class CalcAction(Action):
    message: str


class CalcObservation(Observation):
    prompt: str = ""
    success: bool = False


def calculate(expression: str) -> str:
    """Evaluate 'a op b' for integers a, b and op one of + - *, e.g. '7 * 8'."""
    m = _EXPRESSION.fullmatch(expression)
    if m is None:
        raise ToolError(f"cannot evaluate {expression!r}; write e.g. '7 * 8'")
    a, op, b = int(m[1]), m[2], int(m[3])
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


class CalcEnvironment(MCPEnvironment):
    """One-digit arithmetic; the ``calculate`` tool answers it."""

    def __init__(self) -> None:
        mcp = FastMCP("openenv-calc")
        mcp.tool(calculate)
        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)
        self._answer, self._question = 0, ""

    def reset(self, seed=None, episode_id=None, **kwargs) -> CalcObservation:
        rng = random.Random(seed)
        a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice("+-*")
        self._question, self._answer = f"{a} {op} {b}", int(calculate(f"{a} {op} {b}"))
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return CalcObservation(prompt=f"openenv_calc : what is {self._question} ? use "
                                      "calculate or answer . act :")

    def _step_impl(self, action, timeout_s=None, **kwargs) -> CalcObservation:
        self._state.step_count += 1
        words = getattr(action, "message", "").strip().split()
        number = words[-1] if words and len(words) <= 2 else ""
        if not number.lstrip("-").isdigit():
            return CalcObservation(prompt=f"invalid . what is {self._question} ? answer "
                                          "<number> . act :", reward=-0.1)
        right = int(number) == self._answer
        return CalcObservation(prompt=f"openenv_calc : {'success' if right else 'failure'} .",
                               done=True, reward=float(right), success=right)

    @property
    def state(self) -> State:
        return self._state


def app():
    """The environment's FastAPI app (OpenEnv's server: ``/ws``, ``/reset``, ``/step``)."""
    from openenv.core.env_server import create_fastapi_app

    return create_fastapi_app(CalcEnvironment, CalcAction, CalcObservation)


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app(), host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
