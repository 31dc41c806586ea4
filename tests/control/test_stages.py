"""Each role declared once (rollart.control.stages): start places every spec, reconcile re-creates
what was lost from the same spec. On real in-process (and, for the SIGKILL run, process)
Dask clusters with tagged workers: task routes (PD) survive an inference-worker loss, a
replacement env manager lands on its env pool, a Megatron trainer comes back as Megatron,
the sample buffer stays off the env pool, and killing the env worker mid-run neither ends
the run nor loses a trained sample."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import pyarrow.compute as pc
import pytest
from distributed import Client

from rollart import Graph, load_resources, train
from rollart.policy.affinity import check_declared, env_tag, task_affinity, task_routes
from rollart.buffer import read_samples
from rollart.control.lifecycle import shutdown as _shutdown
from rollart.env.tasks import get_task
from rollart.control.supervisor import Supervisor, lose_worker
from rollart.config.preflight import check_cluster_tags, preflight
from rollart.runtime.resources import Pool, Resources, cluster_tags, workers_with
from rollart.control.stages import RoleSpec, Stages, buffer_worker
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN
from rollart.weights import WeightStore
from rollart.testing import BIG, big_grid_task, check_run_record, tiny_graph

@task_affinity(prefill=H800, decode=H20)
def pd_guess():
    return replace(get_task("guess"), name="pd_guess", max_turns=2)


def big_grid():
    return big_grid_task(max_turns=2)


def small_graph(*tasks, **policy) -> Graph:
    return tiny_graph("t-stages", tasks, steps=1, groups=1, policy=policy)


def one_per_tag(*extra: Pool, **buffer_on) -> Resources:
    """A hand-started-like cluster: one worker per tag H800/H20/CPU_ENV/REWARD/TRAIN."""
    def pool(name, tag, kind):
        return Pool(name, tag=tag, kind=kind, extra_tags=buffer_on.get(name, {}))

    return Resources(pools=(pool("h800", H800, "compute_gpu"), pool("h20", H20, "bandwidth_gpu"),
                            pool("env", CPU_ENV, "cpu_env"), pool("reward", REWARD, "reward"),
                            pool("trainer", TRAIN, "trainer"), *extra),
                     processes=False, dashboard_address=":0", source="tests/control/test_stages.py")


def _where(client, addr: str) -> dict:
    return cluster_tags(client)[addr]


def _heal_until(sup: Supervisor, roles: set, timeout: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while {e["role"] for e in sup.events} < roles:
        assert time.monotonic() < deadline, (sup.events, sup.pending)
        sup.heal(force=True)
        time.sleep(0.1)
    return sup.events


def _publish(actors) -> int:
    v = actors.trainer.publish().result()
    for w, _, _ in actors.workers:
        w.update_weights(v).result()
        w.wait_version(v).result()
    return v


# -- buffer placement -------------------------------------------------------------------
def test_buffer_worker_prefers_its_tag_then_non_env_roles(caplog):
    spec = RoleSpec("buffer", dict, (), {}, BUFFER, fallback=(TRAIN, REWARD, H800, H20),
                    last_resort=(CPU_ENV, BIG))
    live = {"e": {CPU_ENV: 1}, "t": {TRAIN: 1}, "r": {REWARD: 1}, "i": {H800: 1, H20: 1},
            "b": {BIG: 1}}
    with caplog.at_level(logging.WARNING, logger="rollart.control.stages"):
        assert buffer_worker({**live, "x": {BUFFER: 1}}, spec) == ("x", BUFFER)
        assert buffer_worker(live, spec) == ("t", TRAIN)
        two = {**live, "u": {TRAIN: 1}}
        assert buffer_worker(two, spec, avoid="t") == ("u", TRAIN)  # not the lost one's
        assert buffer_worker(live, spec, avoid="t") == ("t", TRAIN)  # unless it is alone
        assert buffer_worker({k: live[k] for k in "eib"}, spec) == ("i", H800)
        rollout = {"e": {CPU_ENV: 1, REWARD: 1, H800: 1}, "i": {H20: 1}}  # laptop-like
        assert buffer_worker(rollout, spec) == ("i", H20)  # not the worker with the envs
        assert not caplog.records
        assert buffer_worker({"e": live["e"], "b": live["b"]}, spec) == ("e", CPU_ENV)
    assert "failure-prone" in caplog.text and "'BUFFER'" in caplog.text
    assert buffer_worker({}, spec) is None


@pytest.mark.parametrize("layout", ["local", "laptop", "one-per-tag"])
def test_buffer_is_not_on_an_env_worker(layout, tiny_model, tmp_path):
    res = one_per_tag() if layout == "one-per-tag" else replace(
        load_resources(layout), processes=False, dashboard_address=":0")
    graph = small_graph()
    check_declared(graph, res)  # train()'s checks accept a cluster without BUFFER
    preflight(graph, res)
    with res.make_cluster() as cluster, Client(cluster) as c:
        check_cluster_tags(c, graph, res.source)
        actors = Stages(c, graph, tiny_model, tmp_path).start()
        try:
            addr = actors.buffer._address
            assert actors.placement["buffer"] == [addr]
            tags = _where(c, addr)
            assert CPU_ENV not in tags, (layout, tags)
            assert tags.get(BUFFER if layout != "one-per-tag" else TRAIN), (layout, tags)
            assert actors.buffer.counts().result()["launched"] == 0  # it answers
            for m in actors.managers:  # in-process, the driver's own handle (no Handle:
                # one bound to an in-process worker kept the cluster from closing); in a
                # worker process a Handle (rollart.runtime.handles): tests/faults/test_kill_matrix.py
                kind, key = c.run(_buffer_kind, m.key, workers=[m._address])[m._address]
                assert key == actors.buffer.key and kind in ("Actor", "Handle"), (kind, key)
        finally:
            _shutdown(actors)


def _buffer_kind(key: str, dask_worker=None) -> str:
    buf = dask_worker.state.actors[key].buffer
    buf = getattr(buf, "actor", buf)
    return type(buf).__name__, buf.key


# -- reconcile: routes and env pools ----------------------------------------------------
def _proxy_routes(key: str, dask_worker=None) -> dict:
    return dict(dask_worker.state.actors[key].runner.proxy.routes)


def test_replacements_keep_routes_and_env_pools(tiny_model, tmp_path):
    """Lose the decode (H20) worker and the CPU_BIG env worker: the replacement manager
    is on CPU_BIG, ``managers_for`` stays aligned, and every manager's proxy (the new
    one's and the survivors') still routes pd_guess prefill→H800, decode→H20."""
    res = one_per_tag(Pool("big", tag=BIG, kind="cpu_env"), trainer={BUFFER: 1})
    graph = small_graph(pd_guess(), big_grid())
    with res.make_cluster() as cluster, Client(cluster) as c:
        stages = Stages(c, graph, tiny_model, tmp_path)
        actors = stages.start()
        sup = Supervisor(stages, actors)
        try:
            _publish(actors)
            for tag in (H20, BIG):
                lose_worker(cluster, c, workers_with(c, tag)[0])
            events = _heal_until(sup, {"inference", "env"})
            assert {(e["role"]) for e in events} == {"inference", "env"}
            live = cluster_tags(c)
            assert len(actors.managers) == len(actors.manager_tags) == 2
            for m, tag in zip(actors.managers, actors.manager_tags):
                assert live[m._address].get(tag), (m.key, tag, live[m._address])
            big = actors.managers_for(big_grid())
            assert len(big) == 1 and live[big[0]._address].get(BIG)
            assert env_tag(big_grid()) == BIG and big[0]._address == workers_with(c, BIG)[0]
            assert actors.managers_for(pd_guess())[0]._address == workers_with(c, CPU_ENV)[0]
            want = task_routes(graph.tasks)
            for m in actors.managers:
                got = c.run(_proxy_routes, m.key, workers=[m._address])[m._address]
                assert got == want, m.key
            # and the routes are used: pd_guess on both managers prefills on H800 and
            # decodes on the new H20 worker, the KV moving between them
            outs = [m.run_group(pd_guess(), seed=i, group_id=f"pd{i}", group_size=2)
                    for i, m in enumerate(actors.managers)]
            assert all(o.result(timeout=180)["outcomes"] for o in outs)
            stats = {tag: w.stats().result() for w, tag, _ in actors.workers}
            assert stats[H20]["kv_received"] > 0
            assert stats[H800]["kv_sent"] == stats[H20]["kv_received"]
        finally:
            _shutdown(actors)


# -- reconcile: the trainer -------------------------------------------------------------
@pytest.mark.megatron
@pytest.mark.slow
def test_a_lost_megatron_trainer_comes_back_as_megatron(tiny_model, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")
    from rollart.trainer.megatron import MegatronTrainer

    res = one_per_tag(reward={BUFFER: 1})  # the trainer's worker holds only the trainer
    graph = small_graph(trainer_backend="megatron")
    with res.make_cluster() as cluster, Client(cluster) as c:
        stages = Stages(c, graph, tiny_model, tmp_path)
        actors = stages.start()
        sup = Supervisor(stages, actors)
        try:
            assert actors.trainer._cls is MegatronTrainer
            v = _publish(actors)
            store = WeightStore(stages.store_url)  # a newer version, as a step would publish
            store.put(v + 1, {k: t + 0.01 for k, t in store.get(v).items()})
            old = actors.trainer._address
            lose_worker(cluster, c, old)
            assert sup.replace_trainer() == v + 1
            new = actors.trainer
            assert new._address != old and _where(c, new._address).get(TRAIN)
            assert new._cls is MegatronTrainer
            kind = c.run(_model_kind, new.key, stages.store_url, v + 1,
                         workers=[new._address])[new._address]
            assert kind == ("MegatronTrainer", "MegatronLM", True)
            event = sup.events[-1]
            assert event["role"] == "trainer" and event["restored_from"] == f"weights v{v + 1}"
        finally:
            _shutdown(actors)


def _model_kind(key: str, url: str, version: int, dask_worker=None) -> tuple:
    """The trainer actor's class, its model's class, and whether its (HF-named) weights
    are ``version``'s in the store."""
    import torch

    actor = dask_worker.state.actors[key]
    want, have = WeightStore(url).get(version), actor._hf_state_dict()
    same = set(want) == set(have) and all(torch.equal(want[k], have[k]) for k in want)
    return type(actor).__name__, type(actor.model).__name__, same


