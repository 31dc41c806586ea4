"""Diagnostics of the paper's GPU-side experiments (affinity, PD): what the cost model
gives when the GPUs, not the envs, are on the critical path.

Consumes ``rollart.sim.paper``'s experiments, task shapes and cost bundles; produces
diagnostic ``Experiment`` variants (``gpu_bound``, ``diagnostics``: envs made instant,
optionally more slots; never the headline workload), the headline's figures over
several seeds (``over_seeds``: how much of one seed's figure is the draw) and roofline
figures computed from the ``GenCost`` formulas directly: one trajectory's prefill and
decode worker-seconds per GPU type (``trajectory_gpu_s``, ``roofline_table``) and the
rate a cluster sustains with its GPUs the bottleneck (``saturated``). Called by
``benchmarks/cluster_sim.py --diagnostics`` and tests.
"""

from __future__ import annotations

from dataclasses import replace

from rollart.env.faults import Latency
from rollart.sim.config import TaskShape
from rollart.sim.costs import EnvCost
from rollart.sim.paper import MODEL_TP, SHAPES, Experiment, _costs, affinity, pd

__all__ = ["INSTANT_ENV", "diagnostics", "gpu_bound", "over_seeds", "roofline_table",
           "saturated", "trajectory_gpu_s"]

INSTANT_ENV = EnvCost("instant", reset=Latency("fixed", seconds=0.01),
                      step=Latency("fixed", seconds=0.01), fail_prob=0.0, cpu_share=0.0)


def gpu_bound(exp: Experiment, slot_steps: int | None = None,
              _made: dict | None = None) -> Experiment:
    """``exp`` as a diagnostic with the env side off the critical path (not the paper's
    workload, never a headline figure): every env resets and steps in 10 ms and never
    fails, so a trajectory's time is its generation; the same tokens, routing, cluster
    and seeds. ``slot_steps``: async's groups in flight or buffered held at that many
    steps' worth (``SimConfig.slot_capacity``), so a step does not wait on its own
    slowest generation with the GPUs draining (the GPUs saturated)."""
    def variant(cfg):
        cfg = replace(cfg, costs=replace(cfg.costs, env={"*": INSTANT_ENV}),
                      shapes={k: replace(v, env=None) for k, v in cfg.shapes.items()})
        if slot_steps:
            cfg = replace(cfg, slot_capacity=slot_steps * cfg.graph.algo.groups_per_step)
        return cfg

    made = {} if _made is None else _made  # experiments sharing configs share variants
    key = (id(exp.configs), slot_steps)
    if key not in made:
        made[key] = {label: variant(c) for label, c in exp.configs.items()}
    slots = f", slots {slot_steps} steps" if slot_steps else ""
    suffix = f"_gpu_bound_slots{slot_steps}" if slot_steps else "_gpu_bound"
    return replace(exp, key=exp.key + suffix, configs=made[key],
                   title=f"{exp.title} (diagnostic: envs instant{slots})",
                   assumed=f"env reset and step 10 ms, no failures{slots}")


def diagnostics(quick: bool = True, slot_steps: int = 2) -> list[Experiment]:
    """The affinity and PD experiments with the GPUs put on the critical path
    (``gpu_bound``: envs instant; then also ``slot_steps`` steps of slots: two, what
    α = 1 needs to roll the next batch out while the trainer steps, as the α
    experiment's fixed slots; four at α = 1 aborted a quarter of the members launched,
    515 of 3,587 for the 8B hetero cluster, so GPU time went to work thrown away)."""
    out, made = [], {}
    for exp in affinity(quick) + pd(quick):
        out += [gpu_bound(exp, None, made), gpu_bound(exp, slot_steps, made)]
    return out


def trajectory_gpu_s(shape: TaskShape, gen, rows: float,
                     outputs_cached: bool = True) -> tuple[float, float]:
    """One trajectory of ``shape`` on ``gen``'s worker: (prefill, decode) worker-seconds.
    Turns and tokens at the shape's means; the sticky prefix cache as ``SimWorker`` has
    it: a later turn prefills its observation and the last generated token, or, where
    the outputs were decoded elsewhere (PD: ``outputs_cached=False``), the observation
    and the previous turn's output; each generated token a row's share of a decode step
    among ``rows`` rows of its context, ``decode_step_s(rows, rows · context) / rows``."""
    ctx, prefill, decode, rows = shape.prompt_tokens, 0.0, 0.0, max(rows, 1.0)
    for turn in range(shape.turns):
        again = 1 if outputs_cached else shape.response_tokens
        new = ctx if turn == 0 else shape.obs_tokens + again
        prefill += gen.prefill_s(new, ctx - new)
        decode += sum(gen.decode_step_s(rows, int(rows * (ctx + k)))
                      for k in range(shape.response_tokens)) / rows
        ctx += shape.response_tokens + (shape.obs_tokens if turn + 1 < shape.turns else 0)
    return prefill, decode


