"""Shared fixtures: a tiny model folder and an in-process cluster with tagged workers."""

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
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

    from rollart.resources import load_resources

    res = load_resources()
    res = replace(res, processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        yield client
