"""Affinity declarations, the errors for misdeclared ones, and placement of every declared
stage on its tag on a real in-process cluster with several tagged workers."""

from dataclasses import replace

import sys
from pathlib import Path

import pytest

import rollart
from rollart.policy.affinity import (Affinity, AffinityError, affinity_of, check_cluster,
                              check_declared, env_affinity, env_tag, inference_tags,
                              reward_affinity, reward_tag, task_affinity, task_routes)
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.tasks import get_task
from rollart.runtime.resources import Pool, Resources, load_resources
from rollart.reward import success_reward
from rollart.testing import BIG, BigGridEnv, big_grid_task, tagged_cluster, tiny_graph
from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN

JUDGE = "GPU_RM"


@reward_affinity(JUDGE)
def judged(episode):
    """A reward that insists on running on the GPU_RM pool."""
    from distributed import get_worker

    if JUDGE not in get_worker().state.total_resources:
        raise RuntimeError(f"reward ran on {get_worker().name}")
    return success_reward(episode)


@task_affinity(prefill=H800, decode=H20)
def pd_guess():
    return replace(get_task("guess"), name="pd_guess")


def big_grid():
    return big_grid_task(reward_fn=judged, max_turns=3)


def graph(*tasks):
    return tiny_graph("aff", tasks, steps=1, groups=1)


def test_decorators_declare_where_things_run():
    t = pd_guess()
    assert t.affinity == Affinity(prefill=H800, decode=H20) and t.affinity.disaggregated
    assert affinity_of(BigGridEnv).pools == (BIG,) and env_tag(big_grid()) == BIG
    assert reward_tag(big_grid()) == JUDGE and reward_tag(get_task("guess")) == REWARD
    assert env_tag(get_task("guess")) == CPU_ENV and affinity_of(GridNavEnv) is None
    pinned = rollart.task_affinity(H20)(get_task("gridnav"))
    assert pinned.affinity.pools == (H20,) and get_task("gridnav").affinity is None
    g = graph(pd_guess(), big_grid(), pinned)
    assert set(task_routes(g.tasks)) == {"pd_guess", "gridnav"}
    assert inference_tags(g) == (H800, H20)
    assert {BIG, JUDGE, H800, H20, CPU_ENV, REWARD, TRAIN} <= set(g.needs())


@pytest.mark.parametrize("kw, match", [
    ({"prefill": H800}, "give both prefill= and decode="),
    ({"pools": (H20,), "prefill": H800, "decode": H20}, "exactly one of"),
    ({}, "exactly one of"),
    ({"pools": ("",)}, "non-empty strings"),
])
def test_affinity_validation(kw, match):
    with pytest.raises(AffinityError, match=match):
        Affinity(**kw)
    with pytest.raises(AffinityError, match="at least one pool"):
        env_affinity()
    with pytest.raises(TypeError, match="returned int"):
        task_affinity(H20)(lambda: 3)()


def local_with(*pools):
    return Resources(pools=(Pool("h800", tag=H800, kind="compute_gpu"),
                            Pool("h20", tag=H20, kind="bandwidth_gpu"),
                            Pool("env", tag=CPU_ENV, kind="cpu_env"),
                            Pool("reward", tag=REWARD, kind="reward"),
                            Pool("trainer", tag=TRAIN, kind="trainer"), *pools),
                     source="resources/mine.py")


def test_unknown_pool_is_an_error_before_anything_starts():
    with pytest.raises(AffinityError) as e:
        check_declared(graph(big_grid()), local_with())
    msg = str(e.value)
    assert "task 'big_grid' (env)" in msg and "'CPU_BIG'" in msg and "resources/mine.py" in msg
    # the public entry point refuses before building a model or starting a cluster
    with pytest.raises(AffinityError, match="'GPU_RM'"):
        rollart.train(graph(big_grid()), local_with(Pool("big", tag=BIG, kind="cpu_env")),
                      run_dir="/nonexistent/never-created")


def test_pool_without_workers_is_an_error():
    res = local_with(Pool("big", tag=BIG, kind="cpu_env"),
                     Pool("judge", tag=JUDGE, kind="reward", workers=0))
    with pytest.raises(AffinityError, match="pool 'judge'.*no workers.*workers >= 1"):
        check_declared(graph(big_grid()), res)
    check_declared(graph(pd_guess()), load_resources())  # the default pools suffice


