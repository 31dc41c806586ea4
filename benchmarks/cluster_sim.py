"""The cluster simulator end to end: calibration on this machine, the paper's experiments,
the 3,000-GPU run, two plots and one RESULT line.

    flock /tmp/rollart-bench.lock python benchmarks/cluster_sim.py --quick

1. **Calibration** (``rollart.sim.calibrate.calibration``): real ``sync`` and ``async``
   runs of the pipeline benchmark's workload on ``resources/laptop.py`` beside the
   simulator configured from this machine's micro-benchmarks and probes only, three
   rounds (seeds) of each; the largest relative error over the median throughput per
   mode and the async ÷ sync ratio of those medians (the figures
   ``benchmarks/pipeline.py`` reports) is ``calibration_error``.
2. **The paper's experiments** (``rollart.sim.paper.run_all``), each printed beside the
   paper's figure.
3. **Scale** (``rollart.sim.paper.scale_config``): 3,000 GPUs (500 train, 2,500 rollout),
   α = 1, tens of thousands of env slots: throughput, utilisation per pool, staleness,
   aborts, control-plane load, and the wall time of the simulation itself; run twice,
   weights relayed from the trainer gang (``WeightSync.path="relay"``, the default) and
   from one store node (``"store"``, rollart before the gang), each with its per-version
   sync time and origin bytes ratio (``rollart.sim.fanout``).
4. Plots into ``--out``: ``sim_utilisation.png`` (busy share over time per pool, scale
   run) and ``sim_staleness.png`` (trained trajectories by versions behind).

``--no-calibration`` skips step 1 (no real runs; ``calibration_error=nan``);
``--calibration-only`` runs step 1 alone; ``--scale-only`` steps 3–4 alone (no real
runs, deterministic: the simulator and its seed); a run other than ``--tiny`` appends
its RESULT figures to ``benchmarks/results/cluster_sim.jsonl`` (``--no-record``: not);
``--save-measured PATH`` keeps its measurements and the real runs' metrics
(cloudpickle) to look at the prediction again;
``--heldout`` runs, alone, the held-out calibration (``rollart.sim.heldout``,
``benchmarks/_heldout.py``) ``--invocations N`` times (default 3; ``--quick`` 2 of
smaller runs; ``--tiny`` 1), each an independent invocation: its own fit (the simulator
fitted on probes of one configuration of the pipeline benchmark's workload, async,
alpha 1), its own seeds, its own real runs. It predicts 11 configurations it never
probed (another alpha, envs twice as slow, an env pool of half a step, another task mix,
the other modes, and on the GPU side two inference workers, prefill and decode split
over two workers, ``Policy.weight_update="keep"``), each also run for real over 3 seeds
of 10 steps (about 23 min an invocation on 2 cores, estimated). The headline is each
invocation's count of configurations within 0.15 relative error of the median real
trajectories/s: ``heldout_within_015`` is the smallest count over the invocations,
``heldout_worst`` the largest error of any configuration in any of them, beside
``invocations`` and ``heldout_configs`` (per invocation); per invocation ``i``,
``heldout_within_015_<i>``, ``heldout_worst_<i>`` and ``heldout_missed_<i>`` (the
configurations beyond 0.15, or ``none``). ``calibration_error_heldout`` (the median of
every held-out error, the figure of the one-invocation records before) and
``calibration_error_fit`` follow; every configuration's real and simulated figures and
error, per invocation, are in the record's details (``heldout_invocations``).
``--frozen COMMIT`` refuses to start, with one line naming the files, when
``rollart/sim`` differs from ``COMMIT`` (``git diff COMMIT -- rollart/sim``, or a file
untracked there): the simulator must be the one frozen before the held-out runs; the
record says ``frozen=<commit>``, or ``frozen=none`` without the flag;
``--tiny`` also shrinks steps 2–3 to a smoke test (the test suite runs it). The RESULT
line's ratios are the mean over the experiment's points (models or splits).
``--diagnostics`` adds, after the paper's table, the headline affinity and PD configs
over 5 seeds, the affinity and PD experiments with the GPUs on the critical path
(``rollart.sim.diagnose``: envs instant, then also 2 steps of slots; diagnostic
variants, not the paper's workload), their roofline figures and the prefill-share
sweep (``diagnose.prefill_share_sweep``: the prefill-heavy tasks' prompts and
observations ×0.5–32, nothing else changed; the gains against that prefill share at
saturation and, ×1–8, simulated with envs instant; ``*_crossover_share`` keys: the
share at which each curve first reaches the paper's lower bound, ``inf`` if never),
and ends them with a ``DIAGNOSTIC key=value ...`` line before the RESULT line.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py

from _results import Run, add_arguments  # noqa: E402

RESULT_KEYS = ("affinity_vs_h20", "affinity_vs_h800", "async_vs_sync", "syncplus_vs_sync",
               "pd_gain", "redundancy_gain", "alpha_gain", "alpha_gain_fixed_slots")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_utilisation(result, out_png: Path) -> None:
    """Busy share over simulated time per pool (inference tags, env, reward, trainer)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for pool, series in sorted(result.timeline.items()):
        if series:
            ax.plot([t for t, _ in series], [u for _, u in series], label=pool,
                    linewidth=1.5)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("busy share")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"rollart sim: utilisation per pool ({result.gpus} GPUs, {result.mode})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def plot_staleness(results: dict, out_png: Path) -> None:
    """Trained trajectories by versions behind the trainer, one bar group per run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    lags = sorted({k for r in results.values() for k in r.staleness})
    width = 0.8 / max(len(results), 1)
    for i, (label, r) in enumerate(results.items()):
        total = max(sum(r.staleness.values()), 1)
        ax.bar([x + i * width for x in lags], [r.staleness.get(k, 0) / total for k in lags],
               width=width, label=label)
    ax.set_xlabel("versions behind the trainer (trainer version − oldest token's)")
    ax.set_ylabel("share of trained trajectories")
    ax.set_xticks([x + width * (len(results) - 1) / 2 for x in lags], [str(k) for k in lags])
    ax.set_title("rollart sim: staleness of trained trajectories")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def _mean(values: dict) -> float:
    finite = [v for v in values.values() if v == v]
    return sum(finite) / len(finite) if finite else float("nan")


def run_paper(tiny: bool, log=print) -> dict:
    from rollart.sim import paper

    if not tiny:
        return paper.run_all(quick=True, log=log)
    out = {}
    for exp in paper.modes(quick=True, steps=2) + paper.pd(quick=True, steps=1):
        exp = replace(exp, configs={k: _tiny(c) for k, c in exp.configs.items()})
        out[exp.key] = paper.run(exp)
        log(f"{exp.key}: {out[exp.key]['values']}")
    return out


def _tiny(cfg):
    """A config cut to a smoke test: 2 groups of 4 per step, 1 step."""
    g = cfg.graph
    algo = replace(g.algo, groups_per_step=2, group_size=4)
    return replace(cfg, graph=replace(g, algo=algo), steps=1)


def async_two_steps_of_slots(log=print) -> float:
    """The modes experiment's async with ``(alpha + 1) * groups_per_step`` slots (the
    runtime's rule before commit 7aa843c) in place of ``max(alpha, 1)`` steps' worth:
    how much of the async gain the slot rule decides; mean over the models."""
    from rollart.sim import paper, simulate

    exp = paper.modes(quick=True)[0]
    ratios = []
    for label, cfg in exp.configs.items():
        if not label.endswith("/async"):
            continue
        algo = cfg.graph.algo
        two = simulate(replace(cfg, slot_capacity=(algo.alpha + 1) * algo.groups_per_step))
        sync = simulate(exp.configs[label.replace("/async", "/sync")])
        ratios.append(two.throughput["trajectories_s"] / sync.throughput["trajectories_s"])
        log(f"async with (alpha+1) steps of slots vs sync, {label}: {ratios[-1]:.3g}x "
            f"(staleness {two.staleness}, aborts {two.aborts['aborted']})")
    return sum(ratios) / len(ratios)


SEEDS = range(5)  # the headline affinity / PD configs' seeds in --diagnostics


def run_diagnostics(log=print) -> dict:
    """``rollart.sim.diagnose``: each model's roofline table, the saturated (roofline)
    ratios, the headline affinity and PD configs over ``SEEDS`` (ratio of mean
    throughputs, the baseline's spread), and the affinity and PD experiments with envs
    instant (and 2 steps of slots) through the simulator, then the prefill-share sweep
    (``prefill_sweep``); ``{key: mean ratio}`` and the sweep's figures."""
    from rollart.sim import diagnose, paper

    for model in ("Qwen3-8B", "Qwen3-32B"):
        log(diagnose.roofline_table(model))
    out = {}
    for model in ("Qwen3-8B", "Qwen3-32B"):
        gains = diagnose.saturated_gains(paper.SHAPES, model, 512)
        for gpu in ("h20", "h800"):
            out[f"roofline_affinity_vs_{gpu}/{model}"] = gains[f"affinity_vs_{gpu}"]
        if model == "Qwen3-8B":  # paper.pd: 8B only
            for split in ("1P3D", "2P2D"):
                out[f"roofline_pd_gain/{split}"] = gains[f"pd_{split}"]
    log("roofline (GPUs saturated, 512 trajectories in flight): "
        + " ".join(f"{k}={v:.3g}" for k, v in out.items()))
    figures = {f"roofline_{k}": _mean({m: v for m, v in out.items()
                                        if m.startswith(f"roofline_{k}/")})
               for k in ("affinity_vs_h20", "affinity_vs_h800", "pd_gain")}
    for exp in paper.affinity(quick=True) + paper.pd(quick=True):
        spread = diagnose.over_seeds(exp, SEEDS)
        log(f"{exp.key} over seeds {list(SEEDS)} (the headline configs): "
            + " ".join(f"{p}: ratio of means {r:.3g}, baseline spread {s:.1%}"
                       for p, (r, s) in spread.items()))
        figures[f"{exp.key}_{len(SEEDS)}seeds"] = _mean({p: r for p, (r, _) in spread.items()})
        figures[f"{exp.key}_{len(SEEDS)}seeds_spread"] = max(s for _, s in spread.values())
    results, cache = {}, {}
    for exp in diagnose.diagnostics(quick=True):
        results[exp.key] = paper.run(exp, cache)
        r = results[exp.key]
        log(f"{exp.key}: sim {r['values']} paper {r['paper']} ({r['wall_s']:.1f}s) "
            + _utilisation(exp, cache))
        figures[exp.key] = _mean(r["values"])
    log(paper.table(results))
    figures.update(prefill_sweep(log))
    return figures


def prefill_sweep(log=print) -> dict:
    """``diagnose.prefill_share_sweep``: the prefill-heavy tasks' prompts and
    observations scaled, nothing else changed; its tables, and per curve the prefill
    share (the swe + web trajectories' prefill share on H20, 16 rows) at which the gain
    first reaches the paper's lower bound (``inf``: not in the swept range) as
    ``{curve}_crossover_share`` (saturated, Qwen3-8B; ``_32b``: Qwen3-32B; ``_sim``:
    simulated with envs instant, ``_sim_slots2``: and 2 steps of slots; PD per split)
    and the saturated curves' largest gain in the range (``_sweep_max``)."""
    from rollart.sim import diagnose

    t0 = time.perf_counter()
    sweep = diagnose.prefill_share_sweep(log=log)
    log(diagnose.sweep_table(sweep))
    out = {}
    for name, share in sweep["crossover"].items():
        tag, key, point = name.split("/")
        sfx = {"Qwen3-8B": "", "Qwen3-32B": "_32b"}.get(point, f"_{point.lower()}")
        tag = "" if tag == "saturated" else f"_{tag}"
        out[f"{key.lower()}{tag}_crossover_share{sfx}"] = share
    rows8 = [r for r in sweep["rows"] if r["model"] == "Qwen3-8B"]
    for key in ("affinity_vs_h20", "affinity_vs_h800", "pd_1P3D", "pd_best",
                "pd_best_same_rows"):
        out[f"{key.lower()}_sweep_max"] = max(r[key] for r in rows8)
    log(f"prefill-share sweep ({time.perf_counter() - t0:.0f}s): "
        + " ".join(f"{k}={v:.3g}" for k, v in out.items()))
    return out


def _utilisation(exp, cache: dict) -> str:
    """Each config's GPU pools' busy share, from ``paper.run``'s cache."""
    parts = []
    for label in exp.configs:
        r = cache[(id(exp.configs), label)]
        gpu = {k: round(v, 2) for k, v in r.utilisation.items()
               if k not in ("CPU_ENV", "reward", "trainer")}
        parts.append(f"{label} {gpu}")
    return "; ".join(parts)


WEIGHT_PATHS = ("relay", "store")  # the scale run's weight paths: the first one's figures
# are the RESULT line's scale_* keys, the others' carry the path's name as a suffix


def run_scale(tiny: bool, path: str = "relay", steps: int | None = None, log=print,
              max_in_flight: float | None = None):
    """The 3,000-GPU run with weights over ``path`` (``WeightSync.path``), ``steps``
    trainer steps (default 2; 1 when ``tiny``), ``Rollout.max_in_flight`` (default: the
    graph's, ``max(alpha, 1)`` steps' worth)."""
    from rollart.sim import simulate
    from rollart.sim.paper import scale_config

    cfg = scale_config(quick=tiny, steps=steps or (1 if tiny else 2))
    cfg = replace(cfg, costs=cfg.costs.with_(weights=replace(cfg.costs.weights, path=path)))
    if max_in_flight is not None:
        g = cfg.graph
        cfg = replace(cfg, graph=replace(g, rollout=replace(g.rollout,
                                                            max_in_flight=max_in_flight)))
    if tiny:
        cfg = _tiny(cfg)
    log(f"scale ({path}): {cfg.cluster.gpus} GPUs, {cfg.cluster.env[0].slots} env slots, "
        f"{cfg.graph.algo.groups_per_step} groups of {cfg.graph.algo.group_size} per step, "
        f"{cfg.steps} steps")
    r = simulate(cfg)
    x = r.extra
    log(f"scale ({path}): {r.summary()}")
    log(f"scale ({path}): weights {x['weight_buckets']} buckets from {x['weight_origins']} "
        f"origin(s), sync per version {[round(s, 2) for s in x['weight_sync_s']]} s, "
        f"origin bytes ratio {x['origin_bytes_ratio']:.4g}, trainer utilisation "
        f"{r.utilisation['trainer']:.3f}")
    log(f"scale ({path}): staleness {r.staleness} aborts {r.aborts}")
    log(f"scale ({path}): control {r.control}")
    return cfg, r


def gpu_util(cfg, r) -> float:
    """The inference GPUs' busy fraction over the run, weighted by each pool's GPUs."""
    pools = [p for p in cfg.cluster.inference if p.tag in r.utilisation]
    gpus = sum(p.count for p in pools)
    return sum(r.utilisation[p.tag] * p.count for p in pools) / gpus if gpus else float("nan")


def scale_figures(runs: dict) -> dict:
    """The RESULT line's figures of the scale runs (``{path: (SimConfig, SimResult)}``)."""
    out = {}
    for i, (path, (cfg, r)) in enumerate(runs.items()):
        sfx = "" if i == 0 else f"_{path}"
        if i == 0:
            out["gpus"] = r.gpus
        out[f"scale_wall_s{sfx}"] = r.sim_wall_s
        out[f"scale_traj_s{sfx}"] = r.throughput["trajectories_s"]
        syncs = r.extra["weight_sync_s"]
        out[f"weight_sync_s{sfx}"] = max(syncs) if syncs else float("nan")
        out[f"origin_bytes_ratio{sfx}"] = r.extra["origin_bytes_ratio"]
        out[f"gpu_util_3000{sfx}"] = gpu_util(cfg, r)
        if i == 0:
            out["scheduler_load"] = r.control["scheduler_load"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the few-minute version")
    ap.add_argument("--tiny", action="store_true", help="a smoke test (no real runs)")
    ap.add_argument("--no-calibration", action="store_true", help="skip the real runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "figures"),
                    help="folder for the plots")
    ap.add_argument("--calibration-only", action="store_true",
                    help="the calibration alone (no paper experiments, no 3,000-GPU run)")
    ap.add_argument("--diagnostics", action="store_true",
                    help="also the affinity and PD experiments with the GPUs on the "
                         "critical path (rollart.sim.diagnose) and a DIAGNOSTIC line")
    ap.add_argument("--scale-only", action="store_true",
                    help="the 3,000-GPU run alone, through each weight path (no real runs, "
                         "no paper experiments)")
    ap.add_argument("--scale-max-in-flight", type=float, default=None, metavar="X",
                    help="Rollout.max_in_flight of the 3,000-GPU runs (steps' worth of "
                         "groups; default: the graph's)")
    ap.add_argument("--scale-steps", type=int, default=None, metavar="N",
                    help="trainer steps of the 3,000-GPU runs (default 2)")
    ap.add_argument("--heldout", action="store_true",
                    help="the held-out calibration alone (rollart.sim.heldout): fit on one "
                         "configuration's probes, predict others never probed")
    ap.add_argument("--invocations", type=int, default=None, metavar="N",
                    help="--heldout: independent invocations, each its own fit, real runs "
                         "and seeds (default 3; --quick 2; --tiny 1)")
    ap.add_argument("--frozen", default=None, metavar="COMMIT",
                    help="--heldout: refuse to start unless rollart/sim is as at COMMIT "
                         "(git diff COMMIT -- rollart/sim empty, nothing untracked there)")
    ap.add_argument("--save-measured", default=None, metavar="PATH",
                    help="write the calibration's measurements and real runs' metrics "
                         "(cloudpickle) to PATH, to look at the prediction again")
    add_arguments(ap)
    args = ap.parse_args(argv)
    if (args.invocations is not None or args.frozen is not None) and not args.heldout:
        ap.error("--invocations and --frozen belong to the held-out calibration: add "
                 "--heldout, or drop them")
    run = Run("cluster_sim", args, argv)  # not recorded: --tiny, --no-record
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict = {}
    if args.heldout:
        return heldout(args, run)
    if args.scale_only:
        figures = _scale(args.tiny, out, t0, steps=args.scale_steps,
                         max_in_flight=args.scale_max_in_flight)
        run.result(figures, fmt=_fmt)
        return figures
    if args.no_calibration or args.tiny:
        figures["calibration_error"] = float("nan")
    else:
        from rollart.sim.calibrate import calibration

        try:
            cal = calibration(quick=args.quick, save=args.save_measured)
        except Exception as e:  # noqa: BLE001 - report it; the simulated figures still run
            print(f"calibration failed: {type(e).__name__}: {e}")
            figures["calibration_error"] = float("nan")
        else:
            print(f"calibration: real {cal['real']} sim {cal['sim']} errors "
                  f"{cal['errors']} ({cal['wall_s']:.0f}s); at the probes' CPU stretch: "
                  f"sim {cal['sim_probe_stretch']} errors {cal['errors_probe_stretch']}; "
                  f"stretch {cal['stretch']}; each round against its own prediction: "
                  f"{[round(e, 3) for e in cal['round_errors']]}")
            figures["calibration_error"] = cal["calibration_error"]
            figures["calibration_error_probe_stretch"] = \
                cal["calibration_error_probe_stretch"]
            figures["calibration_rounds"] = len(cal["round_errors"])
    if args.calibration_only:
        run.result(figures, fmt=_fmt)
        return figures
    t_sim = time.perf_counter()
    paper = run_paper(args.tiny)
    for key in RESULT_KEYS:
        figures[key] = _mean(paper[key]["values"]) if key in paper else float("nan")
    serverless = paper.get("serverless_util", {}).get("values", {})
    figures["serverless_util"] = serverless.get("elastic", float("nan"))
    if not args.tiny:
        from rollart.sim.paper import table

        print(table(paper))
    if not args.tiny:
        figures["async2_vs_sync"] = async_two_steps_of_slots()
    if args.diagnostics and not args.tiny:
        diag = run_diagnostics()
        print("DIAGNOSTIC " + " ".join(f"{k}={_fmt(v)}" for k, v in diag.items()))
    figures.update(_scale(args.tiny, out, t0, t_sim, figures, args.scale_steps,
                          args.scale_max_in_flight))
    run.result(figures, fmt=_fmt)
    return figures


def heldout(args, run) -> dict:
    """``--heldout``: the frozen check (``--frozen``), then ``_heldout.run_heldout``;
    prints the RESULT line and records it (``frozen``: the commit, or ``none``)."""
    from _heldout import frozen_commit, frozen_problem, run_heldout

    frozen = "none"
    if args.frozen is not None:
        problem = frozen_problem(args.frozen)
        if problem:
            raise SystemExit(problem)
        frozen = frozen_commit(args.frozen)[:12]
        print(f"simulator frozen at {frozen}: rollart/sim unchanged since")
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    figures, details = run_heldout(size, args.invocations)
    figures["frozen"] = frozen
    run.result(figures, details, fmt=_fmt)
    return figures


def _scale(tiny: bool, out: Path, t0: float, t_sim: float | None = None,
           figures: dict | None = None, steps: int | None = None,
           max_in_flight: float | None = None) -> dict:
    """Step 3 and step 4 (the scale runs, their plots): the RESULT line's figures
    (``figures`` of the steps before first)."""
    figures = dict(figures or {})
    t_sim = time.perf_counter() if t_sim is None else t_sim
    runs = {path: run_scale(tiny, path, steps, max_in_flight=max_in_flight)
            for path in WEIGHT_PATHS}
    scale = runs[WEIGHT_PATHS[0]][1]
    figures.update(scale_figures(runs))
    figures["sim_wall_s"] = time.perf_counter() - t_sim
    plot_utilisation(scale, out / "sim_utilisation.png")
    stale = {f"{scale.gpus} GPUs async α=1": scale}
    plot_staleness(stale, out / "sim_staleness.png")
    print(f"plots: {out / 'sim_utilisation.png'} {out / 'sim_staleness.png'} "
          f"({time.time() - t0:.0f}s in all)")
    return figures


def _fmt(v) -> str:
    if isinstance(v, (int, str)):
        return str(v)
    return "nan" if v != v else (f"{v:.4g}" if not math.isinf(v) else "inf")


if __name__ == "__main__":
    main()
