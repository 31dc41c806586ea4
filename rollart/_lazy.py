"""Names a package exports but imports on first use (PEP 562 module ``__getattr__``).

Used by ``rollart`` and ``rollart.rollout`` so that importing a light module of theirs
(``rollart.types``, ``rollart.rollout.base``) does not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(namespace: dict, where: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports ``where[name]`` (a module path), takes
    ``name`` from it and caches it in ``namespace`` (the package's ``globals()``)."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
