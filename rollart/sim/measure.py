"""Micro-benchmarks of this machine for the simulator: what each cost model of
``rollart.sim.costs`` is on this laptop.

Consumes a Dask client (control plane), the built-in tiny model, the default graph and a
probe run's Parquet and metrics; produces ``ControlPlane``, an ``EngineFit`` (the
``cpu`` ``GPUSpec`` with a fitted ``GenCost``, a ``TrainCost``, a ``WeightSync``, the
reward call), the tasks' ``TaskShape``, the trainer's step beside rollout and the env
manager's per-turn loop time.
Called by ``rollart.sim.calibrate`` (which then checks the simulator against real runs)
and tests.

``measure_control_plane`` and ``measure_engine`` are micro-benchmarks (an actor ping, a
task, the engine at fixed batch sizes, trainer updates, alone: the shape of each cost).
``measure_shapes``, ``in_situ_trainer`` and ``measure_turn_overhead`` read a short probe
run on other seeds than the runs predicted; what a mode adds on this shared machine (the
trainer beside rollout, the rollout processes' nice value) comes from that probe
(``rollart.sim.calibrate.in_situ_engine``), not from a micro-benchmark under a
synthetic load, whose points swung 10x against each other under the other agents' load
(15:49, load average 13).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rollart.chaos.faults import Latency
from rollart.sim.costs import (GPUS, ControlPlane, Costs, GenCost, GPUSpec, ModelSpec,
                               RewardCost, TrainCost, WeightSync, laptop_env)

__all__ = ["EngineFit", "in_situ_trainer", "measure_control_plane", "measure_engine",
           "measure_shapes", "measure_turn_overhead"]

BATCHES = (1, 4, 16, 64)


# -- (a) the Dask control plane ------------------------------------------------------------
class _Echo:
    """A trivial actor: its method round trip is the actor-call cost."""

    def ping(self, x=None):
        return x


def _noop(x=None):
    return x


def measure_control_plane(client, n: int = 200, burst: int = 400) -> ControlPlane:
    """Per-message costs on ``client``'s cluster, medians of ``n`` calls each: an actor
    method round trip from the client, a scheduler task round trip (``submit`` →
    ``result``), and the scheduler's capacity: ``burst`` tasks submitted at once over
    the time to finish them all."""
    actor = client.submit(_Echo, actor=True, pure=False).result()
    for _ in range(5):
        actor.ping().result()
    actor_s = _median_time(lambda: actor.ping(1).result(), n)
    for i in range(5):
        client.submit(_noop, i, pure=False).result()
    task_s = _median_time(lambda: client.submit(_noop, 1, pure=False).result(), n // 2)
    t0 = time.perf_counter()
    futures = client.map(_noop, range(burst), pure=False)
    client.gather(futures)
    capacity = burst / (time.perf_counter() - t0)
    return ControlPlane(actor_call_s=actor_s, task_s=task_s, scheduler_tasks_s=capacity)


def _median_time(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _episode(task):
    """A short played episode of ``task`` (its warm-up action at each turn)."""
    import random

    from rollart.types import Episode

    env, rng = task.env_factory(), random.Random(0)
    obs = env.reset(0)
    observations, actions, rewards, info = [obs], [], [], {}
    for _ in range(task.max_turns):
        action = task.warmup_action(rng, obs) if task.warmup_action else "stop"
        out = env.step(action)
        actions.append(action)
        observations.append(out.observation)
        rewards.append(out.reward)
        obs, info = out.observation, out.info
        if out.done:
            break
    return Episode(task.name, 0, observations, actions, rewards, info)


# -- (b) the CPU engine and trainer ----------------------------------------------------------
@dataclass(frozen=True)
class EngineFit:
    """What ``measure_engine`` found: the fitted costs and the points they came from."""

    gpu: GPUSpec
    gen: GenCost
    train: TrainCost
    weights: WeightSync
    reward_s: float
    decode_points: dict  # batch -> measured seconds per decode step
    prefill_points: dict  # (rows, tokens per row) -> measured seconds
    train_points: dict  # tokens -> measured seconds per trainer step
    fit_error: float  # largest relative error of the fit on its own points

    def costs(self, control: ControlPlane | None = None) -> Costs:
        """The laptop as a ``Costs`` bundle (the inference tags all map to the CPU)."""
        gpus = {**GPUS, "cpu": self.gpu}
        return Costs(model=self.gen.model, gpus=gpus, gen={"cpu": self.gen},
                     env={"*": laptop_env()},
                     reward=RewardCost(call=Latency("fixed", seconds=self.reward_s),
                                       workers=1),
                     train=self.train, weights=self.weights,
                     control=control or ControlPlane())


def _tiny_spec(model) -> ModelSpec:
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    params = sum(p.numel() for p in model.parameters())
    return ModelSpec("tiny", float(params), int(cfg.num_hidden_layers), int(cfg.hidden_size),
                     int(cfg.num_key_value_heads), head_dim, bytes_per_param=4.0,
                     q_heads=heads)


def _cpu_peaks() -> GPUSpec:
    """This CPU's matmul FLOP/s (one thread, fp32) and copy bandwidth of a buffer the
    size of the tiny model's weights (they stay in cache): the roofline's floor under
    the measured overheads (which dominate: the tiny model is bound by Python)."""
    import torch

    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    flops = 50 * 2 * 256 ** 3 / (time.perf_counter() - t0)
    x = torch.empty(1 << 19)
    t0 = time.perf_counter()
    for _ in range(50):
        x.clone()
    bw = 50 * 2 * x.numel() * 4 / (time.perf_counter() - t0)
    return GPUSpec("cpu", flops, bw, 8e9)


def _gen_time(engine, rows: int, prompt: int, new: int, vocab: int) -> float:
    from rollart.types import GenRequest

    reqs = [GenRequest(prompt_ids=[(7 * i + j) % (vocab - 1) + 1 for j in range(prompt)],
                       max_new_tokens=new, seed=i) for i in range(rows)]
    t0 = time.perf_counter()
    engine.generate(reqs)
    return time.perf_counter() - t0


def _linear_fit(xs, ys) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def measure_engine(batches=BATCHES, prompt: int = 48, new: int = 24, repeats: int = 3,
                   workdir: str | None = None) -> EngineFit:
    """The torch engine's decode step and prefill times for the built-in tiny model at
    fixed batch sizes (one thread, as ``InferenceWorker`` runs it), fitted as
    ``GenCost`` overheads on the CPU's roofline; trainer updates (GRPO on a batch of the
    default graph's size, KL reference included, then the weight put) at two lengths,
    fitted as ``TrainCost``; a weight put + get through the file store. Alone: nothing
    else of rollart's runs meanwhile."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = _build_model(Path(tmp))
        from rollart.rollout.engine import TorchEngine

        engine = TorchEngine(path, max_batch=max(batches), prefix_cache=0)
        spec = _tiny_spec(engine.model)
        gpu = _cpu_peaks()
        decode, prefill = _engine_points(engine, batches, prompt, new, repeats)
        gen = _fit_gen(spec, gpu, decode, prefill, prompt + new / 2)
        train, train_points = _measure_trainer(path, spec, gpu, Path(tmp))
        weights = _measure_weights(engine, Path(tmp))
        reward_s = _measure_reward()
    ctx = prompt + new / 2
    errors = [abs(gen.decode_step_s(b, b * ctx) - t) / t for b, t in decode.items()]
    errors += [abs(gen.prefill_batch_s([(n, 0)] * r) - t) / t for (r, n), t in prefill.items()]
    errors += [abs(train.step_s(n) - t) / t for n, t in train_points.items()]
    return EngineFit(gpu, gen, train, weights, reward_s, decode, prefill, train_points,
                     max(errors))


