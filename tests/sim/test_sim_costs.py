"""The simulator's cost models (rollart.sim.costs) against hand-computed figures, and the
calibration's measurements (rollart.sim.measure) on a real in-process cluster."""

import math
import random
import statistics

import pytest

from rollart.sim.costs import (ENV_PROFILES, GPUS, MODELS, ControlPlane, Costs, GenCost,
                               GPUSpec, TrainCost, WeightSync, laptop_env)

# datasheet figures, written out here rather than read from the code's table
H20_HBM, H20_FLOPS = 4.0e12, 148e12
H800_HBM, H800_FLOPS = 3.35e12, 989e12
QWEN3_8B_PARAMS = 8.2e9


def test_gpu_table_holds_the_datasheet_figures():
    assert GPUS["H20"].hbm_bytes_s == H20_HBM and GPUS["H20"].flops == H20_FLOPS
    assert GPUS["H800"].hbm_bytes_s == H800_HBM and GPUS["H800"].flops == H800_FLOPS
    assert GPUS["H100"].flops == GPUS["H800"].flops  # same silicon, cut NVLink


def test_qwen3_8b_decode_at_batch_1_on_h20_is_one_read_of_the_weights():
    g = GenCost(MODELS["Qwen3-8B"], GPUS["H20"], mbu=0.7)
    expected = QWEN3_8B_PARAMS * 2 / (H20_HBM * 0.7)  # 16.4 GB of BF16 over 2.8 TB/s
    assert g.decode_step_s(1, 0) == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(5.857e-3, rel=1e-3)


def test_decode_reads_the_kv_of_every_row_and_turns_compute_bound_at_large_batch():
    g = GenCost(MODELS["Qwen3-8B"], GPUS["H20"], mfu=0.5, mbu=0.7)
    kv = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads of 128, BF16
    ctx = 64 * 2048
    memory = (QWEN3_8B_PARAMS * 2 + kv * ctx) / (H20_HBM * 0.7)
    compute = (2 * QWEN3_8B_PARAMS * 64 + 4 * 36 * 32 * 128 * ctx) / (H20_FLOPS * 0.5)
    assert compute > memory  # H20's low FLOP/s: batch 64 at 2k context is compute-bound
    assert g.decode_step_s(64, ctx) == pytest.approx(compute, rel=1e-9)
    small = 4 * 512
    assert g.decode_step_s(4, small) == pytest.approx(
        (QWEN3_8B_PARAMS * 2 + kv * small) / (H20_HBM * 0.7), rel=1e-9)


def test_prefill_is_compute_bound_and_faster_on_h800_decode_faster_on_h20():
    m = MODELS["Qwen3-8B"]
    h800, h20 = GenCost(m, GPUS["H800"]), GenCost(m, GPUS["H20"])
    n = 4096
    flops = 2 * QWEN3_8B_PARAMS * n + 4 * 36 * 32 * 128 * n * (n / 2)
    assert h800.prefill_s(n) == pytest.approx(flops / (H800_FLOPS * 0.5), rel=1e-9)
    assert h20.prefill_s(n) / h800.prefill_s(n) == pytest.approx(989 / 148, rel=1e-9)
    assert h20.decode_step_s(8, 8 * 1024) < h800.decode_step_s(8, 8 * 1024)


def test_prefix_cache_removes_the_cached_tokens_prefill():
    g = GenCost(MODELS["Qwen3-14B"], GPUS["H800"])
    full, reuse = g.prefill_s(4000), g.prefill_s(1000, cached_tokens=3000)
    # 14B: 40 layers, 40 query heads of 128; the new tokens attend to all 4000
    expected = (2 * 14.8e9 * 1000 + 4 * 40 * 5120 * 1000 * (3000 + 500)) / (989e12 * 0.5)
    assert reuse == pytest.approx(expected, rel=1e-9)
    assert reuse < full / 3


def test_a_batched_prefill_charges_each_rows_attention_over_its_own_context():
    """Ten rows of 1,000 new tokens after 9,000 cached each (compute-bound on H800):
    attention is each row's 1,000 × 9,500, not 10,000 × 95,000 of one long sequence
    (what the batch cost came to before); four rows of 10 new tokens after 5,000 cached
    are memory-bound: one read of the weights and of every row's 5,010 tokens of KV."""
    m = MODELS["Qwen3-8B"]
    g = GenCost(m, GPUS["H800"])
    kv = 2 * 36 * 8 * 128 * 2
    flops = 2 * QWEN3_8B_PARAMS * 10_000 + 10 * 4 * 36 * 4096 * 1000 * (9000 + 500)
    assert g.prefill_batch_s([(1000, 9000)] * 10) == pytest.approx(
        flops / (H800_FLOPS * 0.5), rel=1e-9)
    one_sequence = 4 * 36 * 4096 * 10_000 * (90_000 + 5000)
    assert g.prefill_batch_s([(1000, 9000)] * 10) < 0.5 * one_sequence / (H800_FLOPS * 0.5)
    small = g.prefill_batch_s([(10, 5000)] * 4)
    assert small == pytest.approx((QWEN3_8B_PARAMS * 2 + kv * 4 * 5010) / (3.35e12 * 0.7),
                                  rel=1e-9)
    assert g.prefill_batch_s([(3000, 500)]) == pytest.approx(g.prefill_s(3000, 500))
    assert g.prefill_batch_s([(0, 100)]) == 0.0


