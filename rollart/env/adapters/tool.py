"""A tool-use environment: the model calls a Python tool that runs in a sandboxed
subprocess; results come back as tool messages.

``run_python(code, limits)`` runs code in a fresh process (``rollart.env.adapters.sandbox``:
forked from a clean ``python -I`` zygote; empty environment, a temporary working
directory, no stdin) that first caps itself with ``setrlimit`` (CPU seconds, address
space, file size, open files) and is killed at a wall-clock time-out; it returns
``ToolResult(ok, output)`` with stdout (or the error's last line), truncated. A lone
expression's value is printed, like a REPL.

``CalcToolEnv`` is a task for it: ``calc : what is 7 * 8 ? use python or answer . act :``.
It declares one tool, ``python`` (``{"code": string}``; ``rollart.env.protocol.ToolEnv``),
so in chat mode the trajectory runner parses the model's ``<tool_call>`` blocks, runs
``call_tool("python", {"code": ...})`` and returns the result as a ``tool`` message;
``step`` then gets the final answer, ``answer <number>`` or a bare number (ends the
episode; success when right). In raw mode (no runner tool turn) ``step`` runs a tool call
itself: a ``<tool_call>`` block or the short text form ``python <code>`` gives the
observation ``tool : 56 . act :`` with ``info["role"] = "tool"``. Anything else, and a
malformed or unknown call, is invalid (``INVALID_PENALTY``). Tool output reaches the
model only as an observation or ``tool`` message, both masked out of the loss.

``calc_tool_task(tool_format=...)`` picks what the format warm-up teaches:
``"hermes"`` (tool calls as ``<tool_call>{"name": "python", ...}</tool_call>``, for chat
models and the chat toy), another family of ``rollart.chat.tool_formats`` (``"llama3"``,
``"mistral"``, ``"qwen3_coder"``: the task's ``Task.tool_format`` is then that family, so
rollout parses what the warm-up taught, and so does ``step`` in raw mode) or ``"text"``
(``python <code>``, a few words: the word-level toy in raw mode; the default, as the
``calc`` name and ``graphs/ecosystem.py`` use it). ``None``: the chat model's own family,
detected from its template at rollout (``Task.tool_format`` unset; ``graphs/chat.py``),
with the warm-up writing hermes calls, the chat toy's family.
"""

from __future__ import annotations

import random
import re
import signal
from dataclasses import dataclass
from functools import partial

from rollart.env.adapters.base import INVALID_PENALTY, AdapterEnv, make_task
from rollart.env.adapters.sandbox import run_code
from rollart.chat.tool_formats import TOOL_FORMATS
from rollart.chat.tools import (
    ToolCall,
    ToolError,
    check_call,
    format_tool_call,
    has_tool_call,
    parse_tool_calls,
    python_tool,
)


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


def run_python(code: str, limits: ToolLimits = ToolLimits(), fresh: bool = False) -> ToolResult:
    """Run ``code`` sandboxed under ``limits`` (``rollart.env.adapters.sandbox``: a process forked
    for the call from a clean zygote; ``fresh=True``: an interpreter started for it).

    >>> run_python("6 * 7")
    ToolResult(ok=True, output='42')
    >>> run_python("1 / 0").output
    'ZeroDivisionError: division by zero'
    """
    done = run_code(code, limits.cpu_seconds, limits.memory_mb, limits.wall_seconds, fresh)
    if done.timed_out:
        return ToolResult(False, f"timeout after {limits.wall_seconds}s")
    if done.returncode == 0:
        return ToolResult(True, done.stdout.strip()[: limits.max_output])
    err = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return ToolResult(False, f"cpu time limit of {limits.cpu_seconds}s exceeded")
    if done.returncode < 0:
        return ToolResult(False, f"killed by signal {-done.returncode}")
    return ToolResult(False, (err[-1] if err else f"exit {done.returncode}")
                      [: limits.max_output])


OPS = ("+", "-", "*")
#: what ``calc_tool_task(tool_format=...)`` takes: the word form, or a tool-call format
CALC_FORMATS = ("text", *TOOL_FORMATS)