def _engine_points(engine, batches, prompt: int, new: int, repeats: int):
    """Seconds per decode step by batch, and per prefill (rows, tokens): medians."""
    vocab = engine.vocab_size
    _gen_time(engine, 2, prompt, 4, vocab)  # warm
    decode, prefill = {}, {}
    for b in batches:
        short = statistics.median(_gen_time(engine, b, prompt, 1, vocab)
                                  for _ in range(repeats))
        long = statistics.median(_gen_time(engine, b, prompt, new + 1, vocab)
                                 for _ in range(repeats))
        decode[b] = max(long - short, 1e-9) / new
        prefill[(b, prompt)] = short
    return decode, prefill


def _fit_gen(spec: ModelSpec, gpu: GPUSpec, decode: dict, prefill: dict,
             ctx: float) -> GenCost:
    """Overheads over the roofline: per decode step and per row (least squares on what
    the roofline leaves), then per prefill token (through 0, on what that leaves)."""
    roof = GenCost(spec, gpu, mfu=1.0, mbu=1.0)
    resid = {b: t - roof.decode_step_s(b, b * ctx) for b, t in decode.items()}
    step, row = (max(0.0, v) for v in _linear_fit(list(resid), list(resid.values())))
    base = GenCost(spec, gpu, mfu=1.0, mbu=1.0, step_overhead_s=step, row_overhead_s=row)
    left = {(r, n): t - base.prefill_batch_s([(n, 0)] * r) for (r, n), t in prefill.items()}
    per_token = max(0.0, sum(v * r * n for (r, n), v in left.items())
                    / sum((r * n) ** 2 for r, n in left))
    return replace(base, prefill_token_overhead_s=per_token)


