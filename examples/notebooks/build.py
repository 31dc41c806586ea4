"""Build each notebook from its paired script: ``python examples/notebooks/build.py``.

The scripts are the source (``# %%`` code cells, ``# %% [markdown]`` text cells, the
"percent" format editors such as VS Code and Jupytext understand); the test suite checks
that every ``.ipynb`` here holds exactly its script's cells, and executes the notebooks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("quickstart", "multitask")


def cells(script: str) -> list[tuple[str, str]]:
    """``[(kind, source)]`` of a percent-format script."""
    out: list[tuple[str, list[str]]] = []
    for line in script.splitlines():
        if line.startswith("# %%"):
            out.append(("markdown" if "[markdown]" in line else "code", []))
        elif out:
            kind, body = out[-1]
            body.append(line[2:] if kind == "markdown" and line.startswith("# ") else
                        "" if kind == "markdown" and line == "#" else line)
    return [(k, "\n".join(b).strip("\n")) for k, b in out]


def notebook(script: str, name: str = "cell") -> dict:
    nb_cells = []
    for i, (kind, src) in enumerate(cells(script)):
        cell = {"cell_type": kind, "id": f"{name}-{i}", "metadata": {},
                "source": src.splitlines(keepends=True)}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        nb_cells.append(cell)
    return {"cells": nb_cells, "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}


def main() -> int:
    for name in NOTEBOOKS:
        nb = notebook((HERE / f"{name}.py").read_text(), name)
        (HERE / f"{name}.ipynb").write_text(json.dumps(nb, indent=1) + "\n")
        print(f"wrote {HERE / name}.ipynb ({len(nb['cells'])} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
