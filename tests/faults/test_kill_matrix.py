"""The kill matrix (issue 20, "Bad input"): SIGKILL of one worker process mid-run, in
each default layout, and the run completes with nothing lost and nothing trained twice.

Layouts: ``resources/local.py`` and ``resources/laptop.py`` started as worker processes
(each with its Nanny, which restarts the killed process), and a hand-started cluster: a
``dask scheduler`` and one ``dask worker --nanny --resources TAG=1`` per tag (H800, H20,
CPU_ENV, REWARD, TRAIN) as subprocesses, the run given its address. One cluster per
layout serves its cells one after another (each run waits until every tag is back).
A trainer gang (``resources/local.py`` with two TRAIN workers) loses rank 1, and (issue
52) rank 0 or rank 1 with its worker back only 15 s later, or never: the gang forms
again at its size, ``model/`` and the checkpoints hold the weights, the run resumes; a
worker that does not come back ends the run with a checkpoint and one error line.

The check does not trust the ledger: for every step in ``metrics.jsonl`` the Parquet rows
``trained`` at that step (``rollart.buffer.read_samples``) must be exactly the batch the
trainer reports it trained on (its ``trainer/batch_sha1`` and ``trainer/batch_size``),
and no trajectory id is ``trained`` twice.

Cells already covered elsewhere: the env worker killed on laptop (env + inference +
reward in one process) and local, the buffer's own worker and local's trainer+buffer
worker (tests/control/test_stages.py, in-process workers closed abruptly); the trainer killed
mid-step (tests/faults/test_durability.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from functools import partial

import pytest

from rollart import load_resources, train
from rollart.testing import check_run_record, tiny_graph
from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN

distributed = pytest.importorskip("distributed")
# deselected from the default suite (setup.cfg; 8 min 8 s on 2 shared cores, 12 cells): .ci/run runs it as
# a step of its own, `python -m pytest -m matrix tests/faults/test_kill_matrix.py`
pytestmark = [pytest.mark.slow, pytest.mark.matrix]

TAGS = (H800, H20, CPU_ENV, REWARD, TRAIN)
# (layout, tag of the worker killed, roles that must come back within the run); laptop's
# TRAIN worker also holds the buffer (BUFFER), and so does the hand-started cluster's
# (its fallback). A lost inference worker need not be back before the run ends: the
# other pool's worker serves meanwhile (on a loaded machine the short run often ends
# first); the trainer, the buffer and the only env manager must be.
CELLS = [
    ("hand", CPU_ENV, {"env"}),
    ("hand", H20, set()),
    ("hand", TRAIN, {"trainer", "buffer"}),
    ("hand", REWARD, set()),  # no actor there: its reward tasks are re-run by Dask
    ("laptop", TRAIN, {"trainer", "buffer"}),
    ("local", H800, set()),
    ("local", TRAIN, {"trainer", "buffer"}),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HandStarted:
    """``dask scheduler`` + one ``dask worker --nanny`` per tag, as subprocesses."""

    def __init__(self, log_dir):
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        self.logs, self.procs = [], []
        self._spawn(log_dir / "scheduler.log", "dask_scheduler", "--host", "127.0.0.1",
                    "--port", self.address.rsplit(":", 1)[1], "--no-dashboard")
        for tag in TAGS:
            self._spawn(log_dir / f"worker-{tag}.log", "dask_worker", self.address,
                        "--nworkers", "1", "--nthreads", "1", "--resources", f"{tag}=1",
                        "--nanny", "--host", "127.0.0.1", "--no-dashboard",
                        "--name", f"w-{tag}")

    def _spawn(self, log, module: str, *args: str) -> None:
        f = open(log, "w")
        self.logs.append(f)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", f"distributed.cli.{module}", *args], stdout=f,
            stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def kill(self, client, addr: str) -> None:
        """SIGKILL the worker process at ``addr`` (its Nanny starts a fresh one)."""
        pid = client.run(os.getpid, workers=[addr])[addr]
        os.kill(pid, signal.SIGKILL)

    def tails(self, lines: int = 40) -> str:
        """The last ``lines`` of the scheduler's and each worker's log (printed when a cell
        fails: pytest shows a failed test's stdout)."""
        out = []
        for f in self.logs:
            f.flush()
            text = open(f.name, errors="replace").read().splitlines()[-lines:]
            out.append(f"----- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    def close(self) -> None:
        """SIGKILL each process group (a Nanny and its worker; the scheduler): a graceful
        stop is not under test here, and one waits out each worker's Nanny (seconds)."""
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: start_new_session
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(30)
        for f in self.logs:
            f.close()


class Layouts:
    """One cluster at a time: ``get(layout)`` closes the previous layout's."""

    def __init__(self, tmp_path_factory):
        self.tmp = tmp_path_factory
        self.name = self.cluster = self.client = None

    def get(self, layout: str):
        from distributed import Client

        if layout != self.name:
            self.close()
            if layout == "hand":
                self.cluster = HandStarted(self.tmp.mktemp("hand"))
                self.client = Client(self.cluster.address, timeout=120)
            elif layout == "gang":  # resources/local.py with a two-rank trainer gang
                res = load_resources("local")
                res = replace(res, processes=True, dashboard_address=":0", pools=tuple(
                    replace(p, workers=2) if p.tag == TRAIN else p for p in res.pools))
                self.cluster = res.make_cluster()
                self.client = Client(self.cluster)
            else:
                res = replace(load_resources(layout), processes=True, dashboard_address=":0")
                self.cluster = res.make_cluster()
                self.client = Client(self.cluster)
            self.name = layout
        _wait_for_tags(self.client)
        return self.cluster, self.client

    def kill(self, addr: str) -> None:
        from rollart.control.supervisor import lose_worker

        if isinstance(self.cluster, HandStarted):
            self.cluster.kill(self.client, addr)
        else:
            lose_worker(self.cluster, self.client, addr)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.cluster.close()
        self.name = self.cluster = self.client = None


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = Layouts(tmp_path_factory)
    yield out
    out.close()


def _wait_for_tags(client, timeout: float = 300.0) -> None:
    """Every tag carried by a running worker (a killed one's Nanny restarts it)."""
    from rollart.runtime.resources import workers_with

    deadline = time.monotonic() + timeout
    while not all(workers_with(client, t) for t in TAGS):
        assert time.monotonic() < deadline, "a killed worker did not come back"
        time.sleep(0.2)


def _kill_after_step(layouts: Layouts, run_dir, step: int, tag: str, log: list) -> None:
    from rollart.runtime.resources import workers_with

    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not metrics.exists() or len(metrics.read_text().splitlines()) < step:
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    addr = workers_with(layouts.client, tag)[0]
    layouts.kill(addr)
    log.append(addr)


#: three steps of two groups of two on gridnav, alpha 1, a 5 s env step time-out
_graph = partial(tiny_graph, alpha=1, env_step_timeout=5.0)


@pytest.mark.parametrize("layout,tag,roles", CELLS, ids=[f"{a}-{b}" for a, b, _ in CELLS])
def test_sigkill_of_one_worker_process(layout, tag, roles, layouts, tiny_model, tmp_path):
    _, client = layouts.get(layout)
    run_dir = tmp_path / "run"
    killed: list = []
    t = threading.Thread(target=_kill_after_step, daemon=True,
                         args=(layouts, run_dir, 1, tag, killed))
    t.start()
    try:
        result = train(_graph(f"t-kill-{layout}-{tag}"), client=client, run_dir=run_dir,
                       progress=False, eval_seeds=0, model=tiny_model)
    except BaseException:  # a time-out too: what the cluster's processes said
        if isinstance(layouts.cluster, HandStarted):
            print(layouts.cluster.tails())
        raise
    t.join(5)
    assert killed, f"the {tag} worker was not killed"
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    assert roles <= {e["role"] for e in result.recovery}, result.recovery
    check_run_record(result)


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_sigkill_of_one_of_two_trainer_ranks(backend, layouts, tiny_model, tmp_path):
    """A TRAIN pool of two workers trains with a two-rank gang (FSDP2; Megatron with
    tensor parallelism 2); the worker of rank 1 is SIGKILLed after step 1: the gang fails
    as a whole, forms again (on the worker its Nanny restarts) from the newest published
    weights, and the step runs again. Every step is a two-rank step, nothing is lost or
    trained twice."""
    from rollart import TrainerParallel
    from rollart.control.supervisor import lose_worker

    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

    cluster, client = layouts.get("gang")
    run_dir = tmp_path / "run"
    killed: list = []

    def rank_1() -> str | None:
        def where(dask_scheduler):
            for key, ts in dask_scheduler.tasks.items():
                if "GangRank-" in str(key) and ts.who_has:  # or MegatronGangRank-
                    return next(iter(ts.who_has)).address
        return client.run_on_scheduler(where)

    def kill() -> None:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
        while not metrics.exists() or not metrics.read_text().strip() or rank_1() is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        addr = rank_1()
        lose_worker(cluster, client, addr)
        killed.append(addr)

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    graph = _graph(f"t-kill-gang-{backend}")
    graph = replace(graph, policy=replace(graph.policy, trainer_backend=backend,
                                          trainer_parallel=TrainerParallel(
                                              tp=2 if backend == "megatron" else 1)))
    result = train(graph, client=client, run_dir=run_dir, progress=False,
                   eval_seeds=0, model=tiny_model)
    t.join(5)
    assert killed, "rank 1's worker was not killed"
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    assert {r["trainer/ranks"] for r in result.metrics} == {2}
    assert result.metrics[-1]["trainer/gang_restarts"] >= 1, result.metrics
    check_run_record(result)



def _gang_rank(client, rank: int) -> str | None:
    """The worker holding rank ``rank`` of the run's trainer gang (rank 0: the
    ``GangTrainer`` actor, the others: ``GangRank`` actors), or None before it formed."""
    def where(dask_scheduler, rank=rank):
        for key, ts in dask_scheduler.tasks.items():
            name = str(key)
            if (name.startswith("GangTrainer-") if rank == 0 else
                    name.startswith(f"GangRank-{rank}-")) and ts.who_has:
                return next(iter(ts.who_has)).address
    return client.run_on_scheduler(where)


def _kill_late(cluster, client, addr: str, after: float | None) -> threading.Event:
    """SIGKILL the worker process at ``addr`` of a ``SpecCluster``; it comes back
    ``after`` s later (None: once the returned event is set), not at once: the run meets
    the loss with the worker still gone, as on a hand-started cluster whose worker takes
    its time (or has no Nanny). Its Nanny's restart is held back until then; a Nanny the
    cluster closed meanwhile (a ``SpecCluster`` closes that of a worker lost for longer
    than ``distributed.deploy.lost-worker-timeout``, 15 s, which ``_lost_workers_kept``
    raises but a run of the whole matrix still met) is started again from the
    cluster's spec instead (``rollart.control.supervisor._restart``)."""
    import asyncio

    from rollart.control.supervisor import _restart, lose_worker

    name, nanny = next((n, w) for n, w in cluster.workers.items()
                       if getattr(w, "worker_address", None) == addr)
    original, back = nanny.instantiate, threading.Event()

    async def late():
        del nanny.instantiate  # this once
        while not back.is_set():
            await asyncio.sleep(0.1)
        return await original()

    def bring_back() -> None:
        back.wait(after)
        back.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(w.get("name") == name for w in client.scheduler_info()["workers"].values()):
                return
            if cluster.workers.get(name) is not nanny or nanny.status.name.startswith("clos"):
                cluster.sync(_restart, cluster, name, nanny)
                return
            time.sleep(0.2)

    nanny.instantiate = late
    lose_worker(cluster, client, addr)
    threading.Thread(target=bring_back, daemon=True).start()
    return back


def _lost_workers_kept():
    """Dask's config under which a ``SpecCluster`` keeps a lost worker's Nanny (which
    ``_kill_late`` holds back) for 10 minutes."""
    import dask

    return dask.config.set({"distributed.deploy.lost-worker-timeout": "600s"})


def _check_model_folder(folder, weights) -> None:
    """``folder`` is a Hugging Face model folder (config and weights) holding the weight
    store's newest version."""
    import torch

    from rollart.model import load_model
    from rollart.weights import WeightStore

    assert (folder / "config.json").exists(), sorted(p.name for p in folder.iterdir())
    store = WeightStore(str(weights))
    newest = store.get(store.latest())
    saved = load_model(str(folder)).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in newest.items()), folder


def _kill_rank_after_step_1(layouts, run_dir, rank: int, after: float | None,
                            killed: list) -> threading.Thread:
    """A thread that kills rank ``rank``'s worker once step 1 is in ``metrics.jsonl``."""
    cluster, client = layouts.cluster, layouts.client

    def kill() -> None:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
        while not metrics.exists() or not metrics.read_text().strip() or \
                _gang_rank(client, 1) is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        addr = _gang_rank(client, rank)
        killed.append((addr, _kill_late(cluster, client, addr, after)))

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "rank1"])
def test_a_gang_that_loses_a_rank_keeps_the_trained_model(rank, layouts, tiny_model,
                                                          tmp_path, caplog):
    """Issue 52: the worker of rank ``rank`` of a two-rank FSDP2 gang is SIGKILLed after
    step 1, and its Nanny starts it again 15 s later. The gang fails as one, says on the
    driver's console what it waits for, and forms again at its declared size: every step
    is a two-rank step; the run's ``model/`` and its last checkpoint hold the trained
    weights (config and safetensors: the newest published version); ``placement.json``
    names both ranks' workers, ``recovery.json`` the loss; and the run resumes from its
    checkpoint. Losing rank 0 used to leave a one-process trainer (sized from the one
    TRAIN worker alive) beside the dead gang's process group as its rank 1, and its
    ``save_pretrained`` wrote no weights."""
    import json
    import logging

    caplog.set_level(logging.WARNING, logger="rollart")
    _, client = layouts.get("gang")
    run_dir = tmp_path / "run"
    killed: list = []
    t = _kill_rank_after_step_1(layouts, run_dir, rank, 15.0, killed)
    graph = replace(_graph(f"t-kill-gang-rank{rank}"), checkpoint_every=2)
    with _lost_workers_kept():
        result = train(graph, client=client, run_dir=run_dir, progress=False,
                       eval_seeds=0, model=tiny_model)
    t.join(5)
    assert killed, f"rank {rank}'s worker was not killed"
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    assert {r["trainer/ranks"] for r in result.metrics} == {2}, result.metrics
    if rank:  # rank 1's gang waits at once (rank 0's replacement may start as the worker is back)
        assert "the trainer gang of 2 ranks waits for 1 more worker(s) with the 'TRAIN' " \
               "resource (1 alive)" in caplog.text
    check_run_record(result)
    _check_model_folder(run_dir / "model", run_dir / "weights")
    _check_model_folder(run_dir / "checkpoints" / "step-00000003" / "model", run_dir / "weights")
    placement = json.loads((run_dir / "placement.json").read_text())
    assert len(set(placement["trainer"])) == 2, placement
    assert any(e["role"] == "trainer" and e["address"] == killed[0][0]
               for e in result.recovery), result.recovery
    assert json.loads((run_dir / "recovery.json").read_text()) == result.recovery

    _wait_for_tags(client)
    resumed = train(replace(graph, steps=4), client=client, run_dir=run_dir,
                    resume=run_dir, progress=False, eval_seeds=0)
    assert [r["step"] for r in resumed.metrics] == [1, 2, 3, 4]
    assert resumed.metrics[-1]["trainer/ranks"] == 2
    _check_model_folder(run_dir / "model", run_dir / "weights")