# -- killing a worker mid-run -----------------------------------------------------------
def _kill_after(cluster, client, run_dir, step: int, tag: str, log: list) -> None:
    metrics = run_dir / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < step:
        time.sleep(0.05)
    addr = workers_with(client, tag)[0]
    log.append(lose_worker(cluster, client, addr, restart_after=0.5))


def _run_and_kill(res: Resources, tag: str, name: str, tiny_model, run_dir):
    graph = tiny_graph(name, steps=4, alpha=1, env_step_timeout=5.0)
    killed: list = []
    with res.make_cluster() as cluster, Client(cluster) as c:
        t = threading.Thread(target=_kill_after, daemon=True,
                             args=(cluster, c, run_dir, 1, tag, killed))
        t.start()
        result = train(graph, client=c, run_dir=run_dir, progress=False, eval_seeds=0,
                       model=tiny_model)
        t.join(5)
    assert killed, f"the {tag} worker was not killed"
    assert [r["step"] for r in result.metrics] == [1, 2, 3, 4]
    final = result.final_counts
    assert final["in_flight"] == 0
    check_run_record(result)  # the ledger against the trainer's reports and the rows
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))["traj_id"].to_pylist()
    assert len(trained) == len(set(trained)) == final["trained"] > 0
    return result


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["laptop", "local"])
def test_killing_the_env_worker_does_not_end_the_run(layout, tiny_model, tmp_path):
    """laptop: worker processes, the rollout worker (envs, inference, rewards) gets
    SIGKILL and its Nanny restarts it; local: in-process, the env worker dies abruptly
    and a fresh one starts. The run completes and every trajectory the ledger counts as
    trained is in samples/*.parquet."""
    res = replace(load_resources(layout), dashboard_address=":0",
                  processes=layout == "laptop")
    result = _run_and_kill(res, CPU_ENV, f"t-kill-{layout}", tiny_model, tmp_path / "run")
    roles = [e["role"] for e in result.recovery]
    assert "env" in roles, result.recovery
    if layout == "laptop":  # the rollout worker held both inference tags: both came back
        assert roles.count("inference") >= 2, result.recovery


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["own-pool", "local"])
def test_losing_the_buffers_worker_does_not_end_the_run(layout, tiny_model, tmp_path):
    """The buffer is re-created from its spec with ``recover=True`` (its durable groups
    and ledger reloaded from the run directory) and handed to the managers and the
    pipeline. own-pool: the BUFFER worker alone dies; local: BUFFER rides on the
    trainer's worker, so the trainer is lost with it and restored too."""
    if layout == "own-pool":
        res = one_per_tag(Pool("buffer", tag=BUFFER, kind="cpu"))
    else:
        res = replace(load_resources("local"), processes=False, dashboard_address=":0")
    result = _run_and_kill(res, BUFFER, f"t-buffer-{layout}", tiny_model, tmp_path / "run")
    roles = {e["role"] for e in result.recovery}
    assert "buffer" in roles and (layout == "own-pool" or "trainer" in roles), roles


