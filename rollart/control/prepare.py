"""Preparing a run: every check that needs no cluster, the run directory, the model
folder, the cluster to run on.

Consumes ``train``'s arguments (a graph or its name, resources, flags, ``--set``
overrides, a run to resume); produces a ``Prepared`` run (the checked ``Graph``, its run
directory with ``graph.json`` and checkpoint URL, the trackers) that
``rollart.control.loop.execute`` runs, with its model folder (``model_folder``: made
or resumed, then checked against the graph: ``check_model``). ``rollart.control.loop.train`` and
``rollart.app.api.start_run`` both prepare through ``prepare``, so a notebook's run is
checked exactly like the CLI's, before its thread starts.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rollart.config.graph import Graph, load_graph
from rollart.config.preflight import preflight
from rollart.corpus import chat_corpus
from rollart.env.tasks import task_corpus, warmup_tasks
from rollart.model import build_tiny_model, check_model_folder
from rollart.runtime.resources import Resources, load_resources

__all__ = ["Prepared", "SchedulerConnectError", "check_model", "connect", "model_folder",
           "new_run_dir", "open_client", "override", "prepare", "prepare_model"]


@dataclass
class Prepared:
    """What ``prepare`` checked and made, for ``execute``."""

    graph: Graph
    graph_source: str | None
    run_dir: Path
    resources: Resources | None  # None: run on the client's cluster
    ckpt: object | None  # the checkpoint a resumed run continues from
    checkpoint_url: str
    trackers: object  # rollart.observe.trackers.Trackers
    started: float = field(default_factory=time.time)


def new_run_dir(base: str | Path = "runs", name: str = "run") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(base) / f"{name}-{stamp}"
    i = 1
    while path.exists():
        path, i = Path(base) / f"{name}-{stamp}-{i}", i + 1
    return path


@contextmanager
def connect(resources: Resources | None, client=None, progress: bool = False):
    """Yield a client: the given one, a new cluster from pools, or a scheduler address.
    ``progress``: say so while the cluster starts (``rollart.observe.progress``)."""
    from distributed import Client

    from rollart.observe.progress import cluster_bar, phase

    if client is not None:
        yield client
        return
    if resources.address:
        with phase(f"connecting to {resources.address}", progress):
            c = open_client(resources.address, security=resources.security)
        with c:
            yield c
        return
    n = sum(p.workers for p in resources.pools)
    tags = ", ".join(f"{p.tag}×{p.workers}" for p in resources.pools)
    with phase(f"starting a local Dask cluster ({n} workers: {tags})", progress):
        with cluster_bar(n, progress):
            cluster = resources.make_cluster()
    with cluster, Client(cluster) as c:
        yield c


class SchedulerConnectError(ConnectionError):
    """No client could connect to the scheduler address given (``open_client``)."""


def open_client(address: str, **kwargs):
    """``distributed.Client(address, **kwargs)``; one that fails says which address.

    A ``Client`` whose start fails is left half-built in a reference cycle (the error's
    traceback holds it). Its ``__del__`` stops its IO loop under ``LoopRunner``'s class
    lock, so when the cycle collector happens to run in the *next* client's new IO loop
    thread, that client's start (holding the same lock) waits 10 s and fails with a
    bare ``AssertionError``. The failed one is therefore collected here, in this thread,
    before the error is raised.
    """
    import gc

    from distributed import Client

    try:
        return Client(address, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised below, naming the address
        why = f"{type(e).__name__}: {e}"
    gc.collect()
    hint = ("" if kwargs.get("security") is not None or not address.startswith("tls://")
            else " (a tls:// scheduler needs the resources' security=Security(...))")
    raise SchedulerConnectError(f"cannot connect to the Dask scheduler at {address}{hint}: {why}")


def prepare_model(graph: Graph, run_dir: Path, model: str | None) -> tuple[str, bool]:
    """The model folder to train and whether it needs the format warm-up. ``model`` (or
    ``Policy.model``) is a folder, a ``.gguf`` file or a known name such as
    ``smollm2-135m-instruct`` (``rollart.pretrained.resolve_model``); a folder is warmed
    up only where ``Policy.warmup_pretrained`` asks for it."""
    from rollart.pretrained import resolve_model

    p = graph.policy
    path = resolve_model(model or p.model)  # a known name or a .gguf: converted once
    if path:
        check_model_folder(path)
        return str(path), p.warmup_pretrained and p.warmup_total_steps > 0
    # a chat graph gets the chat toy (byte-level BPE + ChatML template, trained on the
    # tasks' own text); otherwise the word-level toy built from the tasks' vocabularies
    chat = graph.policy.conversation == "chat"
    tasks = warmup_tasks(graph.tasks)  # an agent task's text is its agent's
    corpus = chat_corpus(tasks) if chat else task_corpus(tasks)
    out = build_tiny_model(str(run_dir / "init_model"), corpus, chat=chat, seed=graph.seed)
    return out, graph.policy.warmup_total_steps > 0


def model_folder(prep: Prepared, model: str | None = None,
                 progress: bool = False) -> tuple[str, bool]:
    """The model folder a prepared run trains and whether it needs the format warm-up:
    a resumed run's checkpoint (a LoRA run's holds the adapter: its base), else
    ``prepare_model``'s; then what needs the folder (``check_model``)."""
    from rollart.observe.progress import phase

    graph = prep.graph
    if prep.ckpt is not None:
        from rollart.model import adapter_base

        model_path, warm = adapter_base(prep.ckpt.model_dir) or prep.ckpt.model_dir, False
    else:
        from rollart.pretrained import needs_conversion

        given = model or graph.policy.model
        what = (f"preparing {given} (fetched and converted once, then cached)" if given
                else "preparing the model")
        with phase(what, progress and (not given or needs_conversion(given))):
            model_path, warm = prepare_model(graph, prep.run_dir, model)
    check_model(graph, model_path)
    return model_path, warm