class CalcToolEnv(AdapterEnv):
    """Arithmetic with a Python tool (``tools`` / ``call_tool``); final answers go
    through ``step``."""

    _live = ()

    def __init__(self, max_turns: int = 3, limits: ToolLimits = ToolLimits(),
                 name: str = "calc", tool_format: str = "hermes") -> None:
        super().__init__(max_turns)
        self.limits, self.name = limits, name
        self.tool_format = tool_format  # the call syntax ``step`` reads in raw mode
        self._question, self._answer = "", 0
        self.tool_calls = 0

    @property
    def tools(self) -> list[dict]:
        return [python_tool()]

    def call_tool(self, name: str, arguments: dict) -> str:
        """Run one checked call; a bad call's error comes back as the result text."""
        call = check_call(ToolCall(name, arguments), self.tools)
        if isinstance(call, ToolError):
            return f"error : {call.message}"
        self.tool_calls += 1
        result = run_python(call.arguments["code"], self.limits)
        return (result.output or "no output") if result.ok else f"error {result.output}"

    def _reset(self, seed: int) -> str:
        rng = random.Random(seed)
        a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice(OPS)
        self._question, self._answer = f"{a} {op} {b}", eval(f"{a} {op} {b}")
        return f"{self.name} : what is {self._question} ? use python or answer . act :"

    def _step(self, action: str):
        words = action.strip().split()
        head = words[0].lower() if words else ""
        if has_tool_call(action, self.tool_format):  # raw mode: nobody ran it before step
            return self._tool_turn(parse_tool_calls(action, self.tool_format, self.tools))
        if head == "python" and len(words) > 1:
            return self._tool_turn([ToolCall("python", {"code": " ".join(words[1:])})])
        number = words[1] if head == "answer" and len(words) > 1 else (
            words[0] if len(words) == 1 and _is_int(words[0]) else None)
        if number is not None:
            right = _is_int(number) and int(number) == self._answer
            obs = f"{self.name} : {'success' if right else 'failure'} ."
            return obs, (1.0 if right else 0.0), True, {"success": right}
        return (f"invalid . {self.name} : what is {self._question} ? use python or answer . "
                "act :", -INVALID_PENALTY, False, {"invalid": True})

    def _tool_turn(self, calls):
        checked = [check_call(c, self.tools) for c in calls]
        bad = [c.message for c in checked if isinstance(c, ToolError)]
        if bad:
            return (f"tool : error : {bad[0]} . act :", -INVALID_PENALTY, False,
                    {"role": "tool", "invalid": True, "tool_ok": False})
        outputs = [self.call_tool(c.name, c.arguments) for c in checked]
        ok = not any(o.startswith("error") for o in outputs)
        return (f"tool : {' ; '.join(outputs)} . act :", 0.0, False,
                {"role": "tool", "tool_ok": ok})


def _is_int(word: str) -> bool:
    return word.lstrip("-").isdigit()


def _question(observation: str) -> str | None:
    words = observation.split()
    if "what" not in words:
        return None
    i = words.index("what")
    return " ".join(words[i + 2:i + 5])


def calc_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed random move: the question as a ``python <code>`` call, or a random
    answer (the ``"text"`` tool format)."""
    question = _question(observation)
    if question and rng.random() < 0.5:
        return "python " + question
    return f"answer {rng.randint(-8, 81)}"


def calc_hermes_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed move in the hermes format (``calc_call_warmup_action``).

    >>> calc_hermes_warmup_action(random.Random(1), "calc : what is 3 * 4 ? use python")
    '<tool_call>\\n{"name": "python", "arguments": {"code": "3 * 4"}}\\n</tool_call>'
    """
    return calc_call_warmup_action(rng, observation, "hermes")


def calc_call_warmup_action(rng: random.Random, observation: str,
                            tool_format: str = "hermes") -> str:
    """A well-formed move in a chat template's format: while the question is in view,
    the question as a call to the python tool in ``tool_format``; after the tool's
    result, an answer: a number seen in the observation (half the time: the tool's result) or a
    uniform one in -8..81. Its success rate (about half of the calls it copies right) is
    the baseline RL must beat by answering with the tool's result every time.

    Why always the call first: a tiny model must learn to copy the question into
    ``code`` during the warm-up, and with calls on half of the first turns the chat toy
    had copied none right after 150 warm-up steps (0 of 53 calls), so RL never saw a
    tool call pay off.

    >>> calc_call_warmup_action(random.Random(1), "calc : what is 3 * 4 ?", "llama3")
    '{"name": "python", "parameters": {"code": "3 * 4"}}'
    """
    question = _question(observation)
    if question:
        return format_tool_call("python", {"code": question}, tool_format)
    seen = re.findall(r"-?\d+", observation)
    if seen and rng.random() < 0.5:
        return f"answer {rng.choice(seen)}"
    return f"answer {rng.randint(-8, 81)}"


def calc_tool_task(name: str = "calc", max_turns: int = 3, limits: ToolLimits = ToolLimits(),
                   top_p: float | None = None, tool_format: str | None = "text",
                   max_new_tokens: int | None = None, **task_fields):
    """The tool-use arithmetic task (reward: the env's return, minus invalid moves).

    ``tool_format`` picks the warm-up's call syntax (module docstring; ``None``: the chat
    model's own family, the warm-up's calls hermes); the env accepts the text form and
    that format's calls. ``max_new_tokens`` defaults to what that syntax needs (5 or
    48)."""
    if tool_format is not None and tool_format not in CALC_FORMATS:
        raise ValueError(f"calc_tool_task: tool_format must be one of {CALC_FORMATS} or "
                         f"None, got {tool_format!r}; use None (the chat model's own "
                         "family) for chat models, 'text' for the word-level toy")
    calls = tool_format != "text"
    factory = partial(CalcToolEnv, max_turns=max_turns, limits=limits, name=name,
                      tool_format=tool_format if calls and tool_format else "hermes")
    warmup = calc_warmup_action
    if calls:  # rollout parses the calls the warm-up writes (None: the model's family)
        task_fields = {"tool_format": tool_format, **task_fields}
        warmup = (calc_hermes_warmup_action if tool_format in ("hermes", None) else
                  partial(calc_call_warmup_action, tool_format=tool_format))
    words = ["tool", "error", "no", "output", "python", "answer", "what", "is", "?", "use",
             "or", *OPS, *(str(n) for n in range(-8, 82))]
    return make_task(name, factory, max_turns=max_turns,
                     warmup_action=warmup,
                     max_new_tokens=max_new_tokens or (48 if calls else 5),
                     extra_words=words, vocab_seeds=range(4),
                     description="arithmetic with a sandboxed Python tool", top_p=top_p,
                     **task_fields)
