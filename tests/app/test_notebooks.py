"""The notebooks in ``examples/notebooks/`` hold their paired scripts' cells, and execute
(nbclient, a real kernel, an in-process tagged cluster, tiny settings)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NB_DIR = ROOT / "examples" / "notebooks"
TINY = {
    "quickstart": {"ROLLART_NB_STEPS": "2", "ROLLART_NB_WARMUP": "5"},
    "multitask": {"ROLLART_NB_STEPS": "30", "ROLLART_NB_STOP_AT": "2",
                  "ROLLART_NB_WARMUP": "5", "ROLLART_NB_GROUPS": "2"},
}


def _build():
    spec = importlib.util.spec_from_file_location("nb_build", NB_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(TINY))
def test_notebook_holds_its_scripts_cells(name):
    build = _build()
    want = build.notebook((NB_DIR / f"{name}.py").read_text(), name)["cells"]
    have = json.loads((NB_DIR / f"{name}.ipynb").read_text())["cells"]
    assert [(c["cell_type"], "".join(c["source"])) for c in have] == \
        [(c["cell_type"], "".join(c["source"])) for c in want], \
        f"{name}.ipynb is out of date: run python examples/notebooks/build.py"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_notebook_executes(name, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    run_dir = tmp_path / "run"
    for k, v in {**TINY[name], "ROLLART_NB_THREADS": "1",
                 "ROLLART_NB_RUN_DIR": str(run_dir)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if name == "multitask":  # stopped at STOP_AT: the step under way when asked finishes
        assert 2 <= len(rows) <= 3
    else:
        assert len(rows) == 2
    outputs = "".join(o.get("text", "") + json.dumps(o.get("data", {}))
                      for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    logs = [line for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.get("name") == "stderr" for line in o.get("text", "").splitlines()]
    # only what a reader needs: no Dask INFO logs (rollart.quiet() in the first cell)
    assert not [ln for ln in logs if " - INFO - " in ln or "distributed." in ln], logs
    if name == "quickstart":
        assert "trained" in outputs  # the samples table, grouped by state
    else:
        assert "stopped" in outputs and (run_dir / "report.html").exists()
        assert "boxpush" in outputs and "image/png" in outputs
