"""A tool-use environment: the model calls a Python tool that runs in a sandboxed
subprocess; results come back as tool messages.

``run_python(code, limits)`` runs code in a fresh ``python -I`` child (empty environment,
a temporary working directory, no stdin) that first caps itself with ``setrlimit``
(CPU seconds, address space, file size, open files) and is killed at a wall-clock
time-out; it returns ``ToolResult(ok, output)`` with stdout (or the error's last line),
truncated. A lone expression's value is printed, like a REPL.

``CalcToolEnv`` is a task for it: ``calc : what is 7 * 8 ? use python or answer . act :``.
The model replies ``python <code>`` (the tool runs; its result is the next observation,
``tool : 56 . act :``, with ``info["role"] = "tool"``) or ``answer <number>`` (ends the
episode; success when right). Anything else is invalid (``INVALID_PENALTY``). Tool
output reaches the model only as an observation, and the ``TokenLog`` masks every
observation token out of the loss, so tool tokens never get gradient.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial

from rollart.env.adapters.base import INVALID_PENALTY, AdapterEnv, make_task


@dataclass(frozen=True)
class ToolLimits:
    """Sandbox limits of one tool call."""

    cpu_seconds: int = 2
    memory_mb: int = 512
    wall_seconds: float = 5.0
    max_output: int = 400  # characters of output returned to the model


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str


_CHILD = """\
import resource, sys
cpu, mem = int(sys.argv[1]), int(sys.argv[2]) * 1024 * 1024
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
code = sys.stdin.read()
del resource, cpu, mem
try:
    tree = compile(code, "<tool>", "eval")
except SyntaxError:
    exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})
else:
    value = eval(tree, {"__name__": "__tool__"})
    if value is not None:
        print(value)
"""


def run_python(code: str, limits: ToolLimits = ToolLimits()) -> ToolResult:
    """Run ``code`` in a sandboxed subprocess under ``limits``.

    >>> run_python("6 * 7")
    ToolResult(ok=True, output='42')
    >>> run_python("1 / 0").output
    'ZeroDivisionError: division by zero'
    """
    with tempfile.TemporaryDirectory(prefix="rollart-tool-") as cwd:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _CHILD, str(limits.cpu_seconds),
                 str(limits.memory_mb)],
                input=code, capture_output=True, text=True, cwd=cwd,
                env={"PATH": os.defpath}, timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            return ToolResult(False, f"timeout after {limits.wall_seconds}s")
    if proc.returncode == 0:
        return ToolResult(True, proc.stdout.strip()[: limits.max_output])
    err = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return ToolResult(False, f"cpu time limit of {limits.cpu_seconds}s exceeded")
    if proc.returncode < 0:
        return ToolResult(False, f"killed by signal {-proc.returncode}")
    return ToolResult(False, (err[-1] if err else f"exit {proc.returncode}")
                      [: limits.max_output])


OPS = ("+", "-", "*")


class CalcToolEnv(AdapterEnv):
    """Arithmetic with a Python tool: ``python <code>`` or ``answer <number>``."""

    _live = ()

    def __init__(self, max_turns: int = 3, limits: ToolLimits = ToolLimits(),
                 name: str = "calc") -> None:
        super().__init__(max_turns)
        self.limits, self.name = limits, name
        self._question, self._answer = "", 0
        self.tool_calls = 0

    def _reset(self, seed: int) -> str:
        rng = random.Random(seed)
        a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice(OPS)
        self._question, self._answer = f"{a} {op} {b}", eval(f"{a} {op} {b}")
        return f"{self.name} : what is {self._question} ? use python or answer . act :"

    def _step(self, action: str):
        words = action.strip().split()
        head = words[0].lower() if words else ""
        if head == "python" and len(words) > 1:
            self.tool_calls += 1
            result = run_python(" ".join(words[1:]), self.limits)
            status = "" if result.ok else "error "
            obs = f"tool : {status}{result.output or 'no output'} . act :"
            return obs, 0.0, False, {"role": "tool", "tool_ok": result.ok}
        if head == "answer" and len(words) > 1:
            try:
                right = int(words[1]) == self._answer
            except ValueError:
                right = False
            obs = f"{self.name} : {'success' if right else 'failure'} ."
            return obs, (1.0 if right else 0.0), True, {"success": right}
        return (f"invalid . {self.name} : what is {self._question} ? use python or answer . "
                "act :", -INVALID_PENALTY, False, {"invalid": True})


def calc_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed random move: the question as a tool call, or a random answer."""
    words = observation.split()
    if "what" in words and rng.random() < 0.5:
        i = words.index("what")
        return "python " + " ".join(words[i + 2:i + 5])
    return f"answer {rng.randint(-8, 81)}"


def calc_tool_task(name: str = "calc", max_turns: int = 3, limits: ToolLimits = ToolLimits(),
                   top_p: float | None = None):
    """The tool-use arithmetic task (reward: the env's return, minus invalid moves)."""
    factory = partial(CalcToolEnv, max_turns=max_turns, limits=limits, name=name)
    words = ["tool", "error", "no", "output", "python", "answer", "what", "is", "?", "use",
             "or", *OPS, *(str(n) for n in range(-8, 82))]
    return make_task(name, factory, max_turns=max_turns, warmup_action=calc_warmup_action,
                     max_new_tokens=5, extra_words=words, vocab_seeds=range(4),
                     description="arithmetic with a sandboxed Python tool", top_p=top_p)
