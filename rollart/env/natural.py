"""Tasks in natural language for a real chat model (``graphs/real.py``).

The built-in games speak the toy's word-level dialect (``guess : higher . left 6 8 9 7 .
act :``). These speak English, so a pretrained instruct model such as
SmolLM2-135M-Instruct (``rollart.pretrained``) can start on them and improve from reward.
Each is data + env + reward in one place, rendered by the model's own chat template:

* ``guess_number``: a multi-turn feedback task. The env thinks of a whole number in
  1..``high`` and answers each guess with "Higher."/"Lower." and the guesses left; the
  first integer in the reply is the guess. Bisection always wins within ``max_turns``
  (4 for 1..10); guessing at random wins ~40%; a reply with no number is invalid (0.1).
* ``calculator``: a tool task. A question such as "What is 47 + 38?" with one tool,
  ``python``, described in the system prompt (``tools_in_prompt``: SmolLM2's template
  renders no ``tools=``) and called in the Hermes format the prompt shows
  (``<tool_call>{"name": "python", "arguments": {"code": "47 + 38"}}</tool_call>``); the
  sandboxed result comes back as a ``tool`` message, and a reply without a call is the
  final answer, its last integer judged. Two-digit operands: a 135M model's mental
  arithmetic is often wrong, the tool's never.

Rewards are the env's returns (1 for a right final answer, minus 0.1 per invalid turn).
Called by ``graphs/real.py`` and the tests; envs run on the CPU env pool like every
adapter (``rollart.env.adapters.base``).
"""

from __future__ import annotations

import random
import re
from functools import partial

from rollart.env.adapters.base import INVALID_PENALTY, AdapterEnv, make_task
from rollart.env.adapters.tool import OPS, CalcToolEnv, ToolLimits
from rollart.chat.tools import format_tool_call

_INT = re.compile(r"-?\d+")

GUESS_SYSTEM = ("You are playing a number guessing game. Each turn, reply with one whole "
                "number as your guess and nothing else. Use the hints to narrow it down.")
CALC_SYSTEM = ("You are a careful assistant that answers arithmetic questions. You have a "
               "python tool that evaluates an expression. To use it, reply with exactly:\n"
               + format_tool_call("python", {"code": "12 * 34"}, "hermes") + "\n"
               "You will get the result back. Then reply with the final answer as a "
               "number and nothing else.")


def first_int(text: str) -> int | None:
    """The first integer written in ``text``.

    >>> first_int("I guess 7, maybe 8"), first_int("no idea")
    (7, None)
    """
    m = _INT.search(text)
    return int(m.group()) if m else None


def last_int(text: str) -> int | None:
    """The last integer written in ``text`` (a final answer's number).

    >>> last_int("47 + 38 = 85")
    85
    """
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


class GuessNumberEnv(AdapterEnv):
    """Guess a whole number in 1..``high`` with "Higher."/"Lower." after each guess."""

    _live = ()

    def __init__(self, max_turns: int = 4, high: int = 10, name: str = "guess_number") -> None:
        super().__init__(max_turns)
        self.high, self.name = high, name
        self._secret = 0

    def _reset(self, seed: int) -> str:
        self._secret = random.Random(seed).randint(1, self.high)
        return (f"I am thinking of a whole number from 1 to {self.high}. Guess it: you have "
                f"{self.max_turns} guesses. Reply with just the number.")

    def _step(self, action: str):
        guess = first_int(action)
        left = self.max_turns - self._turn
        if guess is None:
            return (f"That was not a number. Reply with one whole number from 1 to "
                    f"{self.high}. {_left(left)}", -INVALID_PENALTY, False, {"invalid": True})
        if guess == self._secret:
            return f"Correct, it was {guess}!", 1.0, True, {"success": True}
        hint = "Higher." if self._secret > guess else "Lower."
        return (f"{hint} The number is {'greater' if hint == 'Higher.' else 'less'} than "
                f"{guess}. {_left(left)}", 0.0, False, {"success": False})


def _left(n: int) -> str:
    return f"You have {n} guess{'es' if n != 1 else ''} left." if n > 0 else "No guesses left."


def guess_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed random move: a number in 1..10."""
    return str(rng.randint(1, 10))


class CalculatorEnv(CalcToolEnv):
    """``CalcToolEnv``'s tool and sandbox with an English question and two-digit
    operands; the final answer is the reply's last integer."""

    def __init__(self, max_turns: int = 3, limits: ToolLimits = ToolLimits(),
                 name: str = "calculator") -> None:
        super().__init__(max_turns=max_turns, limits=limits, name=name, tool_format="hermes")

    def _reset(self, seed: int) -> str:
        rng = random.Random(seed)
        op = rng.choice(OPS)
        a, b = rng.randint(10, 99), rng.randint(10, 99) if op != "*" else rng.randint(2, 9)
        self._question, self._answer = f"{a} {op} {b}", eval(f"{a} {op} {b}")  # noqa: S307
        return f"What is {self._question}?"

    def _step(self, action: str):
        number = last_int(action)
        if number is None:
            return ("Reply with the final answer as a number, or call the python tool.",
                    -INVALID_PENALTY, False, {"invalid": True})
        right = number == self._answer
        return ("Correct." if right else "Wrong."), (1.0 if right else 0.0), True, \
            {"success": right}


def calculator_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed move: the question as a call while it is in view, then a number."""
    m = re.search(r"What is (.+)\?", observation)
    if m:
        return format_tool_call("python", {"code": m.group(1)}, "hermes")
    seen = _INT.findall(observation)
    return seen[-1] if seen else str(rng.randint(0, 200))


def guess_number_task(name: str = "guess_number", max_turns: int = 4, high: int = 10,
                      max_new_tokens: int = 8, **fields):
    return make_task(name, partial(GuessNumberEnv, max_turns=max_turns, high=high, name=name),
                     max_turns=max_turns, warmup_action=guess_warmup_action,
                     max_new_tokens=max_new_tokens, vocab_seeds=range(4),
                     description=f"guess a number in 1..{high} from higher/lower hints",
                     system_prompt=GUESS_SYSTEM, **fields)


def calculator_task(name: str = "calculator", max_turns: int = 3, max_new_tokens: int = 48,
                    limits: ToolLimits = ToolLimits(), **fields):
    return make_task(name, partial(CalculatorEnv, max_turns=max_turns, limits=limits, name=name),
                     max_turns=max_turns, warmup_action=calculator_warmup_action,
                     max_new_tokens=max_new_tokens, vocab_seeds=range(4),
                     description="two-digit arithmetic with a sandboxed python tool",
                     system_prompt=CALC_SYSTEM, tools_in_prompt=True, tool_format="hermes",
                     **fields)
