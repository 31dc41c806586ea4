"""``GraphError`` and the two checks every graph dataclass's ``__post_init__`` makes:
a condition with the message that says what to change, and settings that must be
numbers (before they are compared). ``rollart.config.graph`` and
``rollart.config.training`` use them."""

from __future__ import annotations


class GraphError(ValueError):
    """A graph that cannot run; the message says what to change."""


def check(cond: bool, msg: str):
    if not cond:
        raise GraphError(msg)


def check_numbers(obj, *names: str, integer: bool = False, optional: bool = False) -> None:
    """Type-check settings before comparing them (``"1e-3" > 0`` would be a TypeError)."""
    kinds = (int,) if integer else (int, float)
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        check(isinstance(v, kinds) and not isinstance(v, bool),
              f"{type(obj).__name__}.{name} must be {'an int' if integer else 'a number'}"
              f"{' or None' if optional else ''}, got {type(v).__name__} {v!r}"
              + ("; write it without quotes" if isinstance(v, str) else ""))
