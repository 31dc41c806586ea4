"""The cluster simulator (rollart.sim): its decisions are the runtime's, it is
deterministic per seed, and the modes order as they must where the order is certain.

One test runs the same workload through a real in-process cluster (resources/local.py:
one H800 and one H20 inference worker) and through the simulator, and compares where
each task's requests went and that no trained trajectory exceeded alpha in either.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from rollart import GRPO, Policy
from rollart.policy.affinity import Affinity
from rollart.chaos.faults import Latency
from rollart.env.tasks import get_task
from rollart.policy.routing import Router
from rollart.sim import ClusterSpec, EnvPool, GPUPool, RewardPool, SimConfig, TaskShape, simulate
from rollart.sim.cluster import Cluster
from rollart.sim.costs import (GPUS, MODELS, ControlPlane, Costs, EnvCost, GenCost, GPUSpec,
                               RewardCost, TrainCost, WeightSync)
from rollart.policy.staleness import StalenessBound
from rollart.testing import tiny_graph
from rollart.types import H20, H800

FIXED = EnvCost("fixed", reset=Latency("fixed", 1.0), step=Latency("fixed", 0.5))


def _tasks():
    """guess with PD (prefill on H800, decode on H20), gridnav pinned to H20."""
    return (replace(get_task("guess"), name="sim_guess",
                    affinity=Affinity(prefill=H800, decode=H20)),
            replace(get_task("gridnav"), name="sim_grid", affinity=Affinity(pools=(H20,))))


#: a graph named "sim": tasks (default gridnav), mode, groups, size, steps, rollout fields
_graph = partial(tiny_graph, "sim")


def _cluster(h800=1, h20=1, slots=64, reward=None, trainer=8):
    return ClusterSpec((GPUPool(H800, "H800", h800), GPUPool(H20, "H20", h20)),
                       (EnvPool("CPU_ENV", slots),), reward or RewardPool(),
                       trainer_gpus=trainer)


def _costs(env=FIXED, train_s=None, **changes):
    costs = Costs(model=MODELS["Qwen3-8B"], env={"*": env})
    if train_s is not None:  # a trainer step of (about) train_s seconds
        changes["train"] = TrainCost(costs.model, costs.gpus["H800"], 10 ** 6,
                                     overhead_s=train_s)
        changes["weights"] = WeightSync(latency_s=0.0, rdma_bytes_s=1e15)
    return costs.with_(**changes)


def test_the_simulator_calls_the_runtimes_policy_objects():
    cfg = SimConfig(_cluster(), _graph(_tasks()), _costs())
    cl = Cluster(cfg)
    mgr = cl.managers["CPU_ENV"][0]
    assert type(mgr.router) is Router and type(cl.bound) is StalenessBound
    # the router the simulator holds decides as the proxy's does for these tasks
    assert mgr.router.disaggregated("sim_guess") == Affinity(prefill=H800, decode=H20)
    assert mgr.router.pools_for("sim_grid") == (H20,)


def test_same_workload_real_cluster_and_simulator_route_alike_and_stay_within_alpha(
        local_cluster, tiny_model, tmp_path):
    from rollart.control.fleet import Fleet
    from rollart.control.modes import make_pipeline
    from rollart.control.stages import Stages
    from rollart.control.lifecycle import shutdown as _shutdown

    graph = _graph(_tasks(), steps=3)
    stages = Stages(local_cluster, graph, tiny_model, tmp_path / "run")
    actors = stages.start()
    try:
        actors.trainer.publish().result()
        pipe = make_pipeline(Fleet(actors, stages), graph)
        steps = [pipe.step(s) for s in range(1, 4)]
        # decode side first: what it received by then was sent by then, and rollout goes
        # on (async), so the prefill side read after it has sent at least as much
        order = sorted(actors.workers, key=lambda w: w[1] != H20)
        real = {tag: w.stats().result() for w, tag, _ in order}
    finally:
        _shutdown(actors)
    sim = simulate(SimConfig(_cluster(), graph, _costs(), steps=3, record=True,
                             shapes={"sim_guess": TaskShape(turns=3, prompt_tokens=40,
                                                            obs_tokens=8,
                                                            response_tokens=4),
                                     "sim_grid": TaskShape(turns=4, prompt_tokens=40,
                                                           obs_tokens=8,
                                                           response_tokens=4)}))
    # runtime: H800 only prefilled (guess's PD prefills: KV sent, nothing generated), so
    # gridnav never ran there; H20 decoded guess (KV received) and generated gridnav
    assert real[H800]["tokens_generated"] == 0 and real[H800]["kv_sent"] > 0, real[H800]
    # every KV decoded on H20 came from an H800 prefill (some prefills may still wait for
    # their decode, or their member was cancelled)
    assert 0 < real[H20]["kv_received"] <= real[H800]["kv_sent"], (real[H20], real[H800])
    assert real[H20]["tokens_generated"] > 0
    # simulator: the same routes, phase by phase
    assert set(sim.decisions) == {("sim_guess", H800, "prefill"),
                                  ("sim_guess", H20, "decode"), ("sim_grid", H20, "gen")}
    phases = [p for t, _, p in sim.decisions if t == "sim_guess"]
    assert phases.count("prefill") == phases.count("decode") > 0
    # neither trained anything older than alpha = 1 versions behind the trainer
    alpha = graph.algo.alpha
    assert max(m["trainer/staleness_max"] for m in steps) <= alpha
    assert sim.staleness and max(sim.staleness) <= alpha and sim.steps == 3


def _run(graph, seed=0, **kw):
    return simulate(SimConfig(_cluster(**kw.pop("cluster", {})), graph,
                              kw.pop("costs", _costs()), seed=seed,
                              steps=kw.pop("steps", graph.steps), **kw))


def test_same_seed_same_run_other_seed_other_run():
    sandbox = Costs().env_for("sandbox")  # heavy tails and failures: the seed matters
    g = _graph(("gridnav", "guess"), groups=4, size=4, redundancy=1.5)
    a, b = (_run(g, 3, costs=_costs(sandbox), record=True) for _ in range(2))
    c = _run(g, 4, costs=_costs(sandbox))
    assert (a.sim_time_s, a.staleness, a.aborts, a.decisions, a.control) == \
        (b.sim_time_s, b.staleness, b.aborts, b.decisions, b.control)
    assert a.sim_time_s != c.sim_time_s


def test_a_tiny_simulation_reports_its_figures_in_every_mode():
    for mode in ("sync", "sync+", "one-off", "areal", "async"):
        r = _run(_graph(mode=mode, groups=2, size=2), steps=2)
        assert r.steps == 2 and r.trained == 2 * 2 * 2, (mode, r.summary())
        assert 0 < r.utilisation[H20] + r.utilisation[H800] and r.utilisation["trainer"] > 0
        assert r.throughput["trajectories_s"] == pytest.approx(r.trained / r.sim_time_s)
        assert r.control["msgs_per_turn"] >= 1 and r.control["scheduler_load"] > 0
        assert r.timeline["trainer"] and max(v for _, v in r.timeline["trainer"]) <= 1.0


def test_without_env_variance_and_trainer_cost_syncplus_matches_async():
    costs = _costs(FIXED, train_s=0.0)
    g = _graph(groups=4, size=4, steps=4)
    plus, asy = (_run(g, mode=m, costs=costs) for m in ("sync+", "async"))
    ratio = asy.throughput["trajectories_s"] / plus.throughput["trajectories_s"]
    assert ratio == pytest.approx(1.0, abs=0.1), (plus.summary(), asy.summary())


def test_with_trainer_steps_as_long_as_rollout_async_beats_sync():
    """A step's rollout takes ~24 s here; sync adds the trainer's 20 s to each step,
    async overlaps them (the next step's groups roll out while the trainer steps)."""
    costs = _costs(FIXED, train_s=20.0)
    g = _graph(groups=4, size=4, steps=4)
    sync, asy = (_run(g, mode=m, costs=costs) for m in ("sync", "async"))
    assert asy.throughput["trajectories_s"] > 1.3 * sync.throughput["trajectories_s"], \
        (sync.summary(), asy.summary())
    assert max(asy.staleness) == 1 and max(sync.staleness) == 0


def test_aborts_keep_async_within_alpha_while_areal_trains_older_data():
    """Long-tailed trajectories and a fast trainer: async aborts the members the bound
    rules out (none trained older than alpha); areal checks only at the start. Async
    at a fixed limit of alpha steps' worth (its default adapts the limit under the start
    bound, which starts fewer groups that could go stale)."""
    long_tail = EnvCost("tail", reset=Latency("fixed", 1.0),
                        step=Latency("pareto", 1.0, shape=1.1, cap=400.0))
    costs = _costs(long_tail, train_s=1.0)
    g = replace(_graph(steps=8, max_in_flight=2, stale_members="abort"),
                algo=GRPO(group_size=4, groups_per_step=4, alpha=2))
    asy, areal = (_run(g, mode=m, costs=costs, seed=1) for m in ("async", "areal"))
    assert asy.aborts["aborted"] > 0 and max(asy.staleness) <= 2, asy.staleness
    assert areal.aborts["aborted"] == 0 and max(areal.staleness) > 2, areal.staleness


def test_rescored_members_keep_their_turns_and_async_within_alpha():
    """The same long-tailed run with stale members re-scored (async's default on the
    torch engine, rollart.env.rescore): members the bound rules out are re-scored at a
    turn boundary (one forward over their context on their worker) instead of aborted,
    so far fewer are aborted and none trained is older than alpha; the forwards cost
    prefill on the workers."""
    long_tail = EnvCost("tail", reset=Latency("fixed", 1.0),
                        step=Latency("pareto", 1.0, shape=1.1, cap=400.0))
    costs = _costs(long_tail, train_s=1.0)
    runs = {}
    for members in ("abort", "rescore"):
        g = replace(_graph(steps=8, max_in_flight=2, stale_members=members),
                    algo=GRPO(group_size=4, groups_per_step=4, alpha=2))
        runs[members] = _run(g, mode="async", costs=costs, seed=1)
    abort, rescore = runs["abort"], runs["rescore"]
    assert rescore.aborts["rescored"] > 0 and rescore.aborts["rescored_tokens"] > 0
    assert abort.aborts["rescored"] == 0
    assert rescore.aborts["aborted"] < abort.aborts["aborted"], (rescore.aborts,
                                                                 abort.aborts)
    assert rescore.trained == abort.trained and max(rescore.staleness) <= 2, \
        rescore.staleness


def test_a_take_window_trains_groups_in_start_order_in_the_simulator_too():
    """Rollout.take_window, as the runtime's buffer applies it (Slots.take_limit): with
    three steps' worth in flight and long-tailed episodes the first to complete are
    not the first started; with a window of one step's worth every step's groups
    started before the next step's."""
    long_tail = EnvCost("tail", reset=Latency("fixed", 1.0),
                        step=Latency("pareto", 1.0, shape=1.1, cap=400.0))
    costs = _costs(long_tail, train_s=1.0)
    base = replace(_graph(steps=8, max_in_flight=3),
                   algo=GRPO(group_size=2, groups_per_step=4, alpha=3))
    free, window = (_run(replace(base, rollout=replace(base.rollout, take_window=w)),
                         mode="async", costs=costs, seed=1) for w in (None, 1))

    def ordered(batches):
        return all(max(a) < min(b) for a, b in zip(batches, batches[1:]))

    assert len(window.extra["trained_groups"]) == 8
    assert ordered(window.extra["trained_groups"]), window.extra["trained_groups"]
    assert not ordered(free.extra["trained_groups"]), free.extra["trained_groups"]


def test_redundancy_launches_extras_and_cancels_the_last_finishers():
    tail = EnvCost("tail", reset=Latency("fixed", 1.0),
                   step=Latency("lognormal", 1.0, sigma=1.5))
    g = _graph(groups=4, size=4, steps=2, redundancy=1.5)
    r = _run(g, mode="sync+", costs=_costs(tail))
    assert r.aborts["launched"] == 2 * 4 * 6 and r.aborts["cancelled"] == 2 * 4 * 2
    assert r.trained == 2 * 4 * 4


def test_the_elastic_reward_pool_is_busier_than_a_dedicated_one():
    reward = RewardCost(call=Latency("fixed", 0.5), cold_start_s=2.0)
    g = _graph(groups=4, size=4, steps=3)
    util = {}
    for kind in ("dedicated", "elastic"):
        pool = RewardPool(kind, workers=16, max_workers=16, idle_timeout=2.0)
        r = _run(g, cluster={"reward": pool}, costs=_costs(FIXED, reward=reward))
        util[kind] = r.utilisation["reward"]
        if kind == "elastic":
            assert r.extra["reward_cold_starts"] > 0
    assert util["elastic"] > 2 * util["dedicated"], util


def test_cluster_spec_from_a_resources_file():
    from rollart.runtime.resources import load_resources

    spec = ClusterSpec.from_resources(load_resources("gpu_cluster"))
    assert {p.tag: p.count for p in spec.inference} == {H800: 2, H20: 4}
    assert spec.trainer_gpus == 2 and spec.reward.workers == 8


@pytest.mark.bench
def test_cluster_sim_benchmark_tiny(tmp_path):
    """benchmarks/cluster_sim.py --tiny: no real runs, the modes and PD experiments cut
    to a smoke test, the 3,000-GPU cluster with two groups; its RESULT line and plots."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "cluster_sim.py"),
                          "--tiny", "--out", str(tmp_path)], cwd=root, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    got = {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    for key in ("calibration_error", "affinity_vs_h20", "affinity_vs_h800", "async_vs_sync",
                "syncplus_vs_sync", "pd_gain", "redundancy_gain", "serverless_util", "gpus",
                "sim_wall_s"):
        assert key in got, line
    assert got["gpus"] == 3000 and got["async_vs_sync"] > 0 and got["pd_gain"] > 0
    # the scale run through both weight paths: relayed from the gang, from one store
    assert got["weight_sync_s"] < 10 < 3000 < got["weight_sync_s_store"]
    assert got["origin_bytes_ratio"] < 0.01 and got["origin_bytes_ratio_store"] == 1
    assert 0 < got["gpu_util_3000"] <= 1 and 0 < got["gpu_util_3000_store"] <= 1
    assert (tmp_path / "sim_utilisation.png").stat().st_size > 1000
    assert (tmp_path / "sim_staleness.png").stat().st_size > 1000


def _cluster_sim_scale(tmp_path, *args) -> dict:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "cluster_sim.py"),
                          "--tiny", "--scale-only", "--out", str(tmp_path), *args], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def test_cluster_sim_scale_max_in_flight_reaches_the_scale_runs(tmp_path):
    """--scale-max-in-flight X is the 3,000-GPU runs' Rollout.max_in_flight: three steps'
    worth in flight keeps the inference GPUs busier than the default one step's worth
    (it was parsed and never passed on: both runs gave the same figures to four digits)."""
    default = _cluster_sim_scale(tmp_path / "a")
    three = _cluster_sim_scale(tmp_path / "b", "--scale-max-in-flight", "3")
    assert three["gpu_util_3000"] > 1.5 * default["gpu_util_3000"], (default, three)
    assert three["scale_traj_s"] > 1.5 * default["scale_traj_s"], (default, three)


# -- control-plane latency, the env managers' loops, the shared GIL ----------------------
INSTANT = GPUSpec("instant", flops=1e19, hbm_bytes_s=1e19, mem_bytes=1e15)  # ~1e-8 s a step
TURNS, RESET, STEP, REWARD_S, CALL = 3, 1.0, 0.5, 0.2, 0.01
QWEN3_8B_WEIGHT_BYTES = MODELS["Qwen3-8B"].params * 2  # BF16
H20_HBM_BYTES_S = 4.0e12


def _lockstep_run(groups=1, managers=None, turn_s=0.0, near=False, call=CALL):
    """A sync run of one step whose engine and trainer take no time: what is left is the
    env, the reward and what the test charges (control plane, loop time)."""
    costs = _costs(FIXED, train_s=0.0).with_(
        gpus={"instant": INSTANT}, reward=RewardCost(call=Latency("fixed", REWARD_S)),
        control=ControlPlane(actor_call_s=call, near=near), manager_turn_s=turn_s)
    cluster = ClusterSpec((GPUPool(H20, "instant", 1),),
                          (EnvPool("CPU_ENV", 64, managers=managers),),
                          RewardPool("dedicated", workers=8), trainer_gpus=1,
                          trainer_gpu="instant")
    shape = TaskShape(turns=TURNS, prompt_tokens=10, obs_tokens=5, response_tokens=4)
    g = _graph(mode="sync", groups=groups, size=2, steps=1, inference_pools=(H20,))
    return simulate(SimConfig(cluster, g, costs, shapes={"gridnav": shape}, steps=1))


def test_a_turn_pays_its_generation_calls_round_trip_and_the_step_its_calls():
    """One group of two identical members in lockstep (one path): the step ends after
    the reset, every turn's generation call (an actor round trip unless near) and env
    step, the reward, the buffer put, then the driver's train_step and the trainer's
    get_table calls, then the weight push (16.4 GB at 1 PB/s); engine and trainer cost
    nothing here."""
    far, near = _lockstep_run(), _lockstep_run(near=True)
    push = QWEN3_8B_WEIGHT_BYTES / 1e15
    path = RESET + TURNS * STEP + REWARD_S + 3 * CALL + push  # put, train_step, get_table
    assert near.sim_time_s == pytest.approx(path, abs=1e-6)
    assert far.sim_time_s == pytest.approx(path + TURNS * CALL, abs=1e-6)
    slow = _lockstep_run(call=0.1, near=True)
    assert slow.sim_time_s - near.sim_time_s == pytest.approx(3 * (0.1 - CALL), abs=1e-6)


def test_an_env_managers_loop_serialises_its_trajectories_turns():
    """Two groups of two in lockstep, each turn holding its manager's loop 50 ms: on one
    manager the four holds of a turn run one after another (the last member generates
    4 × 50 ms after the barrier opens), on two managers two by two."""
    c = 0.05
    base = _lockstep_run(groups=2, managers=1)
    one = _lockstep_run(groups=2, managers=1, turn_s=c)
    two = _lockstep_run(groups=2, managers=2, turn_s=c)
    assert one.sim_time_s - base.sim_time_s == pytest.approx(TURNS * 4 * c, abs=1e-6)
    assert two.sim_time_s - base.sim_time_s == pytest.approx(TURNS * 2 * c, abs=1e-6)
    assert one.control["manager_loop_busy"] == pytest.approx(
        4 * TURNS * c / one.sim_time_s, rel=1e-6)


def test_a_co_located_turn_pauses_a_busy_engine_and_not_an_idle_one():
    """``SimWorker.stall``: the GIL taken by the manager's Python for 30 ms delays a
    request by exactly that when it comes during the request's admission, by that and
    at most one decode step's rounding when it cuts a decode phase; an idle worker
    loses nothing."""
    import simpy

    from rollart.sim.pools import Meter, Req, SimWorker

    gen = GenCost(MODELS["Qwen3-8B"], GPUS["H20"], mbu=0.7, step_overhead_s=0.01)
    step = QWEN3_8B_WEIGHT_BYTES / (H20_HBM_BYTES_S * 0.7) + 0.01  # batch 1, no KV yet
    done = {}
    for when in (None, 0.0, 0.05):
        env = simpy.Environment()
        w = SimWorker(env, 0, H20, gen, 8, Meter(1, 1.0))
        w.stall(1.0)  # idle: nothing to pause
        req = Req(env, 0, 0, 0, 20, "decode")  # KV already there: decode only
        w.submit(req)
        if when is not None:
            env.timeout(when).callbacks.append(lambda _e, w=w: w.stall(0.03))
        env.run(until=req.event)
        done[when] = env.now
        assert w.stalled == pytest.approx(0.0 if when is None else 0.03)
    assert done[0.0] - done[None] == pytest.approx(0.03, abs=1e-9)
    assert 0.03 - 1e-9 <= done[0.05] - done[None] <= 0.03 + step


def test_a_colocated_prefill_stalls_the_decode_batch_and_a_decode_arrival_joins_it():
    """Prefill-decode interference, by hand on H800 (8B): a row decoding 100 tokens
    alone ends at ``prefill(1000) + 100 steps``; a 5,000-token prompt arriving after its
    40th step is prefilled with decoding paused, so the row ends exactly that prefill
    later (40 steps at the first phase's midpoint context, 60 at the second's). On a
    decode-only (PD) worker the same arrival brings its KV and joins the running batch:
    the row pays only the arrival's KV read in the one step they share, not a prefill
    (it paid a step of the arrival's own before they shared one)."""
    import simpy

    from rollart.sim.pools import Meter, Req, SimWorker

    m, h800 = MODELS["Qwen3-8B"], GPUS["H800"]
    gen = GenCost(m, h800)
    flops, hbm = 989e12 * 0.5, 3.35e12 * 0.7

    def step(ctx):  # batch 1: one read of the weights and the row's KV
        return (m.params * 2 + m.kv_bytes_per_token * ctx) / hbm

    def prefill(n):  # compute-bound: 2·params·n + attention over n/2 on average
        return (2 * m.params * n + 4 * m.layers * m.attn_width * n * n / 2) / flops

    assert gen.decode_step_s(1, 1050) == pytest.approx(step(1050))
    assert gen.prefill_s(5000) == pytest.approx(prefill(5000))
    at = prefill(1000) + 40 * step(1050)  # the row's 40th step ends
    ends = {}
    for arrival in (None, "full", "decode"):
        env = simpy.Environment()
        w = SimWorker(env, 0, "H800", gen, 8, Meter(1, 1.0))
        row = Req(env, 1000, 0, 1000, 100)
        w.submit(row)
        if arrival == "full":  # colocated: the new request's prompt is prefilled here
            other = Req(env, 5000, 0, 5000, 0)
        elif arrival == "decode":  # PD: prefilled elsewhere, its KV moved here
            other = Req(env, 0, 5000, 5000, 1, "decode")
        if arrival is not None:
            env.timeout(at).callbacks.append(lambda _e, o=other, w=w: w.submit(o))
        env.run(until=row.event)
        ends[arrival] = env.now
    assert ends[None] == pytest.approx(prefill(1000) + 100 * step(1050))
    assert ends["full"] == pytest.approx(at + prefill(5000) + 60 * step(1040 + 30))
    assert ends["full"] - ends[None] > 0.9 * prefill(5000) > 0.15
    # the decode worker: one step of both rows (the arrival's one token), then the
    # row's 59 left alone
    both = (m.params * 2 + m.kv_bytes_per_token * (1040 + 5000 + 1)) / hbm
    assert ends["decode"] == pytest.approx(at + both + 59 * step(1070))
    assert ends["decode"] - ends[None] < 0.1 * (ends["full"] - ends[None])


def test_a_weight_load_re_prefills_each_in_flight_row_over_its_own_context():
    """A new version reaches a worker holding four rows of 8,000 tokens (H800, 8B): the
    load re-prefills each row's context (four × 8,000 with attention over 4,000 on
    average), by hand 1.21 s; it was charged as one 32,000-token sequence (attention over
    16,000: 1.67 s)."""
    import simpy

    from rollart.sim.pools import Meter, Req, SimWorker

    m = MODELS["Qwen3-8B"]
    gen = GenCost(m, GPUS["H800"])
    env = simpy.Environment()
    w = SimWorker(env, 0, "H800", gen, 8, Meter(1, 1.0))
    for _ in range(4):  # KV already there (PD decode rows): they join one batch at 0
        w.submit(Req(env, 0, 8000, 8000, 1000, "decode"))
    loaded = []  # a new version 1 µs later: decoding suspended, the rows re-prefilled
    env.timeout(1e-6).callbacks.append(lambda _e: loaded.append(w.load(1, 0.0)))
    env.run(until=2e-6)
    env.run(until=loaded[0])
    recompute = (2 * m.params * 32_000 + 4 * 4 * m.layers * m.attn_width * 8000 * 4000) \
        / (989e12 * 0.5)
    assert env.now == pytest.approx(1e-6 + recompute)
    assert recompute == pytest.approx(1.21, abs=0.01) and w.version == 1 and w.loads == 1
    # Policy.weight_update="keep": the same load re-prefills nothing, the rows go on
    keep = Cluster(SimConfig(_cluster(), replace(_graph(), policy=Policy(
        warmup_steps=0, weight_update="keep")), _costs()))
    assert all(x.keep_kv for x in keep.workers)
    env = simpy.Environment()
    w = SimWorker(env, 0, "H800", gen, 8, Meter(1, 1.0), keep_kv=True)
    for _ in range(4):
        w.submit(Req(env, 0, 8000, 8000, 1000, "decode"))
    env.timeout(1e-6).callbacks.append(lambda _e: w.load(1, 0.0))
    env.run(until=2e-6)  # the load is done at once, not 1.21 s later
    assert w.version == 1 and w.loads == 1


def test_members_draw_their_length_from_measured_episodes():
    """``TaskShape.episodes``: each member plays one measured ``(turns, tokens per
    turn)``; with one episode every member is that one (the shape's own ``turns`` and
    ``response_tokens`` unused), with two lengths both occur."""
    g = _graph(mode="sync", groups=4, size=4, steps=1)
    plain = _run(g, shapes={"gridnav": TaskShape(turns=2, response_tokens=4)})
    one = _run(g, shapes={"gridnav": TaskShape(turns=7, response_tokens=99,
                                               episodes=((2, 4.0),))})
    assert one.extra["turns"] == plain.extra["turns"] == 4 * 4 * 2
    assert one.sim_time_s == pytest.approx(plain.sim_time_s)
    two = _run(g, shapes={"gridnav": TaskShape(episodes=((1, 4.0), (5, 4.0)))})
    assert 16 * 1 < two.extra["turns"] < 16 * 5
    assert (two.extra["turns"] - 16) % 4 == 0  # each member 1 or 5 turns


def test_a_group_left_too_small_by_failed_members_is_not_trained_in_the_simulator_too():
    """``GRPO.min_group_size`` (2): a group of 2 that keeps one member, its other failed
    past its re-runs, is not trained, as the ``SampleBuffer`` decides
    (``rollart.policy.redundancy.min_members``)."""
    flaky = EnvCost("flaky", reset=Latency("fixed", 1.0), step=Latency("fixed", 0.5),
                    fail_prob=0.3)
    r = _run(_graph(groups=2, size=2, steps=3), seed=1, costs=_costs(flaky))
    assert r.aborts["groups_failed"] > 0 and r.aborts["replaced"] > 0
    assert r.trained == 3 * 2 * 2  # every trained group has both its members