def test_tensor_parallelism_divides_the_work_at_its_stated_efficiency():
    m = MODELS["Qwen3-32B"]
    one, four = GenCost(m, GPUS["H20"]), GenCost(m, GPUS["H20"], tp=4)
    assert one.decode_step_s(1) / four.decode_step_s(1) == pytest.approx(4 * 0.9 ** 2)


def test_kv_bytes_per_token_from_the_model_shape():
    assert MODELS["Qwen3-8B"].kv_bytes_per_token == 147456  # 144 KiB
    assert MODELS["Qwen3-32B"].kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    assert MODELS["Qwen3-8B"].weight_bytes == pytest.approx(16.4e9)


def test_tiny_model_spec_matches_a_real_kv_cache(tmp_path):
    """The spec read from the model equals the bytes a real forward's cache holds."""
    import torch
    from transformers import DynamicCache

    from rollart.model import build_tiny_model, load_model
    from rollart.sim.measure import _tiny_spec

    path = build_tiny_model(str(tmp_path / "m"), ["a b c d e f g"], hidden_size=64)
    model = load_model(path)
    spec = _tiny_spec(model)
    assert spec.params == sum(p.numel() for p in model.parameters())
    tokens = 11
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.ones((1, tokens), dtype=torch.long), use_cache=True,
              cache=cache)
    held = sum(layer.keys.numel() * layer.keys.element_size()
               + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)
    assert spec.kv_bytes_per_token == held / tokens


