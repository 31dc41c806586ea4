"""Reading the env's action out of the assistant's text (``Task.parse_action``).

Consumes the text a policy generated in one turn; produces the action its env steps
with: ``whole_text`` (the default), ``last_line``, ``answer_tag`` (the last
``<answer>…</answer>``), ``strip_think`` (without ``<think>…</think>``) and
``ParseChain`` to combine them. All are module-level functions or a plain class, so a
``Task`` holding one pickles to the env managers. Used by ``rollart.env.tasks`` (the
default) and by task authors.
"""

from __future__ import annotations

import re

__all__ = ["ParseChain", "answer_tag", "last_line", "strip_think", "whole_text"]

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def whole_text(text: str) -> str:
    """The whole assistant text, stripped (the default ``Task.parse_action``).

    >>> whole_text("  up \\n")
    'up'
    """
    return text.strip()


def last_line(text: str) -> str:
    """The last non-empty line, stripped.

    >>> last_line("I think so.\\nleft\\n")
    'left'
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def answer_tag(text: str) -> str:
    """The content of the last ``<answer>…</answer>``, stripped; ``""`` when there is
    none (so an answer without the tags is an invalid action, not a lucky one).

    >>> answer_tag("so <answer> 7 </answer>")
    '7'
    >>> answer_tag("7")
    ''
    """
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else ""


def strip_think(text: str) -> str:
    """The text without its ``<think>…</think>`` blocks (an unclosed ``<think>`` hides
    everything after it), stripped.

    >>> strip_think("<think>left is a wall</think> up")
    'up'
    """
    text = _THINK.sub("", text)
    if "<think>" in text:
        text = text[:text.index("<think>")]
    return text.strip()


class ParseChain:
    """Apply parsers in order, e.g. ``ParseChain(strip_think, answer_tag)`` (a class,
    not a lambda, so a ``Task`` using it pickles).

    >>> ParseChain(strip_think, answer_tag)("<think>x</think><answer>up</answer>")
    'up'
    """

    def __init__(self, *parsers):
        if not parsers or not all(callable(p) for p in parsers):
            raise TypeError("ParseChain takes one or more callables text -> text")
        self.parsers = parsers

    def __call__(self, text: str) -> str:
        for parse in self.parsers:
            text = parse(text)
        return text

    def __repr__(self) -> str:
        return "ParseChain(" + ", ".join(getattr(p, "__name__", repr(p))
                                         for p in self.parsers) + ")"
