"""A replacement actor is submitted by one reconcile and taken up by a later one: the
run's step does not wait on its constructor (rollart.control.stages.Stages._fill). On a
real in-process Dask cluster with tagged workers; the actor class blocks in its
constructor until the test lets it go."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from rollart import GRPO, Graph, Policy
from rollart.control.stages import Actors, Stages
from rollart.runtime.resources import cluster_tags, workers_with
from rollart.runtime.waits import StuckError, Waits
from rollart.testing import cluster_fixture
from rollart.types import H20, H800

GATES: dict[str, threading.Event] = {}  # in-process workers: the test's own objects


class Gated:
    """Stands in for an inference worker whose constructor takes as long as the test says
    (``GATES[gate]``: a model that loads slowly, or never)."""

    def __init__(self, *args, gate: str = "", **kwargs):
        GATES[gate].wait(60)

    def stats(self) -> dict:
        return {}


def _stages(client, tmp_path, gate: str, start: float = 60.0) -> Stages:
    graph = Graph(name="t-starts", tasks=("gridnav",), steps=1,
                  policy=Policy(warmup_steps=0), algo=GRPO(group_size=2, groups_per_step=1))
    stages = Stages(client, graph, "unused-model", tmp_path, waits=Waits(start=start))
    spec = next(s for s in stages.specs if s.role == "inference" and s.tag == H20)
    stages.specs = [replace(spec, cls=Gated, args=(), kwargs={"gate": gate})]
    GATES[gate] = threading.Event()
    return stages


@pytest.fixture(autouse=True)
def _release_gates():
    yield
    for gate in GATES.values():  # a failed test must not leave a constructor waiting
        gate.set()


def _until(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (out := check()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return out


client = cluster_fixture(H800, H20)


def test_a_slow_start_does_not_block_reconcile(client, tmp_path):
    stages, actors = _stages(client, tmp_path, "slow"), Actors()
    (addr,) = workers_with(client, H20)
    t0 = time.monotonic()
    first = stages.reconcile(actors, ("inference",))
    assert time.monotonic() - t0 < 5  # the constructor still waits on its gate
    assert first.made == [] and stages.starting() == [("inference", addr)]
    assert stages.reconcile(actors, ("inference",)).made == []  # still starting: no second
    assert len(stages.futures) == 1
    GATES["slow"].set()
    _until(lambda: stages.futures[0].done())
    assert stages.reconcile(actors, ("inference",)).made == [("inference", H20, addr)]
    assert stages.starting() == [] and [a for _, _, a in actors.workers] == [addr]
    assert stages.reconcile(actors, ("inference",)).made == []  # it is there now


def test_a_start_whose_worker_left_is_dropped(client, tmp_path):
    stages, actors = _stages(client, tmp_path, "left"), Actors()
    (addr,) = workers_with(client, H20)
    stages.reconcile(actors, ("inference",))
    assert stages.starting() == [("inference", addr)]
    live = {a: r for a, r in cluster_tags(client).items() if a != addr}  # as if it died
    assert stages.reconcile(actors, ("inference",), live=live).made == []
    assert stages.starting() == [] and stages.futures[0].cancelled()
    GATES["left"].set()


def test_a_start_past_its_bound_says_what_the_scheduler_knows(client, tmp_path):
    stages, actors = _stages(client, tmp_path, "never", start=0.5), Actors()
    (addr,) = workers_with(client, H20)
    stages.reconcile(actors, ("inference",))
    time.sleep(0.6)
    with pytest.raises(StuckError) as e:
        stages.reconcile(actors, ("inference",))
    msg = str(e.value)
    assert msg.startswith(f"the new Gated on {addr} ({H20}) did not start")
    assert f"is processing on {addr}) within 0.5 s" in msg  # its constructor runs there: look at it
    assert "DASK_ROLLART__WAITS__START" in msg
    assert stages.starting() == []
    GATES["never"].set()