# -- no silent waits: a hung actor is named within its bound ------------------------------
_RELEASE = threading.Event()  # module-level: in-process workers share this interpreter


def _hold_the_worker() -> bool:
    """Occupy a worker's only thread (and its tag's one slot) until the test releases it."""
    return _RELEASE.wait(300)


def test_a_hung_actor_start_is_named_within_its_bound(tiny_model, tmp_path):
    """The H20 worker's only slot is held by a task that never ends, so the
    InferenceWorker placed there never starts: ``Stages.start`` says which actor, on
    which worker and pool, within ``rollart.waits.start`` (set through Dask's config; 10 s:
    time for the trainer and the other engines to start on a loaded machine, and no more
    of a wait than that)."""
    import dask

    from rollart.runtime.waits import StuckError

    _RELEASE.clear()
    graph = small_graph()
    with one_per_tag().make_cluster() as cluster, Client(cluster) as c:
        h20 = workers_with(c, H20)[0]
        blocker = c.submit(_hold_the_worker, resources={H20: 1}, workers=[h20], pure=False)
        while not c.processing(workers=[h20])[h20]:  # it holds the slot now
            time.sleep(0.05)
        try:
            with dask.config.set({"rollart.waits.start": 10}):
                stages = Stages(c, graph, tiny_model, tmp_path)
            assert stages.waits.start == 10
            t0 = time.monotonic()
            with pytest.raises(StuckError) as e:
                stages.start()
            took = time.monotonic() - t0
        finally:
            _RELEASE.set()
            blocker.result(timeout=30)
    assert f"the InferenceWorker on {h20} (H20) did not start within" in str(e.value)
    assert "rollart.waits.start" in str(e.value) and "worker's log" in str(e.value)
    assert 9.5 < took < 50, took  # bounded: the start's 10 s, not forever


