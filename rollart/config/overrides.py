"""``--set FIELD=VALUE`` overrides: one graph field each, typed by its annotation.

Consumes a ``Graph`` and strings such as ``"algo.lr=1e-4"``, ``"rollout.redundancy=1.5"``,
``"policy.temperature=0.8"`` or ``"steps=40"``; produces a new ``Graph`` made with
``dataclasses.replace``, so every dataclass's own ``__post_init__`` checks the result
(a value out of range raises the ``GraphError`` that names the field). Values are parsed
to the field's annotated type (int, float, bool, str, ``None`` for an optional field,
tuples as comma lists) without ``eval``; an unknown key lists the valid ones. Called by
``rollart train --set`` and ``rollart.train(..., set=[...])``; the result is what the
run's ``graph.json`` records.

>>> from rollart.config.graph import Graph
>>> g = apply_overrides(Graph(name="g"), ["algo.lr=1e-4", "policy.temperature=0.8"])
>>> g.algo.lr, g.policy.temperature
(0.0001, 0.8)
"""

from __future__ import annotations

import typing
from dataclasses import fields, is_dataclass, replace

from rollart.config.graph import Graph, GraphError

_NONE = ("none", "null")
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


class OverrideError(GraphError):
    """A ``--set`` that names no field or whose value does not parse to its type."""


def valid_keys(graph: Graph) -> list[str]:
    """Every key ``--set`` accepts for ``graph``: ``steps``, ``algo.lr``,
    ``policy.lora.rank``, ..."""
    keys = []
    for f in fields(graph):
        value = getattr(graph, f.name)
        if is_dataclass(value):
            for g in fields(value):
                inner = _settings_class(type(value), g.name)
                keys.append(f"{f.name}.{g.name}")
                keys += [f"{f.name}.{g.name}.{h.name}" for h in fields(inner)] if inner else []
        else:
            keys.append(f.name)
    return keys


def _settings_class(owner: type, name: str):
    """The settings dataclass an optional field holds (``Policy.lora``: ``LoRA``)."""
    hint = typing.get_type_hints(owner).get(name)
    for arg in typing.get_args(hint) or (hint,):
        if isinstance(arg, type) and is_dataclass(arg):
            return arg
    return None


def parse_assignment(text: str) -> tuple[str, str]:
    """``"algo.lr=1e-4"`` -> ``("algo.lr", "1e-4")``."""
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise OverrideError(f"--set {text!r}: write FIELD=VALUE, e.g. --set algo.lr=1e-4")
    return key.strip(), value.strip()


def apply_overrides(graph: Graph, assignments) -> Graph:
    """``graph`` with each ``FIELD=VALUE`` of ``assignments`` applied, in order."""
    for text in assignments or ():
        key, raw = parse_assignment(text)
        graph = _apply_one(graph, key, raw)
    return graph


def _apply_one(graph: Graph, key: str, raw: str) -> Graph:
    parts = key.split(".")
    if len(parts) == 3 and parts[0] in {f.name for f in fields(graph)} and \
            is_dataclass(getattr(graph, parts[0])):  # policy.lora.rank
        outer = getattr(graph, parts[0])
        inner_cls = (_settings_class(type(outer), parts[1])
                     if parts[1] in {f.name for f in fields(outer)} else None)
        if inner_cls is not None and parts[2] in {f.name for f in fields(inner_cls)}:
            inner = getattr(outer, parts[1]) or inner_cls()  # unset: its defaults
            hint = typing.get_type_hints(inner_cls)[parts[2]]
            try:
                value = parse_value(raw, hint)
                changed = replace(inner, **{parts[2]: value})
            except ValueError as e:
                if isinstance(e, GraphError):
                    raise
                raise OverrideError(f"--set {key}={raw}: {inner_cls.__name__}.{parts[2]} "
                                    f"{e}") from None
            return replace(graph, **{parts[0]: replace(outer, **{parts[1]: changed})})
    owner_name, _, name = key.rpartition(".")
    owner = getattr(graph, owner_name, None) if owner_name else graph
    if "." in owner_name or (owner_name and not is_dataclass(owner)) or \
            name not in {f.name for f in fields(owner)} or \
            (not owner_name and is_dataclass(getattr(graph, name))):
        raise OverrideError(f"--set {key}: no such graph field; valid fields: "
                            + ", ".join(valid_keys(graph)))
    cls = type(owner)
    hint = typing.get_type_hints(cls)[name]
    try:
        value = parse_value(raw, hint)
    except ValueError as e:
        raise OverrideError(f"--set {key}={raw}: {cls.__name__}.{name} {e}") from None
    if owner is graph:
        return replace(graph, **{name: value})
    changed = replace(owner, **{name: value})  # the dataclass's own checks run here
    if cls.__name__ == "GRPO" and name != "alpha" and not owner.alpha_given:
        # an alpha the mode decided stays the mode's (rollart.config.graph.resolve_alpha)
        object.__setattr__(changed, "alpha_given", False)
    return replace(graph, **{owner_name: changed})


def parse_value(raw: str, hint):
    """``raw`` as a value of type ``hint`` (int, float, bool, str, Optional, tuples).

    >>> parse_value("1e-4", float), parse_value("none", int | None)
    (0.0001, None)
    >>> parse_value("H800,H20", tuple[str, ...])
    ('H800', 'H20')
    """
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if raw.lower() in _NONE and type(None) in args:
            return None
        last = None
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(raw, arg)
            except ValueError as e:
                last = e
        raise last or ValueError(f"cannot be {raw!r}")
    if origin is tuple or hint is tuple:
        items = [s.strip() for s in raw.strip("()").split(",") if s.strip()]
        inner = args[0] if args else str
        return tuple(parse_value(s, inner) if inner is not typing.Any else s for s in items)
    if hint is bool:
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"must be true or false, got {raw!r}")
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"must be an int, got {raw!r}") from None
    if hint is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"must be a number, got {raw!r}") from None
    if hint is str:
        return raw
    if hint is type(None):
        if raw.lower() in _NONE:
            return None
        raise ValueError(f"must be none, got {raw!r}")
    raise ValueError(f"cannot be set from the command line (type {hint})")


def check_flags(assignments, **flags) -> None:
    """A ``--set`` of a field that its own flag (``--steps``, ``--alpha``, ...) also
    sets is a contradiction, never a silent winner: raise ``OverrideError``."""
    keys = {parse_assignment(a)[0] for a in assignments or ()}
    for key, value in flags.items():
        field_key = "algo.alpha" if key == "alpha" else key
        if value is not None and field_key in keys:
            flag = "--" + key.replace("_", "-")
            raise OverrideError(f"{flag} and --set {field_key}=... both set {field_key}: "
                                f"give one of them")
