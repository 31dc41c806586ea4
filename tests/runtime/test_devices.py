"""GPUs per worker (rollart.runtime.devices): a layout whose pools declare ``gpus`` starts
worker processes that each see only their own GPUs (``CUDA_VISIBLE_DEVICES``), CPU pools
none; too many GPUs, or GPUs in one process, are refused; on this host without GPUs the
same layout runs on the CPU, and says so."""

import logging

import pytest

from rollart.runtime.devices import GPUAssignmentError, assign_gpus, worker_device
from rollart.runtime.resources import Pool, Resources, ResourcesError
from rollart.types import CPU_ENV, TRAIN


def _layout(processes=True) -> Resources:
    return Resources(pools=(
        Pool("trainer", tag=TRAIN, kind="trainer", workers=2, gpus=1),
        Pool("env", tag=CPU_ENV, kind="cpu_env", workers=1),
    ), processes=processes, dashboard_address=None)


def test_more_gpus_than_the_host_has_is_refused_with_the_counts():
    pools = _layout().pools
    assert assign_gpus(pools, 2) == {"trainer-0": [0], "trainer-1": [1], "env-0": []}
    with pytest.raises(GPUAssignmentError, match="ask for 2 GPUs.*this host has 1"):
        assign_gpus(pools, 1)


def test_gpus_in_one_process_are_refused():
    with pytest.raises(ResourcesError, match="processes=True"):
        _layout(processes=False).worker_specs()


def test_bad_gpu_counts_are_refused():
    for bad in (-1, 1.5, True):
        with pytest.raises(ResourcesError, match="gpus must be a whole number"):
            Pool("t", tag=TRAIN, kind="trainer", gpus=bad)


def test_the_device_an_actor_computes_on():
    import torch

    assert worker_device({}) == torch.device("cpu")
    assert worker_device({"ROLLART_DEVICE": "cpu", "ROLLART_GPUS": "3"}).type == "cpu"
    gpu = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert worker_device({"ROLLART_GPUS": "3"}) == gpu
    assert worker_device({"CUDA_VISIBLE_DEVICES": "3"}) == gpu  # e.g. SLURM's gres
    assert worker_device({"CUDA_VISIBLE_DEVICES": "3", "ROLLART_GPUS": ""}).type == "cpu"


def _seen() -> tuple:
    import os

    from rollart.runtime.devices import worker_device

    return (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("ROLLART_GPUS"),
            str(worker_device()))


def test_each_worker_process_sees_only_its_own_gpus(caplog, monkeypatch):
    """A real process cluster from the layout: trainer-0 owns GPU 0, trainer-1 GPU 1, the
    env worker none; here (no GPU) every actor computes on the CPU, and a warning says so.
    A parent's own CUDA_VISIBLE_DEVICES is the list the ids count in."""
    import torch
    from distributed import Client

    if torch.cuda.is_available():
        pytest.skip("a host with GPUs: the CPU fallback is not what runs")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with caplog.at_level(logging.WARNING, logger="rollart.runtime.devices"), \
            _layout().make_cluster() as cluster, Client(cluster) as client:
        names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
        seen = {names[a]: v for a, v in client.run(_seen).items()}
    assert seen == {"trainer-0": ("5", "5", "cpu"), "trainer-1": ("7", "7", "cpu"),
                    "env-0": ("", "", "cpu")}
    assert "declare 2 GPUs but this host has none visible" in caplog.text
