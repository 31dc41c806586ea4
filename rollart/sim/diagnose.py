"""Diagnostics of the paper's GPU-side experiments (affinity, PD): what the cost model
gives when the GPUs, not the envs, are on the critical path.

Consumes ``rollart.sim.paper``'s experiments, task shapes and cost bundles; produces
diagnostic ``Experiment`` variants (``gpu_bound``, ``diagnostics``: envs made instant,
optionally more slots; never the headline workload), the headline's figures over
several seeds (``over_seeds``: how much of one seed's figure is the draw) and roofline
figures computed from the ``GenCost`` formulas directly: one trajectory's prefill and
decode worker-seconds per GPU type (``trajectory_gpu_s``, ``roofline_table``) and the
rate a cluster sustains with its GPUs the bottleneck (``saturated``, ``saturated_gains``);
and the isolating experiment, ``prefill_share_sweep``: the prefill-heavy tasks'
prompt and observation tokens scaled (``scale_prefill``), nothing else changed, and
the affinity and PD gains read against their prefill share (``prefill_share``), at
saturation and through the simulator with envs instant. Called by
``benchmarks/cluster_sim.py --diagnostics`` and tests.
"""

from __future__ import annotations

from dataclasses import replace

from rollart.chaos.faults import Latency
from rollart.sim.config import TaskShape
from rollart.sim.costs import EnvCost
from rollart.sim.paper import (DECODE_HEAVY, MODEL_TP, PREFILL_HEAVY, SHAPES, Experiment,
                               _costs, affinity, pd)

__all__ = ["INSTANT_ENV", "PAPER_LOW", "SWEEP_FACTORS", "crossover", "diagnostics",
           "gpu_bound", "over_seeds", "prefill_share", "prefill_share_sweep",
           "roofline_table", "saturated", "saturated_gains", "scale_prefill",
           "sweep_table", "trained_tasks", "trajectory_gpu_s", "with_shapes"]

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


# -- the isolating experiment: the prefill share of the mix, and nothing else, varied ----
SWEEP_FACTORS = (0.5, 1, 2, 4, 8, 16, 32)
PAPER_LOW = {"affinity_vs_h20": 1.30, "affinity_vs_h800": 1.12, "pd_gain": 1.03}
PD_TASKS = PREFILL_HEAVY + ("game",)  # paper.pd's mix
ROUTED = {t: "H800" for t in PREFILL_HEAVY} | {t: "H20" for t in DECODE_HEAVY}


def scale_prefill(shapes: dict, factor: float, tasks=PREFILL_HEAVY) -> dict:
    """``shapes`` with ``tasks``' prompt and observation tokens ``factor`` times as many
    (rounded; tokens generated, turns, spread, env unchanged, the other tasks as they
    are): more tokens to prefill per generated token, and longer contexts to decode in."""
    return {t: replace(s, prompt_tokens=round(s.prompt_tokens * factor),
                       obs_tokens=round(s.obs_tokens * factor)) if t in tasks else s
            for t, s in shapes.items()}


def prefill_share(shapes: dict, model: str = "Qwen3-8B", gpu: str = "H20", rows: int = 16,
                  tasks=PREFILL_HEAVY) -> float:
    """The share of prefill in one trajectory of each of ``tasks`` on one ``gpu``
    worker at ``rows`` decode rows (``trajectory_gpu_s``): prefill ÷ (prefill + decode)
    worker-seconds. For the prefill-heavy tasks on H20 it is the figure cost-equal
    affinity turns on (a task is cheaper on H800 than on ~2.9 H20 only above ~81%)."""
    gen = _costs(model).gen_for(gpu, MODEL_TP[model])
    pre = dec = 0.0
    for t in tasks:
        p, d = trajectory_gpu_s(shapes[t], gen, rows)
        pre, dec = pre + p, dec + d
    return pre / (pre + dec)