def _build_model(tmp: Path) -> str:
    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model

    return build_tiny_model(str(tmp / "tiny"), task_corpus(list(BUILTIN_TASKS)))


def _batch(n_traj: int, prompt: int, response: int, group: int, vocab: int):
    from rollart.types import Trajectory

    out = []
    for i in range(n_traj):
        ids = [(3 * i + j) % (vocab - 1) + 1 for j in range(prompt + response)]
        mask = [j % 2 for j in range(response)]
        out.append(Trajectory(f"t{i}", "gridnav", f"g{i // group}", i // group,
                              ids[:prompt], ids[prompt:], mask,
                              [-1.0 * m for m in mask], [0 if m else -1 for m in mask],
                              reward=float(i % 3 == 0), num_turns=4))
    return out


def _measure_trainer(path: str, spec: ModelSpec, gpu: GPUSpec, tmp: Path,
                     lengths=(24, 72), repeats: int = 3):
    """Seconds per trainer step (``Trainer._update`` with the KL reference, then the
    weight put) on a batch of the default graph's size at two trajectory lengths →
    ``TrainCost``: the slope is the 6·params·tokens rate (an effective FLOP/s at MFU 1),
    the intercept the per-step overhead."""
    import rollart
    from rollart.trainer import Trainer

    graph, _ = rollart.load_graph("multitask")
    algo = graph.algo
    trainer = Trainer(path, str(tmp / "train-weights"), algo, seed=0, threads=1)
    trainer.ref_model = trainer._frozen_copy().eval()
    vocab = trainer.model.config.vocab_size
    points = {}
    for n in lengths:
        batch = _batch(algo.batch_size, n // 3, n - n // 3, algo.group_size, vocab)
        tokens = algo.batch_size * n
        trainer._update(batch)  # warm (allocations, optimizer state)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer._update(batch)
            trainer.version += 1
            trainer._put_weights()
            times.append(time.perf_counter() - t0)
        points[tokens] = statistics.median(times)
    a, b = _linear_fit(list(points), list(points.values()))
    flops = 6 * spec.params / b if b > 0 else gpu.flops
    train_gpu = GPUSpec("cpu-train", flops, gpu.hbm_bytes_s, gpu.mem_bytes)
    return TrainCost(spec, train_gpu, gpus=1, mfu=1.0, overhead_s=max(0.0, a)), points


def _measure_weights(engine, tmp: Path) -> WeightSync:
    """One put + get of the engine's weights through the file store: latency + rate."""
    from rollart.weights.store import WeightStore

    store = WeightStore(f"file://{tmp / 'weights'}")
    sd = engine.state_dict()
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    t0 = time.perf_counter()
    store.put(0, sd)
    t1 = time.perf_counter()
    store.get(0)
    t2 = time.perf_counter()
    rate = nbytes / max(t2 - t1, 1e-6)
    return WeightSync(transport="tcp", tcp_bytes_s=rate, latency_s=t1 - t0, prefetch=True)


def _measure_reward() -> float:
    """Median seconds of the built-in tasks' reward functions on a finished episode."""
    from rollart.env.tasks import BUILTIN_TASKS, get_task

    times = []
    for name in BUILTIN_TASKS:
        task = get_task(name)
        ep = _episode(task)
        for _ in range(50):
            t0 = time.perf_counter()
            task.reward_fn(ep)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- the workload's shape, from a probe run ------------------------------------------------
def measure_shapes(run_dir) -> dict:
    """Per task a ``rollart.sim.config.TaskShape`` from a run's Parquet samples: mean
    turns (rounded), first-prompt tokens, generated tokens per turn, observation tokens
    per later turn, and every trajectory's ``(turns, generated tokens per turn)`` as
    ``episodes`` (the simulator draws one per member) — trajectories that reached the
    buffer (so a run without redundancy gives them unselected: with redundant members
    the fastest are kept and the long episodes cancelled)."""
    import pyarrow.parquet as pq

    from rollart.sim.config import TaskShape

    files = sorted(Path(run_dir, "samples").glob("**/*.parquet"))
    if not files:
        raise FileNotFoundError(f"{run_dir}/samples holds no Parquet files: run a few "
                                "steps first (rollart.train(..., run_dir=...))")
    rows: dict[str, list] = {}
    for f in files:
        for r in pq.read_table(f, columns=["task", "prompt_ids", "response_ids",
                                           "loss_mask", "num_turns"]).to_pylist():
            if r["num_turns"] > 0:
                rows.setdefault(r["task"], []).append(r)
    shapes = {}
    for task, rs in rows.items():
        turns = statistics.fmean(r["num_turns"] for r in rs)
        gen = statistics.fmean(sum(r["loss_mask"]) / r["num_turns"] for r in rs)
        obs = statistics.fmean((len(r["response_ids"]) - sum(r["loss_mask"]))
                               / max(1, r["num_turns"] - 1) for r in rs)
        prompt = statistics.fmean(len(r["prompt_ids"]) for r in rs)
        episodes = tuple((int(r["num_turns"]), sum(r["loss_mask"]) / r["num_turns"])
                         for r in rs)
        shapes[task] = TaskShape(turns=max(1, round(turns)), prompt_tokens=round(prompt),
                                 obs_tokens=round(obs), response_tokens=max(1, round(gen)),
                                 episodes=episodes)
    return shapes


def measure_turn_overhead(rows: list[dict]) -> float:
    """The env manager's per-turn loop time from a probe run's metrics: its last row's
    ``rollout/turn_overhead_s`` (every turn's wall time less its generation and env
    time, averaged over the run's turns: the manager's Python — prompt building,
    tokenising the generation and the observation, bookkeeping — as it ran on the
    manager's one event loop, waits for that loop and for the process's GIL
    included)."""
    if not rows or "rollout/turn_overhead_s" not in rows[-1]:
        raise KeyError("the probe run's metrics have no rollout/turn_overhead_s: run it "
                       "with the env managers' stats (rollart.train reports them per step)")
    return float(rows[-1]["rollout/turn_overhead_s"])


def in_situ_trainer(fit: EngineFit, rows: list[dict], shapes: dict,
                    batch_size: int) -> EngineFit:
    """``fit`` with the trainer's per-step overhead taken from a probe run's metrics:
    the median of ``trainer/step_s - trainer/wait_s`` (update, weight put, confirm,
    store gc, as the trainer actor runs them beside rollout), first step left out,
    minus the fitted FLOP part for the shapes' tokens."""
    later = rows[1:] or rows
    step = statistics.median(r["trainer/step_s"] - r["trainer/wait_s"] for r in later)
    tokens = batch_size * statistics.fmean(
        s.prompt_tokens + s.turns * s.response_tokens + (s.turns - 1) * s.obs_tokens
        for s in shapes.values())
    flops_part = fit.train.step_s(int(tokens)) - fit.train.overhead_s
    train = replace(fit.train, overhead_s=max(0.0, step - flops_part))
    return replace(fit, train=train)