def test_shipped_resources_files_declare_the_roles():
    gpu = load_resources("gpu_cluster")
    kinds = {p.kind for p in gpu.pools}
    assert {"compute_gpu", "bandwidth_gpu", "cpu_env", "reward", "trainer"} <= kinds
    assert gpu.tags()[H20] > gpu.tags()[H800] >= 1
    check_declared(graph(pd_guess()), gpu)


def test_jobqueue_file_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)  # as if not installed
    with pytest.raises(rollart.ResourcesError, match="pip install dask-jobqueue"):
        load_resources("jobqueue")


def test_jobqueue_file_writes_one_tagged_slurm_job_per_worker():
    """Without SLURM: the job scripts the file would submit, one per pool worker, each on
    its partition with its GPUs and its resource tag."""
    pytest.importorskip("dask_jobqueue", reason="needs the jobqueue extra")
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "resources" / "jobqueue.py"
    spec = importlib.util.spec_from_file_location("rollart_jobqueue_file", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cluster = mod.slurm_cluster(submit=False, host="127.0.0.1", dashboard_address=":0")
    try:
        scripts = mod.job_scripts(cluster)
    finally:
        cluster.close()
    assert len(scripts) == sum(jobs for _, jobs, _ in mod.POOLS.values())
    for name, script in scripts.items():
        tag = name.rsplit("-", 1)[0]
        queue, _, extra = mod.POOLS[tag]
        assert f"#SBATCH -p {queue}" in script
        assert all(f"#SBATCH {line}" in script for line in extra)
        assert f"--resources {tag}=1" in script
        assert cluster.scheduler_address in script


# -- placement on a real cluster --------------------------------------------------------
TAGS = (H800, H20, CPU_ENV, BIG, REWARD, JUDGE, TRAIN)


@pytest.fixture(scope="module")
def tagged():
    with tagged_cluster(*TAGS) as c:
        yield c


def test_missing_tag_on_a_running_cluster(tagged):
    check_cluster(tagged, graph(pd_guess(), big_grid()), "the cluster")
    other = replace(big_grid(), env_factory=env_affinity("CPU_HUGE")(type(
        "HugeEnv", (GridNavEnv,), {"__module__": __name__})))
    with pytest.raises(AffinityError, match="no worker carries resource tag 'CPU_HUGE'"):
        check_cluster(tagged, graph(other), "the cluster")


def test_each_declared_stage_runs_on_its_tag(tagged, tiny_model, tmp_path):
    from rollart.control.lifecycle import shutdown as _shutdown, start_actors
    from rollart.runtime.resources import workers_with

    c = tagged
    where = {t: workers_with(c, t)[0] for t in TAGS}
    g = graph(pd_guess(), big_grid())
    actors = start_actors(c, g, tiny_model, tmp_path)
    try:
        assert sorted(a for _, _, a in actors.workers) == sorted([where[H800], where[H20]])
        assert sorted(actors.placement["env"]) == sorted([where[CPU_ENV], where[BIG]])
        grid_mgr = actors.managers_for(g.tasks[1])
        assert len(grid_mgr) == 1 and BIG in grid_mgr[0].key
        assert CPU_ENV in actors.managers_for(g.tasks[0])[0].key
        actors.trainer.publish().result()
        for w, _, _ in actors.workers:
            w.update_weights(0).result()
            w.wait_version(0).result()
        out = [actors.managers_for(t)[0].run_group(t, seed=i, group_id=f"g{i}",
                                                   group_size=2) for i, t in enumerate(g.tasks)]
        for summary in (f.result(timeout=120) for f in out):
            assert "failed" not in summary["outcomes"], summary  # judged() ran on GPU_RM
        stats = {tag: w.stats().result() for w, tag, _ in actors.workers}
        assert stats[H800]["kv_sent"] > 0 and stats[H20]["kv_received"] > 0  # guess: PD
        assert stats[H800]["kv_sent"] == stats[H20]["kv_received"]
    finally:
        _shutdown(actors)