def test_failure_draws_match_the_profile_rate_over_many_samples():
    env, rng, n = ENV_PROFILES["sandbox"], random.Random(1), 20000
    draws = [env.sample_step(rng) for _ in range(n)]
    rate = sum(f for _, f in draws) / n
    assert abs(rate - 0.1) < 4 * math.sqrt(0.1 * 0.9 / n)  # ~1 failure per 10 steps
    lat = sorted(t for t, _ in draws)
    median, p99 = lat[n // 2], lat[int(n * 0.99)]
    assert median == pytest.approx(2.0, rel=0.05)
    assert p99 / median > 10  # heavy tail: lognormal sigma 1.2 gives e^(2.33·1.2) ≈ 16
    resets = [env.sample_reset(rng) for _ in range(2000)]
    assert statistics.median(resets) > 10 * median  # a retry's reset dwarfs a step


def test_laptop_profile_is_the_benchmarks_straggler_profile():
    env, rng, n = laptop_env(), random.Random(2), 20000
    resets = [env.sample_reset(rng) for _ in range(n)]
    assert max(resets) <= 2.0 and min(resets) >= 0.05  # Pareto from 50 ms, capped at 2 s
    # Pareto(min 0.05, shape 1.2): median 0.05 · 2^(1/1.2)
    assert statistics.median(resets) == pytest.approx(0.05 * 2 ** (1 / 1.2), rel=0.05)
    steps = [env.sample_step(rng) for _ in range(n)]
    assert statistics.median(t for t, _ in steps) == pytest.approx(0.02, rel=0.05)
    assert not any(f for _, f in steps) and env.cpu_share == 0


def test_weight_transfer_times_at_the_stated_rates():
    m = MODELS["Qwen3-8B"]
    rdma, tcp = WeightSync("rdma"), WeightSync("tcp", prefetch=False)
    assert rdma.pull_s(m) == pytest.approx(0.05 + 16.4e9 / 12.5e9)
    assert tcp.pull_s(m) == pytest.approx(0.05 + 16.4e9 / 1.25e9)
    assert rdma.pull_s(m, tp=4) == pytest.approx(0.05 + 16.4e9 / 4 / 12.5e9)
    load = 16.4e9 / H20_HBM
    # a pull that overlaps 1 s of decoding exposes only the rest, plus the HBM load
    assert rdma.exposed_pull_s(m, GPUS["H20"], overlap_s=1.0) == pytest.approx(
        0.05 + 16.4e9 / 12.5e9 - 1.0 + load)
    assert tcp.exposed_pull_s(m, GPUS["H20"], overlap_s=1.0) == pytest.approx(
        0.05 + 16.4e9 / 1.25e9 + load)  # no prefetch: all of it stalls


def test_trainer_step_is_six_params_tokens_over_its_gpus():
    t = TrainCost(MODELS["Qwen3-8B"], GPUS["H800"], gpus=32, mfu=0.4, overhead_s=2.0)
    tokens = 512 * 8192
    assert t.step_s(tokens) == pytest.approx(
        6 * QWEN3_8B_PARAMS * tokens / (32 * H800_FLOPS * 0.4) + 2.0)


def test_costs_bundle_builds_pool_costs_and_says_what_to_change():
    c = Costs()
    g = c.gen_for("H20", tp=2)
    assert g.model is MODELS["Qwen3-8B"] and g.tp == 2 and g.gpu == GPUS["H20"]
    cpu = GenCost(MODELS["tiny"], GPUSpec("cpu", 1e10, 1e10, 1e9), step_overhead_s=1e-3)
    c2 = Costs(model=MODELS["tiny"], gen={"cpu": cpu})
    assert c2.gen_for("cpu", tag="H800") is cpu
    assert c.env_for(None) is ENV_PROFILES["sandbox"] and c.env_for("web").name == "web"
    with pytest.raises(KeyError, match="unknown GPU type 'B200'"):
        c.gen_for("B200")
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        GenCost(MODELS["Qwen3-8B"], GPUS["H20"], tp=0)
    with pytest.raises(ValueError, match="transport must be 'rdma' or 'tcp'"):
        WeightSync("udp")
    assert ControlPlane(scheduler_tasks_s=500).scheduler_load(250) == 0.5


def test_control_plane_measured_on_a_real_cluster(local_cluster):
    from rollart.sim.measure import measure_control_plane

    cp = measure_control_plane(local_cluster, n=20, burst=40)
    for v in (cp.actor_call_s, cp.task_s, cp.scheduler_tasks_s):
        assert math.isfinite(v) and v > 0
    assert cp.actor_call_s < 1.0 and cp.task_s < 1.0  # seconds, not milliseconds


def test_shapes_from_parquet_samples(tmp_path):
    from rollart.buffer.schema import to_record_batch, write_parquet
    from rollart.sim.measure import measure_shapes
    from rollart.types import Trajectory

    def traj(i, task, prompt, gens, obs):
        resp, mask = [], []
        for k, g in enumerate(gens):
            resp += [5] * g
            mask += [1] * g
            if k < len(gens) - 1:
                resp += [6] * obs
                mask += [0] * obs
        return Trajectory(f"t{i}", task, f"g{i}", i, [1] * prompt, resp, mask,
                          [0.0] * len(mask), [0] * len(mask), num_turns=len(gens))

    rows = [traj(0, "guess", 10, [4, 4, 4], 3), traj(1, "guess", 12, [2, 2, 2], 5),
            traj(2, "gridnav", 20, [4], 0)]
    (tmp_path / "samples").mkdir()
    write_parquet(to_record_batch(rows), str(tmp_path / "samples" / "part-0.parquet"))
    shapes = measure_shapes(tmp_path)
    assert shapes["guess"].turns == 3 and shapes["guess"].prompt_tokens == 11
    assert shapes["guess"].response_tokens == 3 and shapes["guess"].obs_tokens == 4
    assert shapes["gridnav"].turns == 1 and shapes["gridnav"].response_tokens == 4
    # every trajectory's own length and generation per turn, for the simulator to draw
    assert sorted(shapes["guess"].episodes) == [(3, 2.0), (3, 4.0)]
    assert shapes["gridnav"].episodes == ((1, 4.0),)


# -- the paper's experiments (rollart.sim.paper) ---------------------------------------------
def _gpus(cfg):
    return {p.tag: (p.gpu, p.count, p.tp) for p in cfg.cluster.inference}


def test_paper_experiments_use_the_papers_clusters():
    from rollart.sim import paper

    exps = {e.key: e for e in paper.experiments(quick=False)}
    aff = exps["affinity_vs_h20"].configs
    assert _gpus(aff["Qwen3-32B/hetero"]) == {"H800": ("H800", 64, 4), "H20": ("H20", 24, 4)}
    assert _gpus(aff["Qwen3-8B/H20"]) == {"H20": ("H20", 208, 1)}
    assert _gpus(aff["Qwen3-14B/H800"]) == {"H800": ("H800", 72, 2)}
    routes = {t.name: t.affinity.pools for t in aff["Qwen3-8B/hetero"].graph.tasks}
    assert routes == {"swe": ("H800",), "web": ("H800",), "reason": ("H20",),
                      "game": ("H20",)}
    modes = exps["async_vs_sync"].configs
    assert {c.run_mode for c in modes.values()} == {"sync", "sync+", "async"}
    alphas = {c.graph.algo.alpha for c in exps["alpha_gain"].configs.values()}
    assert alphas == {1, 2, 3, 4, 5, 6}
    pd_cfg = exps["pd_gain"].configs
    assert _gpus(pd_cfg["1P3D/pd"]) == {"P": ("H800", 8, 1), "D": ("H800", 24, 1)}
    assert _gpus(pd_cfg["2P2D/colo"]) == {"H800": ("H800", 32, 1)}
    assert pd_cfg["2P2D/pd"].graph.tasks[0].affinity.prefill == "P"
    kinds = {c.cluster.reward.kind for c in exps["serverless_util"].configs.values()}
    assert kinds == {"dedicated", "elastic"}


def test_scale_configuration_is_3000_gpus_at_one_to_five():
    from rollart.sim import paper

    cfg = paper.scale_config(quick=False)
    gen = sum(p.count for p in cfg.cluster.inference)
    assert cfg.cluster.gpus == 3000 and gen == 5 * cfg.cluster.trainer_gpus
    assert cfg.graph.algo.alpha == 1 and cfg.cluster.env[0].slots >= 10000


def test_mooncake_pull_from_the_stated_rates():
    from rollart.sim import paper

    pulls = paper.mooncake_pull()
    for name, params in (("Qwen3-8B", 8.2e9), ("Qwen3-32B", 32.8e9)):
        assert pulls[name] == pytest.approx(0.05 + params * 2 / 12.5e9 + params * 2 / 4e12)


def _tiny_experiment():
    """Async vs sync on 4 H20 (two tasks, 4 groups, 2 steps): ``(experiment, configs)``."""
    from rollart.sim import paper

    tasks = [paper._task(t, None) for t in ("game", "reason")]
    cluster = paper._cluster({"H20": ("H20", 4)}, trainer_gpus=4, env_slots=64)
    configs = {f"x/{m}": paper._config(cluster, paper._graph(tasks, ("H20",), groups=4),
                                       "Qwen3-8B", steps=2, mode=m)
               for m in ("sync", "async")}
    return paper.Experiment("tiny", "tiny async vs sync", (1.0, 2.0), configs,
                            paper._Ratio("async", "sync")), configs


def test_a_tiny_experiment_runs_through_the_simulator():
    """The figure is the ratio of the two simulated throughputs, in the table."""
    from rollart.sim import paper, simulate

    exp, configs = _tiny_experiment()
    out = paper.run(exp)
    again = {k: simulate(c) for k, c in configs.items()}
    ratio = again["x/async"].throughput["trajectories_s"] / \
        again["x/sync"].throughput["trajectories_s"]
    assert out["values"] == {"x": pytest.approx(ratio)}  # deterministic per seed
    assert out["sim"] == (pytest.approx(ratio), pytest.approx(ratio))
    assert "| tiny async vs sync |" in paper.table({"tiny": out})


def test_engine_and_trainer_measured_into_laptop_costs():
    """The micro-benchmark's fit: positive finite rates, the bundle the laptop's
    simulated pools read (every inference tag on the CPU)."""
    from rollart.sim.measure import measure_engine

    fit = measure_engine(batches=(1, 8), new=4, repeats=1)
    assert set(fit.decode_points) == {1, 8} and all(t > 0 for t in fit.decode_points.values())
    costs = fit.costs()
    gen = costs.gen_for("cpu", 1, tag="H800")
    assert gen is fit.gen and gen.model.name == "tiny"
    for v in (gen.decode_step_s(8, 8 * 50), gen.prefill_s(96, rows=2),
              costs.train_for("cpu", 1).step_s(5000), fit.weights.pull_s(gen.model)):
        assert math.isfinite(v) and v > 0
    assert costs.env_for(None).name == "laptop" and fit.reward_s > 0


def test_in_situ_trainer_overhead_from_probe_metrics():
    """The probe's trainer step beside rollout (first step left out) less the FLOP part
    of the fitted rate at the shapes' tokens becomes the per-step overhead."""
    from rollart.sim.measure import EngineFit, in_situ_trainer
    from rollart.sim.config import TaskShape

    cpu = GPUSpec("cpu", 1e10, 1e10, 1e9)
    train = TrainCost(MODELS["tiny"], cpu, gpus=1, mfu=1.0, overhead_s=0.05)
    fit = EngineFit(cpu, GenCost(MODELS["tiny"], cpu), train, WeightSync("tcp"), 1e-6,
                    {}, {}, {}, 0.0)
    rows = [{"trainer/step_s": 9.0, "trainer/wait_s": 0.0},  # start-up: left out
            {"trainer/step_s": 2.5, "trainer/wait_s": 0.5},
            {"trainer/step_s": 3.0, "trainer/wait_s": 0.2},
            {"trainer/step_s": 2.4, "trainer/wait_s": 0.1}]
    shapes = {"a": TaskShape(turns=3, prompt_tokens=20, obs_tokens=10, response_tokens=2),
              "b": TaskShape(turns=1, prompt_tokens=30, obs_tokens=0, response_tokens=4)}
    tokens = 96 * ((20 + 6 + 20) + 34) / 2
    flops_part = 6 * MODELS["tiny"].params * int(tokens) / 1e10
    out = in_situ_trainer(fit, rows, shapes, batch_size=96)
    assert out.train.overhead_s == pytest.approx(2.3 - flops_part)  # median of 2.0 2.8 2.3
    assert out.gen is fit.gen and fit.train.overhead_s == 0.05  # a copy


class _FirstSleeps:
    """gridnav whose first instance (since ``made.clear()``) takes 1 s a step: the
    straggler a redundant group cancels in the middle of its env step."""

    made: list = []

    def __new__(cls):
        from rollart.env.builtin.gridnav import GridNavEnv

        env = GridNavEnv()
        first = not cls.made
        cls.made.append(env)
        if first:
            step = env.step

            def slow(action):
                import time

                time.sleep(1.0)
                return step(action)

            env.step = slow
        return env


def test_turn_overhead_leaves_out_the_generation_of_a_cancelled_turn(local_cluster,
                                                                     tiny_model, tmp_path,
                                                                     rollout_actors):
    """``rollout/turn_overhead_s`` (what ``measure_turn_overhead`` reads) is a completed
    turn's wall time less its generation and env time. A redundant member cancelled in
    its env step after its generation has no completed turn, so its generation must not
    count either: it did (the metric came out negative in async runs)."""
    from rollart.env.tasks import Task
    from rollart.reward import success_reward

    mgr, _, _ = rollout_actors(local_cluster, tiny_model, tmp_path / "weights", "overhead")
    _FirstSleeps.made.clear()
    task = Task(name="overhead", env_factory=_FirstSleeps, reward_fn=success_reward,
                max_turns=1)
    mgr.run_group(task, 5, "overhead", 1, redundancy=2.0).result()
    stats = mgr.stats().result()
    assert stats["cancelled"] == 1 and stats["turns"] == 1  # the straggler's never ended
    assert stats["turn_overhead_s"] >= 0.0, stats["turn_overhead_s"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_in_situ_engine_cost_is_per_admitted_request_on_the_modes_fit(mode):
    """The probe's engine busy seconds per admitted request (``rollout/requests``) less
    the simulator's for the same probe becomes ``request_overhead_s`` on the fit that
    mode uses; simulating the probe again with it gives the probe's cost per admitted
    request (async: 1.5x members, so requests and completed turns differ)."""
    from dataclasses import replace as _replace

    import rollart
    from rollart.sim import simulate
    from rollart.sim.calibrate import in_situ_engine, laptop_sim_config
    from rollart.sim.config import TaskShape
    from rollart.sim.measure import EngineFit

    cpu = GPUSpec("cpu", 1e10, 1e10, 1e9)
    fit = EngineFit(cpu, GenCost(MODELS["tiny"], cpu, step_overhead_s=1e-3),
                    TrainCost(MODELS["tiny"], cpu, gpus=1, mfu=1.0, overhead_s=0.5),
                    WeightSync("tcp"), 1e-4, {}, {}, {}, 0.0)
    fits = {"lockstep": fit, "overlapping": fit}
    base, _ = rollart.load_graph("multitask")
    probe = _replace(base, mode=mode, steps=3,
                     rollout=_replace(base.rollout, inference_pools=("H800",),
                                      redundancy=1.5 if mode == "async" else 1.0))
    shapes = {t.name: TaskShape(turns=4, prompt_tokens=20, obs_tokens=10,
                                response_tokens=3) for t in probe.tasks}
    cp = ControlPlane(actor_call_s=1e-3, task_s=5e-3)
    rows = [{"rollout/engine_busy_s": 30.0, "rollout/requests": 3000,
             "rollout/turns": 2500}] * 3  # 10 ms a request
    out = in_situ_engine(fits, cp, shapes, 0.0, probe, rows)
    key, other = ("overlapping", "lockstep") if mode == "async" else \
        ("lockstep", "overlapping")
    assert out[key].gen.request_overhead_s > 0 and out[other] is fit
    again = simulate(laptop_sim_config(probe, out, cp, shapes, 3, mode, probe.seed))
    x = again.extra
    per_request = (x["engine_busy_s"] + x["engine_stalled_s"]) / x["requests"]
    assert per_request == pytest.approx(0.010, rel=0.05)
    with pytest.raises(KeyError, match="rollout/requests"):
        in_situ_engine(fits, cp, shapes, 0.0, probe, [{"rollout/engine_busy_s": 1.0,
                                                        "rollout/turns": 10}])


def test_roofline_diagnostics_by_hand():
    """``trajectory_gpu_s``: a two-turn trajectory's prefills (the prompt, then the
    observation and the last generated token after the cached rest; all of the previous
    output when it was decoded elsewhere) and its tokens' shares of decode steps;
    ``saturated``: GPUs over the slowest pool's worker-seconds, prefill and decode on
    their own pools with PD; ``gpu_bound``: the same configs with instant envs."""
    from dataclasses import replace

    from rollart.sim import diagnose, paper
    from rollart.sim.config import TaskShape

    gen = GenCost(MODELS["Qwen3-8B"], GPUS["H800"])
    shape = TaskShape(turns=2, prompt_tokens=100, obs_tokens=10, response_tokens=3)
    pre = gen.prefill_s(100) + gen.prefill_s(11, 102)
    dec = sum(gen.decode_step_s(2, 2 * c) / 2 for c in (100, 101, 102, 113, 114, 115))
    assert diagnose.trajectory_gpu_s(shape, gen, 2) == pytest.approx((pre, dec))
    apart = gen.prefill_s(100) + gen.prefill_s(13, 100)
    assert diagnose.trajectory_gpu_s(shape, gen, 2, outputs_cached=False)[0] == \
        pytest.approx(apart)
    shapes = {"t": shape}
    one = diagnose.saturated({"A": ("H800", 8)}, {"t": "A"}, "Qwen3-8B", 16, shapes)
    assert one == pytest.approx(8 / (pre + dec))
    split = diagnose.saturated({"P": ("H800", 4), "D": ("H800", 4)}, {}, "Qwen3-8B", 16,
                               shapes, split={"t": ("P", "D")})
    dec4 = diagnose.trajectory_gpu_s(shape, gen, 4)[1]
    assert split == pytest.approx(1 / max(apart / 4, dec4 / 4))
    exp = paper.pd(quick=True, steps=1)[0]
    for slots in (None, 3):
        diag = diagnose.gpu_bound(exp, slots)
        for label, cfg in diag.configs.items():
            base = exp.configs[label]
            assert cfg.costs.env_for(None) is diagnose.INSTANT_ENV
            assert cfg.costs.env_for("sandbox") is diagnose.INSTANT_ENV
            assert {k: replace(v, env=None) for k, v in base.shapes.items()} == cfg.shapes
            assert cfg.cluster == base.cluster and cfg.graph == base.graph
            assert cfg.slot_capacity == (slots and slots * base.graph.algo.groups_per_step)


def test_cpu_stretch_from_schedstat_and_costs_scaled_by_it():
    """``stretch``: (run + wait) / run over the threads alive at the second reading (one
    begun in between counts from zero, one that ended is lost); the kernel's counters of this
    process grow with a busy loop; ``scaled``: every CPU cost of the laptop ``k`` times
    as long (engine, trainer, weight store, reward, control plane, env manager's turn),
    nothing for a ratio that is not a number."""
    import sys

    from rollart.sim import contention
    from rollart.sim.measure import EngineFit

    before = {(1, 1): (1.0, 0.5), (1, 2): (2.0, 0.0), (1, 3): (9.0, 9.0)}
    after = {(1, 1): (3.0, 1.5), (1, 2): (4.0, 1.0), (1, 4): (5.0, 5.0)}
    assert contention.stretch(before, after) == pytest.approx((9 + 7) / 9)
    assert contention.stretch(after, after) != contention.stretch(after, after)  # none ran
    if sys.platform.startswith("linux"):
        t0 = contention.thread_clocks()
        sum(i * i for i in range(300_000))
        t1 = contention.thread_clocks()
        key = next(k for k in t1 if k in t0 and t1[k][0] > t0[k][0])
        assert contention.stretch(t0, t1) >= 1.0 and key[0] > 0
    cpu = GPUSpec("cpu", 1e10, 1e10, 1e9)
    fit = EngineFit(cpu, GenCost(MODELS["tiny"], cpu, step_overhead_s=1e-3,
                                 row_overhead_s=1e-4, prefill_token_overhead_s=1e-5,
                                 request_overhead_s=2e-3),
                    TrainCost(MODELS["tiny"], cpu, gpus=1, mfu=1.0, overhead_s=0.5),
                    WeightSync("tcp", tcp_bytes_s=1e8, latency_s=0.01), 1e-4, {}, {}, {}, 0.0)
    cp = ControlPlane(actor_call_s=1e-3, task_s=5e-3, scheduler_tasks_s=400.0)
    fit2, cp2, turn2 = contention.scaled(fit, cp, 4e-4, 1.5)  # both processes alike
    assert fit2.gen.decode_step_s(8, 400) == pytest.approx(1.5 * fit.gen.decode_step_s(8, 400))
    assert fit2.gen.prefill_batch_s([(50, 10)] * 3) + fit2.gen.request_overhead_s == \
        pytest.approx(1.5 * (fit.gen.prefill_batch_s([(50, 10)] * 3) + 2e-3))
    assert fit2.train.step_s(5000) == pytest.approx(1.5 * fit.train.step_s(5000))
    assert fit2.weights.pull_s(MODELS["tiny"]) == pytest.approx(
        1.5 * fit.weights.pull_s(MODELS["tiny"]))
    assert (fit2.reward_s, cp2.actor_call_s, cp2.task_s, cp2.scheduler_tasks_s, turn2) == \
        pytest.approx((1.5e-4, 1.5e-3, 7.5e-3, 400 / 1.5, 6e-4))
    costs = fit2.costs(cp2)
    assert costs.env_for(None) == fit.costs(cp).env_for(None)  # env latency: not CPU
    assert costs.gpus["cpu"] is fit2.gpu
    assert contention.scaled(fit, cp, 4e-4, float("nan")) == (fit, cp, 4e-4)
    rollout, _, _ = contention.scaled(fit, cp, 4e-4, 2.0, float("nan"))  # trainer as is
    assert rollout.train == fit.train and rollout.weights == fit.weights
    assert rollout.gen.request_overhead_s == pytest.approx(4e-3)
    trainer, cp3, turn3 = contention.scaled(fit, cp, 4e-4, 1.0, 3.0)
    assert trainer.train.step_s(5000) == pytest.approx(3 * fit.train.step_s(5000))
    assert trainer.gen == fit.gen and (cp3, turn3) == (cp, 4e-4)
    per = contention.stretches({"a": before, "b": {}}, {"a": after, "b": after},
                               {"rollout": "a", "trainer": "b", "lost": "c"})
    assert per["rollout"] == pytest.approx(16 / 9) and per["trainer"] == pytest.approx(
        (3 + 4 + 5 + 1.5 + 1 + 5) / (3 + 4 + 5))  # b's threads all new
    assert math.isnan(per["lost"])


def test_cpu_clocks_and_roles_of_a_real_laptop_cluster():
    """On ``resources/laptop.py``'s cluster: the rollout worker (``CPU_ENV``) and the
    trainer's (``TRAIN``) are told apart, and each worker process reports its threads'
    kernel clocks, which a task's busy loop on the rollout worker advances."""
    import sys

    from distributed import Client

    import rollart
    from rollart.sim import contention

    if not sys.platform.startswith("linux"):
        pytest.skip("schedstat is Linux's")
    res = rollart.load_resources("laptop")
    with res.make_cluster() as cluster, Client(cluster) as client:
        procs = contention.roles(client)
        assert set(procs) == {"rollout", "trainer"} and len(set(procs.values())) == 2
        before = contention.cluster_clocks(client)
        assert set(procs.values()) <= set(before) and "client" in before
        client.submit(_busy, 0.3, resources={"CPU_ENV": 1}, pure=False).result()
        after = contention.cluster_clocks(client)
        got = contention.stretches(before, after, procs)
        assert got["rollout"] >= 1.0
        # the 0.3 s of CPU the task spent there (on a thread the pool may have started
        # for it, so every thread's counter, new ones from 0)
        ran = sum(r for r, _ in after[procs["rollout"]].values()) - \
            sum(r for r, _ in before[procs["rollout"]].values())
        assert ran >= 0.25


def _busy(seconds: float) -> int:
    import time

    end, n = time.thread_time() + seconds, 0  # this thread's CPU, not the process's
    while time.thread_time() < end:
        n += 1
    return n


def test_over_seeds_is_the_ratio_of_mean_throughputs_and_the_spread_of_the_baseline():
    from dataclasses import replace
    from statistics import fmean, pstdev

    from rollart.sim import diagnose, simulate

    exp, configs = _tiny_experiment()
    got = diagnose.over_seeds(exp, seeds=(0, 1))
    t = {m: [simulate(replace(configs[f"x/{m}"], seed=s)).throughput["trajectories_s"]
             for s in (0, 1)] for m in ("sync", "async")}
    assert set(got) == {"x"} and len(set(t["sync"])) == 2  # the seeds draw differently
    assert got["x"] == pytest.approx((fmean(t["async"]) / fmean(t["sync"]),
                                      pstdev(t["sync"]) / fmean(t["sync"])))


def test_scale_prefill_changes_only_the_prefill_heavy_prompts_and_observations():
    """``scale_prefill`` / ``with_shapes``: the prefill-heavy tasks' prompt and
    observation tokens ×factor, every other field of every shape and every other field
    of every config (cluster, costs, graph and routing, seed, steps, slots) unchanged."""
    from dataclasses import fields, replace

    from rollart.sim import diagnose, paper

    for factor in (0.5, 4):
        got = diagnose.scale_prefill(paper.SHAPES, factor)
        assert set(got) == set(paper.SHAPES)
        for task, shape in paper.SHAPES.items():
            if task not in paper.PREFILL_HEAVY:
                assert got[task] is shape
                continue
            assert got[task].prompt_tokens == round(shape.prompt_tokens * factor)
            assert got[task].obs_tokens == round(shape.obs_tokens * factor)
            assert replace(got[task], prompt_tokens=shape.prompt_tokens,
                           obs_tokens=shape.obs_tokens) == shape
        for exp in paper.affinity(True)[:1] + paper.pd(True):
            scaled = diagnose.with_shapes(exp, factor)
            assert scaled.configs.keys() == exp.configs.keys()
            for label, cfg in scaled.configs.items():
                base = exp.configs[label]
                assert cfg.shapes == diagnose.scale_prefill(base.shapes, factor)
                for f in fields(base):
                    if f.name != "shapes":
                        assert getattr(cfg, f.name) is getattr(base, f.name), f.name
    assert diagnose.scale_prefill(paper.SHAPES, 1) == paper.SHAPES


def test_crossover_is_the_first_crossing_linearly_interpolated():
    from rollart.sim.diagnose import crossover

    xs = [0.1, 0.2, 0.4, 0.5, 0.6]
    ys = [0.5, 1.0, 2.0, 0.5, 3.0]
    assert crossover(xs, ys, 1.5) == pytest.approx(0.3)  # between 0.2 and 0.4, not 0.6
    assert crossover(xs, ys, 1.0) == pytest.approx(0.2)  # reached exactly at a point
    assert crossover(xs, ys, 0.75) == pytest.approx(0.15)
    assert crossover(xs, ys, 0.4) == 0.1  # there at the first point already
    assert crossover(xs, ys, 3.5) == math.inf  # never in the range
    assert crossover(xs, ys, 2.5) == pytest.approx(0.5 + 0.1 * 2 / 2.5)  # after the dip


def test_prefill_share_sweep_affinity_rises_with_the_share_and_its_crossover():
    """The sweep at saturation (no simulation): the swe + web prefill share on H20 and
    hetero's gain over 208 H20 both rise with the factor; each crossover is the linear
    interpolation between the two sweep points around the paper's lower bound (the
    first one above it), and ``prefill_share`` is prefill ÷ (prefill + decode) of
    ``trajectory_gpu_s``."""
    from rollart.sim import diagnose, paper

    factors = (0.5, 1, 2, 4, 8, 16)
    sweep = diagnose.prefill_share_sweep(factors, models=("Qwen3-8B",), sim_factors=())
    rows = sweep["rows"]
    assert [r["factor"] for r in rows] == list(factors) and sweep["sim"] == {}
    shares = [r["share"] for r in rows]
    gains = [r["affinity_vs_h20"] for r in rows]
    assert all(a < b for a, b in zip(shares, shares[1:]))
    assert all(a < b for a, b in zip(gains, gains[1:]))
    assert gains[0] < diagnose.PAPER_LOW["affinity_vs_h20"] < gains[-1]
    for key, low in (("affinity_vs_h20", 1.30), ("affinity_vs_h800", 1.12),
                     ("pd_1P3D", 1.03)):
        ys = [r[key] for r in rows]
        i = next(i for i, y in enumerate(ys) if y >= low)
        assert i > 0 and ys[i - 1] < low
        want = shares[i - 1] + (shares[i] - shares[i - 1]) * (low - ys[i - 1]) / \
            (ys[i] - ys[i - 1])
        got = sweep["crossover"][f"saturated/{key}/Qwen3-8B"]
        assert got == pytest.approx(want) and shares[i - 1] < got <= shares[i]
    assert sweep["crossover"]["saturated/pd_2P2D/Qwen3-8B"] == math.inf \
        or max(r["pd_2P2D"] for r in rows) >= 1.03
    one = diagnose.saturated_gains(paper.SHAPES, "Qwen3-8B")
    assert rows[1]["affinity_vs_h20"] == one["affinity_vs_h20"]
    gen = paper._costs("Qwen3-8B").gen_for("H20", 1)
    parts = [diagnose.trajectory_gpu_s(paper.SHAPES[t], gen, 16) for t in ("swe", "web")]
    pre = sum(p for p, _ in parts)
    assert rows[1]["share"] == pytest.approx(pre / sum(p + d for p, d in parts))


def test_trained_tasks_counts_the_trained_groups_by_their_task():
    from rollart.policy.admission import GroupSequence
    from rollart.sim import diagnose, simulate

    _, configs = _tiny_experiment()
    cfg = configs["x/async"]
    r = simulate(cfg)
    got = diagnose.trained_tasks(cfg, r)
    taken = [i for step in r.extra["trained_groups"] for i in step]
    assert sum(got.values()) == len(taken) > 0
    g = cfg.graph
    seq = GroupSequence(g.tasks, g.task_weights, g.seed + cfg.seed, g.algo.group_size)
    names = [seq.next()[0].name for _ in range(max(taken) + 1)]
    assert got == {t: sum(names[i] == t for i in taken) for t in set(names[i] for i in taken)}
