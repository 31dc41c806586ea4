"""Every ```python and ```bash block in README.md and docs/ is run here at its size, or
carries a marker saying why it cannot be (issue 41): an HTML comment right before it,
``<!-- not run: REASON -->`` (a training run of minutes, a GPU, a cluster, a model folder).
A block marked ``<!-- notebook cell -->`` is a notebook cell: a page's cells run in order
as one notebook, in a real kernel (nbclient), as a reader would run them.

The unmarked Python blocks of a page run in order in one fresh interpreter (a later block
may use an earlier one's names), the unmarked shell blocks with ``bash -e``, both from
the repository root."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash",
         "console": "bash"}
MARKER = re.compile(r"^<!-- not run: (.+\S) -->$")
CELL = "<!-- notebook cell -->"


def blocks(path: Path) -> list[dict]:
    """``{"lang", "code", "line", "why"}`` for each Python or shell block of ``path``;
    ``why`` is the marker's reason (None: the block must run; ``"notebook cell"``: it runs
    as a cell of the page's notebook)."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if m.group(1) in LANGS:
            before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()),
                          "")
            marker = MARKER.match(before)
            why = marker.group(1) if marker else "notebook cell" if before == CELL else None
            out.append({"lang": LANGS[m.group(1)], "code": "\n".join(lines[i + 1:end]),
                        "line": i + 1, "why": why})
        i = end + 1
    return out


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "MPLBACKEND": "Agg"}


def test_the_runner_finds_blocks_and_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n```python\nprint(1)\n```\n<!-- not run: needs a GPU -->\n\n```bash\n"
                    "nvidia-smi\n```\n```text\nnot code\n```\n<!-- notebook cell -->\n"
                    "```python\nx = 2\n```\n")
    assert blocks(page) == [
        {"lang": "python", "code": "print(1)", "line": 2, "why": None},
        {"lang": "bash", "code": "nvidia-smi", "line": 7, "why": "needs a GPU"},
        {"lang": "python", "code": "x = 2", "line": 14, "why": "notebook cell"}]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_runs_or_says_why_not(page):
    found = blocks(page)
    python = "\n\n".join(b["code"] for b in found if b["lang"] == "python" and not b["why"])
    if python:
        done = subprocess.run([sys.executable, "-c", python], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (f"{_name(page)}: a Python block failed (mark it "
                                      f"<!-- not run: REASON --> if it cannot run "
                                      f"here):\n{done.stderr[-3000:]}")
        # a cluster rollart made ends as a scale to zero: every worker exits on its own
        assert "still alive after" not in done.stderr, done.stderr[-3000:]
    for b in found:
        if b["lang"] == "bash" and not b["why"]:
            done = subprocess.run(["bash", "-e", "-c", b["code"]], cwd=ROOT, env=_env(),
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (f"{_name(page)}:{b['line']}: a shell block failed "
                                          f"(mark it <!-- not run: REASON --> if it cannot "
                                          f"run here):\n{done.stderr[-3000:]}")


NOTEBOOKS = [p for p in PAGES if any(b["why"] == "notebook cell" for b in blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", NOTEBOOKS, ids=_name)
def test_notebook_cells_run_as_written(page, tmp_path):
    """A page's notebook cells, in order, as one notebook in a real kernel (run from a
    fresh folder, as a reader's notebook would be), each without an error; no Dask INFO
    log reaches a cell's output."""
    import nbclient
    import nbformat

    cells = [b["code"] for b in blocks(page) if b["why"] == "notebook cell"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env = _env()
    old = {k: os.environ.get(k) for k in ("PYTHONPATH", "MPLBACKEND")}
    os.environ.update({k: env[k] for k in old})  # the kernel inherits the test's environment
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    logs = [line for c in nb.cells for o in c.outputs if o.get("name") == "stderr"
            for line in o.get("text", "").splitlines()]
    assert not [ln for ln in logs if " - INFO - " in ln], logs
    assert list((tmp_path / "runs").glob("*/model/config.json")), \
        f"{_name(page)}: the notebook's run saved no model under {tmp_path}/runs"