def check_model(graph: Graph, model_path: str) -> None:
    """The checks that need the model folder, before a cluster is made: what its chat
    template cannot do (fail or fold now: ``rollart.config.templates``) and, with
    ``Policy.lora``, its targets against the model's layers."""
    from rollart.config.templates import check_templates

    check_templates(graph, model_path)
    if graph.policy.lora is not None:
        from rollart.weights.lora import check_folder_targets

        check_folder_targets(model_path, graph.policy.lora.peft_options())


def prepare(graph: Graph | str | None = None, resources: Resources | str | None = None, *,
            client=None, steps: int | None = None, seed: int | None = None,
            alpha: int | None = None, mode: str | None = None,
            run_dir: str | Path | None = None, resume: str | Path | None = None,
            weights: str | None = None, checkpoint_url: str | None = None,
            checkpoint_every: int | None = None, overwrite: bool = False,
            overrides: list[str] | None = None,
            report_to: str | list[str] | None = None) -> Prepared:
    """Every check a run needs before a cluster or a model is made (``train``'s
    arguments; bad input fails here with what to change), then the run directory with
    its ``graph.json`` and checkpoint URL. Shared by ``train`` and ``rollart.start_run``."""
    from rollart.config.overrides import apply_overrides, check_flags
    from rollart.config.preflight import (RunDirError, check_checkpoints, check_run_dir,
                                          check_weight_store)
    from rollart.control import checkpoint
    from rollart.observe.trackers import make_trackers

    started, ckpt = time.time(), None
    if resume is not None:
        if overwrite:
            raise RunDirError(f"resume={resume} continues that run, overwrite=True would "
                              "delete it: pass one of them")
        run_dir = Path(resume)
        ckpt = checkpoint.for_resume(run_dir, checkpoint_url)
        graph, graph_src = checkpoint.graph_from(ckpt, graph), ckpt.graph.get("source")
    else:
        graph, graph_src = load_graph(graph)
    check_flags(overrides, steps=steps, seed=seed, alpha=alpha, mode=mode,
                checkpoint_every=checkpoint_every)
    graph = override(apply_overrides(graph, overrides), steps=steps, seed=seed,
                     alpha=alpha, mode=mode, checkpoint_every=checkpoint_every)
    if ckpt is not None:
        checkpoint.check_lora(ckpt, graph)
    trackers = make_trackers(report_to)  # a missing package fails here, before a cluster
    res = load_resources(resources) if client is None or resources is not None else None
    preflight(graph, res)  # bad input fails here, before a cluster or a model is made
    run_dir = Path(run_dir) if run_dir else new_run_dir(name=graph.name)
    if ckpt is None:  # another run's weights, samples and metrics would mix with ours
        check_run_dir(run_dir, overwrite)
        check_weight_store(weights, overwrite)
        check_checkpoints(checkpoint_url, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "graph.json").write_text(json.dumps(
        {"source": graph_src, **graph.to_dict()}, indent=2, default=str))
    checkpoint_url = checkpoint_url or checkpoint.default_url(run_dir)
    checkpoint.record_url(run_dir, checkpoint_url)
    return Prepared(graph, graph_src, run_dir, res, ckpt, checkpoint_url, trackers, started)


def override(graph: Graph, **changes) -> Graph:
    """A copy of ``graph`` with CLI overrides (``None`` = keep). An unset ``GRPO.alpha``
    follows the (new) mode; a set one that contradicts it is a ``GraphError``
    (``rollart.config.graph.resolve_alpha``)."""
    from dataclasses import replace

    changes = {k: v for k, v in changes.items() if v is not None}
    algo = graph.algo
    if "alpha" in changes:
        algo = replace(algo, alpha=changes.pop("alpha"))
    return replace(graph, algo=algo, **changes)  # Graph re-validates and resolves alpha
