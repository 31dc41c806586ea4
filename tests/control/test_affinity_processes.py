"""A real ``dask scheduler`` + ``dask worker --resources`` processes started by the test:
tags are checked, actors land on their tags, and PD moves the KV between two processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import Client

from rollart.policy.affinity import Affinity, AffinityError, check_cluster
from rollart.env.tasks import get_task
from rollart.config.graph import Graph
from rollart.runtime.resources import workers_with
from rollart.rollout import InferenceWorker, LLMProxy
from rollart.testing import ProxyHost, big_grid_task
from rollart.types import CPU_ENV, H20, H800, REWARD, GenRequest

ROOT = Path(__file__).resolve().parents[2]
WORKERS = {H800: f"{H800}=1", H20: f"{H20}=1", CPU_ENV: f"{CPU_ENV}=1 {REWARD}=1"}


@pytest.fixture(scope="module")
def dask_processes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dask")
    sched_file = tmp / "scheduler.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{Path(__file__).resolve().parent}",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    procs = [subprocess.Popen(dask + ["--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                      "--scheduler-file", str(sched_file)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)]
    try:
        deadline = time.time() + 60
        while not sched_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        for tag, resources in WORKERS.items():
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                 str(sched_file), "--resources", resources, "--nthreads", "1",
                 "--no-dashboard", "--host", "127.0.0.1", "--name", f"w-{tag}",
                 "--memory-limit", "0"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
        with Client(scheduler_file=str(sched_file), timeout=60) as c:
            c.wait_for_workers(len(WORKERS), timeout=120)
            yield c
    finally:  # SIGKILL each group (a Nanny and its worker): a graceful stop is not
        for p in reversed(procs):  # under test, and each worker's took seconds
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(timeout=30)


@pytest.mark.slow
def test_real_workers_tags_placement_and_pd(dask_processes, model_dir, tmp_path):
    c = dask_processes
    pd_task = get_task("guess").__class__(**{**get_task("guess").__dict__,
                                             "affinity": Affinity(prefill=H800, decode=H20)})
    g = Graph(name="procs", tasks=(pd_task,))
    check_cluster(c, g, "resources/scheduler.py")
    with pytest.raises(AffinityError, match="'CPU_BIG'.*--resources 'CPU_BIG=1'"):
        check_cluster(c, Graph(name="big", tasks=(big_grid_task(),)), "resources/scheduler.py")

    store = str(tmp_path / "w")
    starting = {t: c.submit(InferenceWorker, str(model_dir), store, pool=t, threads=1,
                            actor=True, resources={t: 1}) for t in (H800, H20)}
    actors = {t: f.result() for t, f in starting.items()}  # both load side by side
    try:
        for t, a in actors.items():
            assert a.stats().result()["address"] == workers_with(c, t)[0]
        proxy = LLMProxy([(a, t) for t, a in actors.items()],
                         routes={"pd": Affinity(prefill=H800, decode=H20),
                                 "colo": Affinity(pools=(H20,))})
        host = c.submit(ProxyHost, proxy, actor=True, resources={CPU_ENV: 1}).result()
        req = GenRequest([4, 5, 6, 7, 8, 9], max_new_tokens=8, temperature=0.0)
        pd = host.generate("a", req, "pd").result()
        colo = host.generate("b", req, "colo").result()
        assert pd.token_ids == colo.token_ids and pd.logprobs == colo.logprobs
        got = actors[H20].stats().result()
        assert got["kv_received"] == 1 and got["kv_bytes_received"] > 0
        pids = c.run(os.getpid)
        assert len(set(pids.values())) == len(WORKERS)  # three separate processes
    finally:
        for a in actors.values():
            a.close().result()


def _has_modules(names):
    return {n: n in sys.modules for n in names}


@pytest.mark.slow
def test_preload_imports_rollart_and_the_task_modules_on_every_worker(dask_processes,
                                                                      caplog, tmp_path):
    """The first reward task must not pay ``import rollart`` (seconds) inside step 1."""
    import dataclasses

    import preload_probe

    from rollart.control.lifecycle import preload, task_modules

    c = dask_processes
    task = dataclasses.replace(get_task("gridnav"), reward_fn=preload_probe.probe_reward)
    g = Graph(name="preload", tasks=(task,))
    assert {"rollart", "preload_probe", "rollart.env.builtin.gridnav"} <= set(task_modules(g))
    before = c.run(_has_modules, ["preload_probe"])
    assert not any(v["preload_probe"] for v in before.values())  # nothing imported it yet
    preload(c, g)
    after = c.run(_has_modules, ["rollart", "preload_probe"])
    assert len(after) == len(WORKERS)
    assert all(v == {"rollart": True, "preload_probe": True} for v in after.values())

    broken = dataclasses.replace(task, name="broken", reward_fn=_Unimportable())
    with caplog.at_level("WARNING", logger="rollart.control.loop"):
        preload(c, Graph(name="preload-broken", tasks=(broken,)))
    assert "no_such_module_for_preload" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rollart.control.loop"):  # a graph file's module
        preload(c, _file_graph(tmp_path))
    assert not caplog.text  # was: "rollart_config_file_graph: ModuleNotFoundError", twice


FILE_GRAPH = """
import dataclasses

from rollart import Graph
from rollart.env.tasks import get_task


def file_reward(episode):
    return 0.0


def graph():
    task = dataclasses.replace(get_task("gridnav"), reward_fn=file_reward)
    return Graph(name="file", tasks=(task,))
"""


def _file_graph(tmp_path):
    from rollart.config.graph import load_graph

    (tmp_path / "file_graph.py").write_text(FILE_GRAPH)
    return load_graph(str(tmp_path / "file_graph.py"))[0]


def test_task_modules_leave_out_a_graph_file_loaded_from_its_path(tmp_path):
    """No worker can import ``rollart_config_<name>``; its functions travel by value."""
    import cloudpickle

    from rollart.control.lifecycle import task_modules

    g = _file_graph(tmp_path)
    assert g.tasks[0].reward_fn.__module__ == "rollart_config_file_graph"
    assert task_modules(g) == ["rollart", "rollart.env.builtin.gridnav"]
    assert b"file_reward" in cloudpickle.dumps(g.tasks[0].reward_fn)  # by value


class _Unimportable:
    """A callable whose module cannot be imported anywhere."""

    __module__ = "no_such_module_for_preload"

    def __call__(self, episode):
        return 0.0