def test_a_gang_whose_lost_rank_does_not_come_back_stops_with_a_checkpoint(
        layouts, tiny_model, tmp_path):
    """Rank 1's worker is lost after step 1 and not started again (no Nanny): the gang
    waits ``rollart.waits.start`` for it, then the run stops with one error line (a
    ``GangWaitError``, which the CLI prints alone with exit status 2) saying how many
    TRAIN workers to start, after writing a checkpoint of step 1 and ``model/`` (the
    published weights). Once the worker is back, the run resumes from that checkpoint."""
    import dask

    from rollart.app.cli import user_errors
    from rollart.trainer.gang_faults import GangWaitError

    _, client = layouts.get("gang")
    run_dir = tmp_path / "run"
    killed: list = []
    t = _kill_rank_after_step_1(layouts, run_dir, 1, None, killed)
    graph = replace(_graph("t-kill-gang-gone"), checkpoint_every=5)
    try:
        with dask.config.set({"rollart.waits.start": 45}), _lost_workers_kept(), \
                pytest.raises(GangWaitError) as e:
            train(graph, client=client, run_dir=run_dir, progress=False, eval_seeds=0,
                  model=tiny_model)
    finally:
        t.join(5)
        for _, back in killed:
            back.set()
    assert killed, "rank 1's worker was not killed"
    message = str(e.value)
    assert isinstance(e.value, user_errors()) and "\n" not in message, message
    assert "start 1 more" in message and "The run stopped after step 1" in message, message
    assert "step-00000001" in message and f"rollart train --resume {run_dir}" in message
    _check_model_folder(run_dir / "checkpoints" / "step-00000001" / "model",
                        run_dir / "weights")
    _check_model_folder(run_dir / "model", run_dir / "weights")

    from rollart.runtime.resources import workers_with

    deadline = time.monotonic() + 120  # both TRAIN workers: the resumed gang's two ranks
    while len(workers_with(client, TRAIN)) < 2:
        assert time.monotonic() < deadline, "the lost TRAIN worker did not come back"
        time.sleep(0.2)
    resumed = train(replace(graph, steps=2), client=client, run_dir=run_dir,
                    resume=run_dir, progress=False, eval_seeds=0)
    assert [r["step"] for r in resumed.metrics] == [1, 2]
    assert resumed.metrics[-1]["trainer/ranks"] == 2
    check_run_record(resumed)
