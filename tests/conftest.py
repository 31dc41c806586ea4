"""Shared fixtures: a tiny model folder and an in-process cluster with tagged workers."""

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
# the benchmark scripts' smoke runs append nothing to benchmarks/results (_results.Run)
os.environ["ROLLART_NO_RECORD"] = "1"
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The built-in tiny model (random init, no warm-up) for the built-in tasks."""
    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    return build_tiny_model(str(path), task_corpus(list(BUILTIN_TASKS)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A smaller tiny model over a fixed corpus, for engine and worker tests."""
    from rollart.model import build_tiny_model

    corpus = ["gridnav : goal 3 right 1 up ; act ? left down , stop ."]
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", corpus, hidden_size=64)


@pytest.fixture(scope="module")
def local_cluster():
    """``resources/local.py`` started in-process (threads, not processes) with a client."""
    from distributed import Client

    from rollart.runtime.resources import load_resources

    res = load_resources()
    res = replace(res, processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="session")
def rollout_actors():
    """``start_rollout`` (below), for fixtures that build rollout actors."""
    return start_rollout


def start_rollout(client, model, store_dir, name, *, pools=("H800",), buffer_dir=None,
                  **manager_kwargs):
    """Rollout actors on ``client``'s tagged cluster: one ``InferenceWorker`` per pool tag
    serving ``model``'s weights (published to a store under ``store_dir``), a
    ``SampleBuffer`` (durable under ``buffer_dir`` when given) and an ``EnvManager``
    routed to the workers (``manager_kwargs``: its options, e.g. ``env_step_timeout``;
    ``resources`` defaults to the env pool), each actor under a Dask key of its own
    (``unique_key``: ``name`` may repeat). Returns ``(manager, buffer, workers)``."""
    from rollart.buffer import SampleBuffer
    from rollart.env.manager import EnvManager
    from rollart.model import load_model
    from rollart.rollout import InferenceWorker, LLMProxy
    from rollart.testing import unique_key
    from rollart.types import CPU_ENV
    from rollart.weights import WeightStore

    store = str(store_dir)
    WeightStore(store).put(0, load_model(model).state_dict())
    workers = [(client.submit(InferenceWorker, model, store, pool=tag, actor=True,
                              resources={tag: 1}, key=unique_key(f"iw-{name}-{tag}")).result(), tag)
               for tag in pools]
    buf = client.submit(SampleBuffer, buffer_dir and str(buffer_dir), actor=True,
                        resources={CPU_ENV: 1}, key=unique_key(f"buf-{name}")).result()
    manager_kwargs.setdefault("resources", {CPU_ENV: 1})
    mgr = client.submit(EnvManager, LLMProxy(workers), buf, model, actor=True,
                        key=unique_key(f"mgr-{name}"), **manager_kwargs).result()
    return mgr, buf, workers