def saturated_gains(shapes: dict, model: str = "Qwen3-8B", in_flight: int = 512) -> dict:
    """The affinity and PD ratios at saturation (``saturated``) for the task ``shapes``:
    64 H800 + 24 H20 (``ROUTED``) over 208 H20 and over 72 H800 running everything;
    PD 1P3D / 2P2D of 32 H800 over the 32 colocated on ``PD_TASKS``, and PD at its best
    split of those 32 (``pd_best``, the P GPUs in ``pd_best_p``: what the fixed splits
    leave on the table; ``pd_gain`` the two splits' mean, as the RESULT line's);
    ``pd_best_same_rows``: the best split with the decode pool's workers holding as
    many decode rows each as the colocated ones (fewer in flight): PD less its one
    lever at saturation here, larger decode batches (a colocated prefill's stall of
    its decoding rows costs no worker-seconds in this cost model)."""
    het = saturated({"H800": ("H800", 64), "H20": ("H20", 24)}, ROUTED, model, in_flight,
                    shapes)
    out = {f"affinity_vs_{gpu.lower()}": het / saturated(
        {gpu: (gpu, n)}, dict.fromkeys(ROUTED, gpu), model, in_flight, shapes)
        for gpu, n in (("H20", 208), ("H800", 72))}
    pds = {t: shapes[t] for t in PD_TASKS}
    colo = saturated({"H800": ("H800", 32)}, dict.fromkeys(pds, "H800"), model, in_flight,
                     pds)
    step, split = MODEL_TP[model], dict.fromkeys(pds, ("P", "D"))
    pd_rate = {p: saturated({"P": ("H800", p), "D": ("H800", 32 - p)}, {}, model,
                            in_flight, pds, split) for p in range(step, 32, step)}
    out["pd_1P3D"], out["pd_2P2D"] = pd_rate[8] / colo, pd_rate[16] / colo
    out["pd_gain"] = (out["pd_1P3D"] + out["pd_2P2D"]) / 2  # as the RESULT line's pd_gain
    best = max(pd_rate, key=pd_rate.get)
    out["pd_best"], out["pd_best_p"] = pd_rate[best] / colo, best
    rows = in_flight / (32 // step)  # the colocated workers' decode rows, on D too
    out["pd_best_same_rows"] = max(saturated(
        {"P": ("H800", p), "D": ("H800", 32 - p)}, {}, model,
        round(rows * (32 - p) // step), pds, split) for p in pd_rate) / colo
    return out


def with_shapes(exp: Experiment, factor: float, _made: dict | None = None) -> Experiment:
    """``exp`` with its configs' prefill-heavy shapes scaled (``scale_prefill``), every
    other field of every config (cluster, costs, routing, graph, seed, steps, slots)
    the same objects; key and title say the factor."""
    made = {} if _made is None else _made
    key = (id(exp.configs), factor)
    if key not in made:
        made[key] = {label: replace(c, shapes=scale_prefill(c.shapes, factor))
                     for label, c in exp.configs.items()}
    return replace(exp, key=f"{exp.key}_prefill_x{factor:g}", configs=made[key],
                   title=f"{exp.title} (diagnostic: prefill-heavy prompts and "
                         f"observations ×{factor:g})")


def crossover(xs, ys, level: float) -> float:
    """The first ``x`` at which the curve ``(xs, ys)`` (``xs`` ascending) reaches
    ``level``, linear between the two points around it; ``xs[0]`` if it is there
    already at the first point, ``inf`` if it never does in the range."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= level:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (x - x0) * (level - y0) / (y - y0)
    return float("inf")


def prefill_share_sweep(factors=SWEEP_FACTORS, models=("Qwen3-8B", "Qwen3-32B"),
                        sim_factors=(1, 2, 4, 8), slot_steps=(None, 2),
                        in_flight: int = 512, log=None) -> dict:
    """The isolating experiment: the prefill-heavy tasks' prompt and observation tokens
    scaled by each of ``factors`` (``scale_prefill``), everything else (clusters, cost
    bundles, routing, seeds, env side) as it is, and the gains read against
    ``share``, the prefill share of those tasks on H20 at 16 rows (``prefill_share``;
    ``share_mix``: all four tasks on H20; ``share_pd``: PD's mix on H800).

    ``rows``: per model and factor, the shares and ``saturated_gains``; ``sim``: per
    factor in ``sim_factors`` and slot setting in ``slot_steps``, the quick affinity and
    PD experiments (Qwen3-8B and -32B, 64 groups) through the simulator with envs
    instant (``gpu_bound``), ``{(factor, slots): {key: {point: ratio}}}``; ``crossover``:
    per curve the share at which it first reaches the paper's lower bound
    (``PAPER_LOW``; ``inf``: never in the range). Sim curves are read against the
    8B's or the point's model's share."""
    rows = []
    for model in models:
        for f in factors:
            sh = scale_prefill(SHAPES, f)
            rows.append({"model": model, "factor": f, "share": prefill_share(sh, model),
                         "share_mix": prefill_share(sh, model, tasks=tuple(sh)),
                         "share_pd": prefill_share(sh, model, "H800", tasks=PD_TASKS),
                         **saturated_gains(sh, model, in_flight)})
    share = {(r["model"], r["factor"]): r["share"] for r in rows}
    cross = {}
    for model in models:
        curve = [r for r in rows if r["model"] == model]
        xs = [r["share"] for r in curve]
        for key in ("affinity_vs_h20", "affinity_vs_h800", "pd_gain", "pd_1P3D", "pd_2P2D",
                    "pd_best"):
            if key.startswith("pd") and model != "Qwen3-8B":
                continue  # paper.pd is 8B only
            low = PAPER_LOW["pd_gain" if key.startswith("pd") else key]
            cross[f"saturated/{key}/{model}"] = crossover(xs, [r[key] for r in curve], low)
    for model in models:  # the sim curves' shares, at factors the rows may not have
        for f in sim_factors:
            share.setdefault((model, f), prefill_share(scale_prefill(SHAPES, f), model))
    sim, scaled, made, results = {}, {}, {}, {}
    for f in sim_factors:
        for slots in slot_steps:
            got = {}
            for exp in affinity(True) + pd(True):
                exp = gpu_bound(with_shapes(exp, f, scaled), slots, made)
                key = exp.key.split("_prefill")[0]
                got[key], got[f"{key}_tokens"], mix = _ratios(exp, results)
                got.setdefault("trained", {}).update(mix)
            sim[(f, slots)] = got
            if log:
                log(f"prefill ×{f:g}, envs instant{f', slots {slots}' if slots else ''} "
                    "(trajectories/s ratio; generated tokens/s ratio): " + " ".join(
                        f"{k} " + ", ".join(f"{p} {v:.3g}; {got[k + '_tokens'][p]:.3g}"
                                            for p, v in got[k].items())
                        for k in ("affinity_vs_h20", "affinity_vs_h800", "pd_gain")))
                log(f"prefill ×{f:g}, trained groups by task: " + "; ".join(
                    f"{label} {dict(sorted(m.items()))}" for label, m in got["trained"].items()))
    for slots in slot_steps:
        tag = f"sim_slots{slots}" if slots else "sim"
        for key in ("affinity_vs_h20", "affinity_vs_h800", "pd_gain"):
            points = sorted({p for f in sim_factors for p in sim[(f, slots)][key]})
            for point in points:
                model = point if point in models else "Qwen3-8B"
                xs = [share[(model, f)] for f in sim_factors]
                ys = [sim[(f, slots)][key][point] for f in sim_factors]
                cross[f"{tag}/{key}/{point}"] = crossover(xs, ys, PAPER_LOW[key])
    return {"rows": rows, "sim": sim, "crossover": cross, "share": share}


def _ratios(exp: Experiment, cache: dict) -> tuple[dict, dict, dict]:
    """``exp`` simulated: per point its figure (trajectories/s of ``num`` over ``den``),
    the same ratio of generated tokens/s (a trajectories/s ratio also moves with which
    tasks' trajectories make up the trained batches; tokens/s does not count prefill,
    so neither alone is the GPUs' work) and per config the trained groups by task;
    ``cache``: ``id(config)`` → result, for experiments sharing configs."""
    from rollart.sim import simulate

    for cfg in exp.configs.values():
        if id(cfg) not in cache:
            cache[id(cfg)] = (cfg, simulate(cfg))  # the config kept: its id stays its own
    res = {label: cache[id(cfg)][1] for label, cfg in exp.configs.items()}
    tokens = {label: replace(r, throughput={"trajectories_s": r.throughput["tokens_s"]})
              for label, r in res.items()}
    mix = {label: trained_tasks(exp.configs[label], r) for label, r in res.items()}
    return exp.figure(res), exp.figure(tokens), mix


def trained_tasks(cfg, result) -> dict:
    """``{task: groups}`` of the groups ``result``'s trainer took (``trained_groups``,
    by start number), the tasks replayed from the run's ``GroupSequence``."""
    from collections import Counter

    from rollart.policy.admission import GroupSequence

    g = cfg.graph
    taken = [i for step in result.extra["trained_groups"] for i in step]
    seq = GroupSequence(g.tasks, g.task_weights, g.seed + cfg.seed, g.algo.group_size)
    names = [getattr(seq.next()[0], "name", None) for _ in range(max(taken, default=-1) + 1)]
    return dict(Counter(names[i] for i in taken))


def sweep_table(sweep: dict) -> str:
    """``prefill_share_sweep``'s saturated rows, then its simulated ones, as markdown."""
    lines = ["| model | ×prompt/obs | prefill share (swe+web on H20 / 4 tasks on H20 / "
             "PD mix on H800) | affinity vs 208 H20 | vs 72 H800 | PD 1P3D | 2P2D | "
             "PD best split (P of 32) | same, D rows as colocated |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sweep["rows"]:
        pds = (f"{r['pd_1P3D']:.2f} | {r['pd_2P2D']:.2f} | {r['pd_best']:.2f} "
               f"({r['pd_best_p']}) | {r['pd_best_same_rows']:.2f}"
               if r["model"] == "Qwen3-8B" else "— | — | — | —")  # paper.pd: 8B only
        lines.append(f"| {r['model']} | {r['factor']:g} | {r['share']:.2f} / "
                     f"{r['share_mix']:.2f} / {r['share_pd']:.2f} | "
                     f"{r['affinity_vs_h20']:.2f} | {r['affinity_vs_h800']:.2f} | {pds} |")
    if not sweep["sim"]:
        return "\n".join(lines)
    lines += ["", "| ×prompt/obs | share 8B / 32B | slots | affinity vs 208 H20, 8B / 32B "
              "(tokens/s ratio) | vs 72 H800 | PD 1P3D / 2P2D |", "|---|---|---|---|---|---|"]
    for (f, slots), got in sweep["sim"].items():
        shares = " / ".join(f"{v:.2f}" for (_, g), v in sweep["share"].items() if g == f)
        lines.append(f"| {f:g} | {shares} | {slots or '—'} | "
                     + " | ".join(_cell(got, k) for k in
                                  ("affinity_vs_h20", "affinity_vs_h800", "pd_gain")) + " |")
    return "\n".join(lines)


def _cell(got: dict, key: str) -> str:
    return (" / ".join(f"{v:.2f}" for v in got[key].values()) + " (" +
            " / ".join(f"{v:.2f}" for v in got[key + "_tokens"].values()) + ")")