def saturated(pools: dict, routes: dict, model: str, in_flight: int,
              shapes: dict | None = None, split: dict | None = None) -> float:
    """Trajectories/s a cluster sustains when its GPUs are the bottleneck (a roofline
    estimate: no envs, no queueing, no weight loads): ``pools`` ``{tag: (gpu, count)}``
    (TP by the model), ``routes`` ``{task: tag}``, the tasks in equal shares; each
    pool's workers hold their tasks' share of ``in_flight`` trajectories as decode rows.
    ``split`` ``{task: (prefill tag, decode tag)}`` (PD) charges the prefill (outputs
    not cached there) to one pool and the decode to the other. The rate is the number of
    tasks over the slowest pool's worker-seconds per worker for one trajectory of each."""
    shapes, split = shapes or SHAPES, split or {}
    tp, costs = MODEL_TP[model], _costs(model)
    workers = {tag: count // tp for tag, (_, count) in pools.items()}
    share = dict.fromkeys(pools, 0.0)
    for task in shapes:
        share[split.get(task, (routes.get(task),) * 2)[1]] += in_flight / len(shapes)
    load = dict.fromkeys(pools, 0.0)
    for task, shape in shapes.items():
        p_tag, d_tag = split.get(task, (routes.get(task),) * 2)
        rows = share[d_tag] / workers[d_tag]
        pre, _ = trajectory_gpu_s(shape, costs.gen_for(pools[p_tag][0], tp), rows,
                                  outputs_cached=task not in split)
        _, dec = trajectory_gpu_s(shape, costs.gen_for(pools[d_tag][0], tp), rows)
        load[p_tag] += pre / workers[p_tag]
        load[d_tag] += dec / workers[d_tag]
    return len(shapes) / max(load.values())


def roofline_table(model: str = "Qwen3-8B", rows: int = 16) -> str:
    """Per task, one trajectory's prefill and decode worker-seconds on H800 and H20 at
    ``rows`` decode rows (``trajectory_gpu_s``), and how many times longer it takes on
    H20: the figure cost-equal affinity must beat (the paper pairs 1 H800 with ~2.9 H20)."""
    tp, costs = MODEL_TP[model], _costs(model)
    lines = [f"| task ({model}, {rows} rows) | H800 prefill + decode (s) | "
             "H20 prefill + decode (s) | H20 ÷ H800 |", "|---|---|---|---|"]
    for task, shape in SHAPES.items():
        h800 = trajectory_gpu_s(shape, costs.gen_for("H800", tp), rows)
        h20 = trajectory_gpu_s(shape, costs.gen_for("H20", tp), rows)
        lines.append(f"| {task} | {h800[0]:.2f} + {h800[1]:.2f} | {h20[0]:.2f} + "
                     f"{h20[1]:.2f} | {sum(h20) / sum(h800):.2f} |")
    return "\n".join(lines)


def over_seeds(exp: Experiment, seeds=range(5)) -> dict:
    """``exp``'s configs at each of ``seeds`` (the env draws, failures and token spreads
    change with the seed; ``exp.figure`` a ratio of two kinds of config per point, as
    affinity's and PD's are): per point, the ratio of the seeds' mean throughputs and
    the denominator config's spread over the seeds (population std / mean), as
    ``{point: (ratio, spread)}``: how much of a single-seed figure is the draw."""
    from statistics import fmean, pstdev

    from rollart.sim import simulate

    num, den = exp.figure.num, exp.figure.den
    tput = {label: [simulate(replace(cfg, seed=s)).throughput["trajectories_s"]
                    for s in seeds] for label, cfg in exp.configs.items()
            if label.rpartition("/")[2] in (num, den)}
    out = {}
    for label, values in tput.items():
        point, _, kind = label.rpartition("/")
        if kind == num and f"{point}/{den}" in tput:
            d = tput[f"{point}/{den}"]
            out[point] = (fmean(values) / fmean(d), pstdev(d) / fmean(d))
    return out