def test_a_hung_warmup_ends_within_its_bound_through_the_progress_bar():
    """The warm-up's bound grows with its steps (``Waits.warmup``), and the progress bar
    that polls the warm-up's future stops at it with the warm-up named."""
    from rollart.observe.progress import warmup_bar
    from rollart.runtime.waits import Bounded, StuckError, Waits

    assert Waits(call=10, warmup_step=2).warmup(50) == 110
    assert Waits(call=10, warmup_step=2).warmup(100) == 210
    with pytest.raises(ValueError, match="rollart.waits.start"):
        Waits(start=0)
    _RELEASE.clear()
    with Client(processes=False, n_workers=1, threads_per_worker=1,
                dashboard_address=":0") as c:
        fut = c.submit(_hold_the_worker, pure=False)
        t0 = time.monotonic()
        try:
            with pytest.raises(StuckError, match=r"the trainer's warm-up \(3 steps\) on W "
                                                 r"did not finish within 1.5 s"):
                warmup_bar(None, Bounded(fut, 1.5, "the trainer's warm-up (3 steps) on W "
                                         "did not finish", "warmup-step"), 3, enabled=False,
                           interval=0.05)
            assert time.monotonic() - t0 < 10
        finally:
            _RELEASE.set()
            fut.result(timeout=30)


# -- a call made on a worker to an actor whose worker dies fails at once -------------------
class _Slow:
    async def wait(self, seconds: float) -> str:
        import asyncio

        await asyncio.sleep(seconds)
        return "done"


class _Caller:
    """Calls a ``_Slow`` actor from its own worker (as an env manager calls inference)."""

    def __init__(self):
        self.target = None

    def set_target(self, target) -> str:
        self.target = target
        return type(target).__name__

    async def call(self) -> str:
        try:
            return await self.target.wait(300)
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            return f"{type(e).__name__}: {e}"


def test_a_call_to_an_actor_on_a_lost_worker_fails_at_once():
    """A plain Dask handle unpickled on a worker waits forever when the actor's worker
    dies mid-call (it awaits the re-creation of an actor pinned to a dead worker);
    ``rollart.runtime.handles.Handle`` (what ``Stages`` gives every actor) raises ``OSError`` at
    once, so the proxy can re-route and a member can fail instead of holding a slot."""
    from distributed import LocalCluster

    from rollart.runtime.handles import Handle, handle

    # worker processes: in-process workers share the test's client, whose future of
    # the actor does hear of the loss
    with LocalCluster(n_workers=3, processes=True, threads_per_worker=1,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        a, b, _ = sorted(cluster.scheduler_info["workers"])
        slow = c.submit(_Slow, actor=True, workers=[a], allow_other_workers=False).result()
        callers = [c.submit(_Caller, actor=True, workers=[b], pure=False).result()
                   for _ in range(2)]
        assert callers[0].set_target(slow).result() == "Actor"
        assert callers[1].set_target(handle(slow)).result() == "Handle"
        calls = [x.call() for x in callers]
        time.sleep(1.0)  # both calls are in flight on a's actor
        lose_worker(cluster, c, a, restart_after=None)
        t0 = time.monotonic()
        got = calls[1].result(timeout=60)
        took = time.monotonic() - t0
        plain_done = calls[0].done()
    assert got == "OSError: Unable to contact Actor's worker" and took < 30, (got, took)
    assert not plain_done  # the plain handle still waits (Dask's own behaviour)
    assert isinstance(handle(slow), Handle)
