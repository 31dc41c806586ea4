"""A finished run read back: its graph and its models, and held-out evaluation of them.

Consumes a run directory (``graph.json``, ``model/``, ``warmup_model/``) or a bare Hugging
Face model folder; produces the ``Graph`` the run trained (its recorded source with the
recorded settings applied, as ``--resume`` rebuilds it) and the same held-out
evaluation the end of ``rollart train`` prints (``rollart.control.loop._evaluate_run``:
seeds training never saw, the policy's conversation options). Called by
``rollart eval MODEL_OR_RUN [GRAPH] [--seeds N]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace


def is_run_dir(path) -> bool:
    return (Path(path) / "graph.json").is_file()


def run_graph(run_dir, given=None):
    """The ``Graph`` the run in ``run_dir`` trained; ``given`` (a graph spec) replaces
    its recorded source. A run of a graph given as a Python object is rebuilt from its
    recorded fields (built-in tasks only)."""
    from rollart.control.checkpoint import CheckpointError, graph_from
    from rollart.config.graph import Graph, Policy, load_graph

    saved = json.loads((Path(run_dir) / "graph.json").read_text())
    if given is not None and not saved.get("source"):
        return load_graph(given)[0]
    try:
        return graph_from(SimpleNamespace(graph=saved, path=str(run_dir)), given)
    except CheckpointError:  # "<python>": no source to load, the fields are all we have
        return Graph(name=saved["name"], tasks=tuple(saved["tasks"]),
                     policy=Policy(**saved["policy"]))


def evaluate_target(target, graph=None, seeds: int = 64) -> dict:
    """Held-out success per task of ``target``: a run directory (its ``model/``, and its
    ``warmup_model/`` for the before/after pair; its graph unless ``graph`` is given) or
    a model folder (``graph``, default the default graph). A folder that is neither is
    a ``ModelFolderError`` (``rollart.model.check_model_folder``)."""
    from rollart.control.loop import RunResult, _evaluate_run
    from rollart.config.graph import load_graph
    from rollart.model import check_model_folder

    from rollart.pretrained import resolve_model

    target = Path(target) if is_run_dir(Path(target)) else Path(resolve_model(str(target)))
    model = target / "model" if is_run_dir(target) else target
    check_model_folder(str(model))  # before the graph: "not a model" is the error to see
    if is_run_dir(target):
        g = run_graph(target, graph)
        warm = target / "warmup_model"
        warm = str(warm) if (warm / "config.json").is_file() else None
    else:
        g, warm = load_graph(graph)[0], None
    from rollart.config.templates import check_templates

    check_templates(g, str(model))
    result = RunResult(str(target), [], str(model), warm)
    out = _evaluate_run(g, result, seeds)
    return {"model": str(model), "graph": g.name, "tasks": g.task_names, **out}
