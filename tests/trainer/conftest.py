"""Fixtures of the trainer tests."""

import pytest
import torch

from rollart.types import TRAIN


@pytest.fixture(scope="module")
def mg_model_dir(tmp_path_factory):
    """A tiny Qwen2 folder with two decoder blocks, grouped-query attention and
    non-trivial weights (a random init plus noise: every layout slip shows)."""
    from rollart.model import build_tiny_model, load_model

    path = build_tiny_model(tmp_path_factory.mktemp("mg") / "m",
                            ["gridnav : goal 3 right 1 up ; act ? left down , stop ."],
                            hidden_size=64, num_heads=4)
    model = load_model(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def train_pool():
    """(the gang tests) Two worker processes carrying TRAIN, as ``Pool("trainer", tag=TRAIN, workers=2)``."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      resources={TRAIN: 1}, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        yield client


GANG_RESOURCES = '''
from dataclasses import replace

from rollart.runtime.resources import load_resources


def resources():
    res = load_resources()  # resources/local.py, with a two-rank trainer
    pools = tuple(replace(p, workers=2) if p.tag == "TRAIN" else p for p in res.pools)
    return replace(res, pools=pools, dashboard_address=":0")
'''


@pytest.fixture
def train_on_two_ranks(tiny_model, tmp_path):
    """``rollart train gridnav --steps 2`` on resources/local.py with a two-worker TRAIN
    pool (extra ``--set`` overrides given); returns the run dir and its step rows."""
    import json

    from rollart.app.cli import main

    def run(*sets: str):
        res = tmp_path / "gang.py"
        res.write_text(GANG_RESOURCES)
        run_dir = tmp_path / "run"
        args = ["train", "gridnav", "--resources", str(res), "--steps", "2", "--model",
                tiny_model, "--eval-seeds", "0", "--no-progress", "--run-dir", str(run_dir)]
        for s in sets:
            args += ["--set", s]
        assert main(args) == 0
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        return run_dir, rows

    return run
