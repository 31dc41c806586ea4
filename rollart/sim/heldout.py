"""Held-out calibration: the simulator fitted on one configuration predicts others.

``rollart.sim.calibrate`` fits each mode on a probe of that same mode just before the
run it predicts, so its error says how well a re-measurement is reproduced. Here the
simulator is fitted once, on probes of one configuration of the pipeline benchmark's own
workload (``benchmarks/pipeline.py``: the default multitask graph on
``resources/laptop.py``, envs that cost what sandboxes cost, ``rollart.chaos.workload``,
no redundant members), and then predicts, without refitting, configurations it never
probed (``HELDOUT``): another alpha, envs twice as slow, an env pool of half a step's
trajectories, another task mix, the other modes, and three that change the GPU side:
two inference workers instead of one, prefill and decode split over two workers (PD),
and the weight path's ``Policy.weight_update="keep"`` (see ``Setting`` for how the
simulator models each). Each is run for real on the same cluster and seeds; the figure
compared is the benchmark's, trained trajectories per second, median over the seeds.
``heldout_calibration`` is one invocation: its own fit, its own real runs, each
configuration's relative error (``errors``); ``summarise`` turns several invocations'
errors into the reported figures: per invocation the count within ``WITHIN`` and the
worst, and over them the smallest count and the worst of all.

What the fit takes from its probes (all of the ``FIT`` configuration, on seeds no real
run uses):

* ``measure_engine`` and ``measure_control_plane``: micro-benchmarks, alone;
* a probe run of ``FIT``: the trainer's step beside rollout (``in_situ_trainer``), the
  engine's busy time per request beyond the simulator's (``in_situ_engine``), and the
  tasks' episodes (``measure_shapes``; no redundant members, so unselected);
* a run with one trajectory live at a time: the env manager's loop time a turn.

Rules for what the probes cannot show, fixed before any run: modes that stop rollout
while the trainer steps (``sync``, ``sync+``) get the trainer as measured alone (nothing
runs beside it there), the engine as the probe found it; the envs' costs are the
workload's declared distributions (``rollart.sim.sandbox``), not fitted; the GPU side's
settings reuse the one worker's fitted engine for every worker and the fitted weight
store's rate for PD's KV (``Setting``). Nothing is read from the runs being predicted:
the CPU stretch ``calibrate.predict`` reads during a run is not used here.

Consumes ``rollart.sim.calibrate`` and ``rollart.sim.measure``; called by
``benchmarks/_heldout.py`` (``benchmarks/cluster_sim.py --heldout``), once per
invocation: invocation ``i`` (from 0) fits on seeds ``FIT_SEED + i * SEED_STRIDE`` and
runs on ``seeds + i * SEED_STRIDE`` (``invocation_seeds``).
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["FIT", "FIT_SEED", "HELDOUT", "SEED_STRIDE", "WITHIN", "Setting", "errors",
           "heldout_calibration", "invocation_seeds", "setting_graph", "setting_sim",
           "summarise"]


@dataclass(frozen=True)
class Setting:
    """One configuration of the pipeline workload: ``FIT`` with one thing changed.
    ``env_scale`` multiplies ``Workload.scale`` (every env duration); ``env_slots`` is
    the env pool (``Rollout.env_concurrency``) in steps' worth of trajectories (``None``:
    the graph's); ``tasks``: a subset of the graph's tasks by name (``None``: all).

    The GPU side (the laptop's "GPUs" are inference tags on its CPU worker):
    ``inference_pools`` (``Rollout.inference_pools``; ``None``: the fit's one H800
    worker): ``("H800", "H20")`` is two inference workers, one per tag, in the rollout
    process; the simulator gives each the fitted CPU engine (one ``GPUPool`` per tag,
    ``calibrate.laptop_sim_config``), each paused by the env managers' turns (one GIL),
    but not by each other: two engines' Python sharing that GIL is not modelled.
    ``pd``: every task prefills on the H800 worker and decodes on the H20 one
    (``task_affinity(prefill=H800, decode=H20)``); the simulator routes each turn's
    prefill and decode to the two workers and charges the KV's move at the fitted
    weight store's latency and rate plus one actor call (``rollart.sim.cluster``).
    ``weight_update`` (``Policy.weight_update``; ``None``: the graph's ``recompute``):
    ``"keep"``: in-flight rows go on over their KV at a weight swap; the simulator's
    workers then load without re-prefilling (``SimWorker.keep_kv``)."""

    name: str
    mode: str = "async"
    alpha: int | None = None
    env_scale: float = 1.0
    env_slots: float | None = None
    tasks: tuple[str, ...] | None = None
    inference_pools: tuple[str, ...] | None = None
    pd: bool = False
    weight_update: str | None = None


FIT = Setting("fit")
HELDOUT = (Setting("alpha2", alpha=2), Setting("env_x2", env_scale=2.0),
           Setting("slots_half_step", env_slots=0.5),
           Setting("gridnav_boxpush", tasks=("gridnav", "boxpush")),
           Setting("sync", mode="sync"), Setting("sync+", mode="sync+"),
           Setting("one-off", mode="one-off"), Setting("areal", mode="areal"),
           Setting("workers_x2", inference_pools=("H800", "H20")),
           Setting("pd", pd=True), Setting("weights_keep", weight_update="keep"))
WITHIN = 0.15  # a held-out configuration's relative error counts as within at most this
SEED_STRIDE = 100  # invocation i (from 0): real seeds + i * SEED_STRIDE, fit seeds FIT_SEED + that
FIT_SEED = 100_000


def invocation_seeds(i: int, seeds) -> tuple[tuple[int, ...], int]:
    """Invocation ``i``'s (from 0) real-run seeds and its fit's first probe seed: every
    invocation its own, none shared with another invocation's runs or with a fit's
    probes (``seeds`` in ``[0, SEED_STRIDE)``)."""
    if i < 0 or any(not 0 <= s < SEED_STRIDE for s in seeds):
        raise ValueError(f"held-out seeds must be in [0, {SEED_STRIDE}) and the invocation "
                         f"≥ 0, so no invocation reuses another's seeds; got seeds "
                         f"{list(seeds)}, invocation {i}")
    return tuple(s + i * SEED_STRIDE for s in seeds), FIT_SEED + i * SEED_STRIDE


def base_graph():
    """The pipeline benchmark's graph: the default multitask graph, one H800-tagged pool."""
    import rollart

    base, _ = rollart.load_graph("multitask")
    return replace(base, rollout=replace(base.rollout, inference_pools=("H800",)))


def setting_graph(base, s: Setting, model: str, steps: int, groups: int, seed: int):
    """``base`` as ``benchmarks/pipeline.py`` runs it (``groups`` groups a step, no
    redundant members, envs of ``rollart.chaos.workload`` seeded ``seed``), with ``s``."""
    from rollart.chaos.workload import Workload, with_workload
    from rollart.policy.affinity import task_affinity
    from rollart.types import H20, H800

    names = {t.name for t in base.tasks}
    if s.tasks is not None and not set(s.tasks) <= names:
        raise ValueError(f"Setting {s.name!r}: tasks {sorted(set(s.tasks) - names)} are not "
                         f"in the graph (it has {sorted(names)})")
    work = Workload(scale=Workload().scale * s.env_scale, seed=seed)
    tasks = tuple(with_workload(t, work) for t in base.tasks
                  if s.tasks is None or t.name in s.tasks)
    if s.pd:
        tasks = tuple(task_affinity(prefill=H800, decode=H20)(t) for t in tasks)
    members = groups * base.algo.group_size
    slots = base.rollout.env_concurrency if s.env_slots is None else \
        max(1, round(s.env_slots * members))
    pools = s.inference_pools or base.rollout.inference_pools
    policy = replace(base.policy, model=model,
                     weight_update=s.weight_update or base.policy.weight_update)
    return replace(base, tasks=tasks, mode=s.mode, steps=steps, seed=seed, policy=policy,
                   algo=replace(base.algo, groups_per_step=groups, alpha=s.alpha),
                   rollout=replace(base.rollout, redundancy=1.0, env_concurrency=slots,
                                   inference_pools=pools))


def setting_sim(graph, fitted: dict, steps: int):
    """The simulator configured as this laptop (``calibrate.laptop_sim_config``) from
    ``fitted`` alone (``fit``'s ``fits``, ``control``, ``shapes``, ``turn_s``) for
    ``graph``: its tasks' shapes, its envs' workload as a fresh ``SandboxPoolCost``."""
    from rollart.sim.calibrate import laptop_sim_config
    from rollart.sim.sandbox import SandboxPoolCost

    shapes = {t.name: fitted["shapes"][t.name] for t in graph.tasks}
    env = SandboxPoolCost(graph.tasks[0].env_factory.workload)
    return laptop_sim_config(graph, fitted["fits"], fitted["control"], shapes, steps,
                             graph.mode, graph.seed, fitted["turn_s"], env)


def fit(client, base, model: str, groups: int, tmp: Path, probe_steps: int = 3,
        seed: int = 1000, log=print) -> dict:
    """The fit, from probes of ``FIT`` on seeds ``seed``… only: ``fits`` (``overlapping``
    from the probe, ``lockstep`` the trainer alone with the probe's engine),
    ``control``, ``shapes``, ``turn_s``."""
    import rollart
    from rollart.chaos.workload import drain_pools
    from rollart.sim.calibrate import _lone_turn_s, in_situ_engine
    from rollart.sim.measure import (in_situ_trainer, measure_control_plane, measure_engine,
                                     measure_shapes)
    from rollart.sim.sandbox import SandboxPoolCost

    alone = measure_engine()
    control = measure_control_plane(client)
    probe = setting_graph(base, FIT, model, probe_steps, groups, seed)
    client.run(drain_pools, on_error="return")
    rows = rollart.train(probe, client=client, run_dir=tmp / "probe", progress=False,
                         eval_seeds=0).metrics
    shapes = measure_shapes(tmp / "probe")
    client.run(drain_pools, on_error="return")
    turn_s = _lone_turn_s(base, probe.tasks, model, client, tmp, seed + 1)
    fits = {"overlapping": in_situ_trainer(alone, rows, shapes, probe.algo.batch_size)}
    env = SandboxPoolCost(probe.tasks[0].env_factory.workload)
    fits = in_situ_engine(fits, control, shapes, turn_s, probe, rows, env)
    fits["lockstep"] = replace(alone, gen=fits["overlapping"].gen)
    over = fits["overlapping"]
    log(f"fit ({FIT.name}, {probe_steps}-step probe): trainer {over.train.overhead_s:.3f}s "
        f"overhead a step beside rollout; engine "
        f"{over.gen.request_overhead_s * 1e3:.2f} ms a request in situ; "
        f"env manager {turn_s * 1e3:.2f} ms a turn; engine fit error {alone.fit_error:.3f}")
    return {"fits": fits, "control": control, "shapes": shapes, "turn_s": turn_s}


def real_runs(client, base, model: str, settings, steps: int, groups: int,
              seeds, tmp: Path, log=print) -> dict:
    """Every setting on every seed, each seed's order shuffled by ``random.Random(seed)``,
    each run from an empty sandbox pool: ``{name: {seed: trajectories/s}}``."""
    import rollart
    from rollart.chaos.workload import drain_pools

    out: dict = {s.name: {} for s in settings}
    for seed in seeds:
        for s in random.Random(seed).sample(list(settings), len(settings)):
            graph = setting_graph(base, s, model, steps, groups, seed)
            client.run(drain_pools, on_error="return")
            rows = rollart.train(graph, client=client, run_dir=tmp / f"{s.name}-{seed}",
                                 progress=False, eval_seeds=0).metrics
            out[s.name][seed] = rows[-1]["traj/trained"] / rows[-1]["time"]
            log(f"real {s.name} (seed {seed}): {out[s.name][seed]:.2f} traj/s over "
                f"{rows[-1]['time']:.1f}s")
    return out


def predictions(base, model: str, fitted: dict, settings, steps: int, groups: int,
                seeds) -> dict:
    """The simulator's trajectories/s for every setting and seed, from ``fitted`` alone."""
    from rollart.sim import simulate

    return {s.name: {seed: simulate(setting_sim(setting_graph(base, s, model, steps, groups,
                                                              seed), fitted, steps))
                     .throughput["trajectories_s"] for seed in seeds}
            for s in settings}


def errors(real: dict, sim: dict) -> dict:
    """Per setting, |median simulated − median real| ÷ median real over the seeds."""
    out = {}
    for name, runs in real.items():
        r = statistics.median(runs.values())
        out[name] = abs(statistics.median(sim[name].values()) - r) / r
    return out


def heldout_calibration(model: str, steps: int = 10, groups: int = 12, seeds=(1, 2, 3),
                        settings=HELDOUT, fit_seed: int = FIT_SEED, log=print) -> dict:
    """One invocation: fit on ``FIT``'s probes (seeds ``fit_seed``…), run ``FIT`` and
    ``settings`` for real on ``seeds``, predict them, on a cluster of its own.

    Returns ``real`` and ``sim`` (``{name: {seed: trajectories/s}}``), ``errors`` (per
    setting, ``FIT`` included), ``calibration_error_heldout`` (the median of
    ``settings``' errors), ``calibration_error_heldout_max``, ``calibration_error_fit``
    (``FIT``'s own), ``seeds``, ``fit_seed`` and ``wall_s``."""
    from distributed import Client

    import rollart

    t0 = time.time()
    base = base_graph()
    with tempfile.TemporaryDirectory() as tmp, \
            rollart.load_resources("laptop").make_cluster() as cluster, Client(cluster) as client:
        fitted = fit(client, base, model, groups, Path(tmp), seed=fit_seed, log=log)
        real = real_runs(client, base, model, (FIT, *settings), steps, groups, seeds,
                         Path(tmp), log=log)
    sim = predictions(base, model, fitted, (FIT, *settings), steps, groups, seeds)
    errs = errors(real, sim)
    for name in real:
        log(f"{name}: real {statistics.median(real[name].values()):.2f} sim "
            f"{statistics.median(sim[name].values()):.2f} traj/s (median of "
            f"{len(seeds)} seeds), error {errs[name]:.3f}")
    held = [errs[s.name] for s in settings]
    return {"real": real, "sim": sim, "errors": errs,
            "calibration_error_heldout": statistics.median(held),
            "calibration_error_heldout_max": max(held),
            "calibration_error_fit": errs[FIT.name], "seeds": list(seeds),
            "fit_seed": fit_seed, "wall_s": time.time() - t0}


def summarise(invocations: list[dict], names, within: float = WITHIN) -> dict:
    """The reported figures of several invocations' ``errors`` (``{setting: relative
    error}`` each, ``FIT``'s in-sample one among them) over the held-out ``names``:

    ``heldout_within_015``: the smallest count, over invocations, of configurations
    within ``within``; ``heldout_worst``: the largest error of any configuration in any
    invocation; ``invocations``; ``heldout_configs`` (per invocation); then per
    invocation ``i`` (from 1) ``heldout_within_015_<i>``, ``heldout_worst_<i>`` and
    ``heldout_missed_<i>`` (the names beyond ``within``, comma-separated, or ``none``);
    last ``calibration_error_heldout`` (the median of every held-out error of every
    invocation: the figure of the records before, one invocation's median, when there
    is one) and ``calibration_error_fit`` (the fit's largest in-sample error). An error
    that is not a number (a run that could not be compared) counts as a miss."""
    names = list(names)
    if not invocations or not names:
        raise ValueError("summarise needs at least one invocation and one configuration")
    per = []
    for errs in invocations:
        missing = [n for n in names if n not in errs]
        if missing:
            raise ValueError(f"an invocation has no error for {missing}")
        held = {n: errs[n] for n in names}
        missed = [n for n, e in held.items() if not e <= within]  # nan: a miss
        worst = max(held.values(), key=lambda e: math.inf if e != e else e)
        per.append((len(names) - len(missed), worst, missed))
    out = {"heldout_within_015": min(c for c, _, _ in per),
           "heldout_worst": max((w for _, w, _ in per),
                                key=lambda e: math.inf if e != e else e),
           "invocations": len(per), "heldout_configs": len(names)}
    for i, (count, worst, missed) in enumerate(per, 1):
        out[f"heldout_within_015_{i}"] = count
        out[f"heldout_worst_{i}"] = worst
        out[f"heldout_missed_{i}"] = ",".join(missed) or "none"
    out["calibration_error_heldout"] = statistics.median(
        e for errs in invocations for n, e in errs.items() if n in names)
    fits = [errs[FIT.name] for errs in invocations if FIT.name in errs]
    out["calibration_error_fit"] = max(fits) if fits else math.nan
    return out
