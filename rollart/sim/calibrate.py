"""Check the simulator against real runs: this laptop measured, then real runs and the
simulator's predictions of them side by side.

Consumes the micro-benchmarks of ``rollart.sim.measure``, ``resources/laptop.py`` and
the default graph; produces ``laptop_sim_config`` (the simulator configured as this
laptop) and the calibration table (``calibration``). Called by
``benchmarks/cluster_sim.py`` and tests.

The order keeps prediction honest: ``measure_control_plane`` and ``measure_engine``
are micro-benchmarks (an actor ping, a task, the engine at fixed batch sizes, trainer
updates, alone): they give each cost's shape. Then, for each mode, a 3-step probe of
that mode on other seeds just before the run it stands for gives what the mode adds on
this shared machine: the trainer's step as that mode runs it (``in_situ_trainer``) and
the engine's busy time per admitted request beyond what the simulator makes of the
probe (``in_situ_engine``: the serving loop, the trainer beside rollout, the rollout
processes' nice value in async, the other agents' load at that moment). The sync probe
(no redundant members) also gives the workload's shape (each trajectory's turns and
tokens, ``measure_shapes``), and a run with one trajectory live at a time the env
manager's per-turn loop time (its ``rollout/turn_overhead_s``). Only then is each real
run made, and the simulator, configured as this laptop from the measurements alone,
predicts it. Probe and run are repeated over three seeds, as ``benchmarks/pipeline.py``
runs each mode, and the figures compared are the benchmark's: the median over the
seeds per mode, and async ÷ sync of those medians (one 8-step run's own async ÷ sync
read 2.38, 2.98 and 2.52 on one quiet machine and one commit: a single run is too noisy
to hold a 15% bound). Nothing is fitted to the runs being predicted. One figure is read
during each run (and each probe): the kernel's CPU stretch of rollart's threads ((run +
run-queue wait) / run, ``rollart.sim.contention``), which says how much the machine's
other load slowed every CPU cost; the prediction scales the laptop's CPU costs by the
run's stretch over its probe's, per process (the rollout worker's, the trainer's; a
stated model, no fit), and the prediction at the probe's stretch is reported beside it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from math import nan
from pathlib import Path

from rollart.sim.contention import cluster_clocks, roles, scaled, stretches
from rollart.sim.costs import ControlPlane
from rollart.sim.measure import (EngineFit, in_situ_trainer, measure_control_plane,
                                 measure_engine, measure_shapes, measure_turn_overhead)

__all__ = ["EngineFit", "calibration", "laptop_sim_config", "measure_control_plane",
           "measure_engine", "measure_real", "measure_shapes", "measure_turn_overhead",
           "predict"]


# -- the simulator configured as this laptop ----------------------------------------------
OVERLAPPING_MODES = ("async", "one-off", "areal")  # trainer steps while rollout runs


def laptop_sim_config(graph, fits: dict, control: ControlPlane, shapes: dict,
                      steps: int, mode: str, seed: int = 0, turn_s: float = 0.0,
                      env=None):
    """``resources/laptop.py`` as a ``SimConfig``: one inference worker per inference
    tag the runtime places one on (``rollart.policy.affinity.inference_tags``: the
    graph's pools and its tasks' affinities, a PD split's two among them), each the CPU
    engine batching ``Policy.max_batch``, one env manager
    with ``Rollout.env_concurrency`` slots, one reward slot on the rollout worker, the
    trainer on a process of its own; costs from ``measure_engine`` with each mode's
    in-situ figures (``fits["lockstep"]`` for modes that stop rollout while training,
    from the sync probe; ``fits["overlapping"]`` for those that train while rolling
    out, from the async probe) and ``measure_control_plane``
    (generation calls ``near``: the env manager and the inference worker share one
    process, ``rollart.runtime.near``; buffer, trainer and driver calls are actor round trips);
    ``turn_s``: each turn's hold on the env manager's loop (``measure_turn_overhead``);
    ``env``: the envs' cost (default: the straggler profile, ``laptop_env``; the
    pipeline benchmark's sandboxes: a fresh ``rollart.sim.sandbox.SandboxPoolCost``)."""
    fit = fits[_fit_key(mode)]
    from rollart.policy.affinity import inference_tags
    from rollart.sim.config import ClusterSpec, EnvPool, GPUPool, RewardPool, SimConfig
    from rollart.types import CPU_ENV

    pools = tuple(GPUPool(tag, "cpu", 1, max_batch=graph.policy.max_batch)
                  for tag in inference_tags(graph))
    cluster = ClusterSpec(pools, (EnvPool(CPU_ENV, graph.rollout.env_concurrency),),
                          RewardPool("dedicated", workers=1), trainer_gpus=1,
                          trainer_gpu="cpu")
    costs = replace(fit.costs(replace(control, near=True)), manager_turn_s=turn_s)
    if env is not None:
        costs = replace(costs, env={"*": env})
    return SimConfig(cluster, graph, costs=costs, shapes=shapes, seed=seed, steps=steps,
                     mode=mode)


# -- (c) the calibration: real runs beside the simulator ------------------------------------
def _warm_model(tmp: Path, tasks, steps: int) -> str:
    """The built-in tiny model after its format warm-up (as benchmarks/pipeline.py)."""
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model, load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup

    init = build_tiny_model(str(tmp / "init"), task_corpus(tasks))
    model, tok = load_model(init), load_tokenizer(init)
    run_warmup(model, tok, list(tasks), steps=steps, batch_size=32, lr=3e-3)
    model.save_pretrained(tmp / "warm")
    tok.save_pretrained(tmp / "warm")
    return str(tmp / "warm")


def _graph(base, tasks, model: str, mode: str, steps: int, redundancy: float, seed: int):
    return replace(base, tasks=tasks, mode=mode, steps=steps, seed=seed,
                   policy=replace(base.policy, model=model),
                   rollout=replace(base.rollout,
                                   redundancy=redundancy if mode == "async" else 1.0))


def _real_throughput(rows: list[dict]) -> float:
    """Trained trajectories per second, as benchmarks/pipeline.py reports it."""
    return rows[-1]["traj/trained"] / rows[-1]["time"]


def _lone_turn_s(base, tasks, model: str, client, tmp: Path, seed: int) -> float:
    """The env manager's per-turn loop time with one trajectory live at a time
    (``env_concurrency=1``, 2 groups a step, 2 steps, other seeds): no other turn to
    queue behind on its loop and an idle engine while it runs, so the probe's
    ``rollout/turn_overhead_s`` (``measure_turn_overhead``) is the turn's own Python,
    which the simulator then queues on the loop and serialises with the engine."""
    import rollart

    g = _graph(base, tasks, model, "async", 2, 1.0, seed)
    g = replace(g, algo=replace(g.algo, groups_per_step=2),
                rollout=replace(g.rollout, env_concurrency=1))
    rows = rollart.train(g, client=client, run_dir=tmp / "lone", progress=False,
                         eval_seeds=0).metrics
    return measure_turn_overhead(rows)


def in_situ_engine(fits: dict, control: ControlPlane, shapes: dict, turn_s: float,
                   probe, rows: list[dict], env=None) -> dict:
    """``fits`` with the engine's per-request cost beside rollout, from a probe run of
    ``probe.mode`` (its own seeds, just before the run it stands for): its engine's busy
    seconds per request it admitted (the last row's ``rollout/engine_busy_s /
    rollout/requests``) less what the simulator, configured from ``fits`` alone, makes
    of that same probe (busy + GIL stalls per admitted request, ``SimWorker.admitted``),
    as ``GenCost.request_overhead_s`` on the fit that mode uses (``lockstep`` for the
    modes that stop rollout while training, ``overlapping`` for those that train while
    rolling out). One unit on
    both sides, the one the simulator charges it in: a request admitted (a cancelled
    redundant member's request costs the engine as a completed turn's does). ``env``:
    the probe's env cost as ``laptop_sim_config`` takes it."""
    from rollart.sim import simulate

    last = rows[-1]
    if "rollout/requests" not in last:
        raise KeyError("the probe's metrics have no rollout/requests (the engines' "
                       "admitted requests): run it with this rollart's pipeline stats")
    real = last["rollout/engine_busy_s"] / max(last["rollout/requests"], 1)
    r = simulate(laptop_sim_config(probe, fits, control, shapes, len(rows), probe.mode,
                                   probe.seed, turn_s, env))
    sim = (r.extra["engine_busy_s"] + r.extra["engine_stalled_s"]) / \
        max(r.extra["requests"], 1)
    key = _fit_key(probe.mode)
    f = fits[key]
    return {**fits, key: replace(f, gen=replace(f.gen, request_overhead_s=max(0.0, real - sim)))}


def _fit_key(mode: str) -> str:
    return "overlapping" if mode in OVERLAPPING_MODES else "lockstep"


# -- per-component figures: where each run's time went, real beside simulated -----------------
def real_components(rows: list[dict]) -> dict:
    """A real run's figures by component from its metrics rows (cumulative counters in
    the last row): wall seconds, the engine's busy share and busy ms per admitted
    request, requests and completed turns, the trainer's step beside rollout and its
    wait (medians, first step left out), members launched / cancelled / failed, trained."""
    import statistics

    last, later = rows[-1], rows[1:] or rows
    wall = last["time"]
    busy = last["rollout/engine_busy_s"]
    req = last.get("rollout/requests", 0)
    return {"wall_s": wall, "step_s": wall / len(rows), "engine_busy": busy / wall,
            "busy_ms_per_request": 1e3 * busy / max(req, 1), "requests": req,
            "turns": last["rollout/turns"],
            "train_s": statistics.median(r["trainer/step_s"] - r["trainer/wait_s"]
                                         for r in later),
            "train_wait_s": statistics.median(r["trainer/wait_s"] for r in later),
            "launched": last["traj/launched"], "cancelled": last["traj/cancelled"],
            "failed": last["traj/failed"], "trained": last["traj/trained"]}


def sim_components(r) -> dict:
    """``real_components``'s figures from a ``SimResult`` (the engine's busy includes its
    GIL stalls, as the real engine's busy clock does; the trainer's step is its busy
    time a step; its wait is not tracked and left as ``nan``)."""
    x = r.extra
    busy = x["engine_busy_s"] + x["engine_stalled_s"]
    wall = r.sim_time_s
    return {"wall_s": wall, "step_s": wall / max(r.steps, 1),
            "engine_busy": busy / wall if wall else 0.0,
            "busy_ms_per_request": 1e3 * busy / max(x["requests"], 1),
            "requests": x["requests"], "turns": x["turns"],
            "train_s": r.utilisation["trainer"] * wall / max(r.steps, 1),
            "train_wait_s": float("nan"), "launched": r.aborts["launched"],
            "cancelled": r.aborts["cancelled"], "failed": r.aborts["failed"],
            "trained": r.trained}


def components_table(real: dict, sim: dict) -> str:
    """One line per figure: real and simulated per mode (``{mode: components}``)."""
    keys = list(next(iter(real.values())))
    lines = ["figure " + " ".join(f"{m}:real {m}:sim" for m in real)]
    for k in keys:
        cells = []
        for m in real:
            for v in (real[m][k], sim.get(m, {}).get(k, float("nan"))):
                cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append(f"{k} " + " ".join(cells))
    return "\n".join(lines)


def measure_real(quick: bool = True, steps: int | None = None,
                 warmup_steps: int | None = None, redundancy: float = 1.5, seed: int = 0,
                 rounds: int = 3, log=print) -> dict:
    """Steps (1)–(3) of ``calibration``: the micro-benchmarks, then ``rounds`` rounds of
    probe and real run per mode (seeds ``seed``, ``seed + 1``, …, as
    ``benchmarks/pipeline.py`` runs every mode on each of its seeds). Returns
    ``control``, ``shapes`` and ``turn_s`` (``_lone_turn_s``), measured once, ``steps``,
    and ``rounds``: per round its ``seed``, ``fits`` (``lockstep``, ``overlapping``:
    ``measure_engine`` with that round's sync / async probe's in-situ figures), ``real``
    (trained trajectories/s per mode), ``graphs`` (the graph each mode ran), ``rows``
    (the runs' metrics), ``probe_rows`` and ``stretch`` (per mode, probe and run)."""
    from distributed import Client

    import rollart
    from rollart.app.cli import quiet
    from rollart.chaos.faults import straggler_profile, with_faults

    quiet()
    steps = steps or (8 if quick else 20)
    base, _ = rollart.load_graph("multitask")
    base = replace(base, rollout=replace(base.rollout, inference_pools=("H800",)))
    if warmup_steps is None:  # the format warm-up; quick: a shorter one (both modes and
        warmup_steps = 100 if quick else base.policy.warmup_steps  # the probe share it)
    tasks = tuple(with_faults(t, straggler_profile(seed=i)) for i, t in enumerate(base.tasks))
    res = rollart.load_resources("laptop")
    # one micro-benchmark of the engine and trainer, alone: the shape of their costs
    # (per decode step, per row, per prefill token; per trained token). What each mode
    # adds on this shared machine (the trainer beside rollout, the rollout processes'
    # nice value, the serving loop) comes from that mode's probe below, onto the fit
    # of the modes it stands for
    alone = measure_engine()
    log(f"engine fit: decode {_fmt(alone.decode_points)} prefill "
        f"{_fmt(alone.prefill_points)} train {_fmt(alone.train_points)} "
        f"fit_error={alone.fit_error:.3f}")
    done = []
    with tempfile.TemporaryDirectory() as tmp, res.make_cluster() as cluster, \
            Client(cluster) as client:
        control = measure_control_plane(client)
        log(f"control plane: actor {control.actor_call_s * 1e3:.2f} ms, task "
            f"{control.task_s * 1e3:.2f} ms, scheduler {control.scheduler_tasks_s:.0f} "
            "tasks/s")
        model = _warm_model(Path(tmp), base.tasks, warmup_steps)
        shapes, turn_s = None, 0.0
        procs = roles(client)  # the rollout worker's and the trainer's processes
        for t in range(rounds):
            run_seed, fits = seed + t, {"lockstep": alone, "overlapping": alone}
            real, graphs, real_rows, probes, stretch = {}, {}, {}, {}, {}
            for i, mode in enumerate(("sync", "async")):
                # each mode's probe (3 steps, other seeds) just before the run it stands
                # for: the trainer's step and the engine's per-request cost as that mode
                # runs them on this machine now; the first sync probe (no redundant
                # members) also gives the shapes, its samples being the tasks' episodes
                # unselected (with extras the fastest are kept and the long ones
                # cancelled)
                probe = _graph(base, tasks, model, mode, 3, redundancy,
                               run_seed + 1000 * (i + 1))
                where = Path(tmp) / f"probe-{mode}-{t}"
                rows, probe_stretch = _timed_train(client, probe, where, procs)
                stretch[mode], probes[mode] = {"probe": probe_stretch}, rows
                if shapes is None:
                    shapes = measure_shapes(where)
                    turn_s = _lone_turn_s(base, tasks, model, client, Path(tmp), seed + 9000)
                    log("shapes (first sync probe): " + ", ".join(
                        f"{k}={replace(v, episodes=len(v.episodes))}"
                        for k, v in shapes.items()))
                key = _fit_key(mode)
                fits[key] = in_situ_trainer(fits[key], rows, shapes, base.algo.batch_size)
                fits = in_situ_engine(fits, control, shapes, turn_s, probe, rows)
                log(f"[{t + 1}/{rounds}] probe {mode}: trainer in situ: "
                    f"{fits[key].train.overhead_s:.3f}s overhead a step; env manager loop: "
                    f"{turn_s * 1e3:.2f} ms a turn; engine in situ: "
                    f"{fits[key].gen.request_overhead_s * 1e3:.2f} ms a request")
                graphs[mode] = _graph(base, tasks, model, mode, steps, redundancy, run_seed)
                real_rows[mode], stretch[mode]["run"] = _timed_train(
                    client, graphs[mode], Path(tmp) / f"{mode}-{t}", procs)
                real[mode] = _real_throughput(real_rows[mode])
                log(f"[{t + 1}/{rounds}] real {mode} (seed {run_seed}): {real[mode]:.2f} "
                    f"traj/s over {real_rows[mode][-1]['time']:.1f}s; CPU stretch (run + "
                    f"wait) / run, probe / run: {_stretch_fmt(stretch[mode])}")
            done.append({"seed": run_seed, "fits": fits, "real": real, "graphs": graphs,
                         "rows": real_rows, "probe_rows": probes, "stretch": stretch})
    return {"control": control, "shapes": shapes, "turn_s": turn_s, "steps": steps,
            "rounds": done}


def _timed_train(client, graph, run_dir: Path, procs: dict) -> tuple[list, dict]:
    """``rollart.train`` of ``graph`` on ``client`` (no held-out evaluation): its metrics
    rows and the CPU stretch of the processes ``procs`` names over it (``stretches``)."""
    import rollart

    clocks = cluster_clocks(client)
    rows = rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                         eval_seeds=0).metrics
    return rows, stretches(clocks, cluster_clocks(client), procs)


def _stretch_fmt(s: dict) -> str:
    return ", ".join(f"{role} {s['probe'].get(role, nan):.3f} / {s['run'].get(role, nan):.3f}"
                     for role in ("rollout", "trainer"))


def _fmt(points: dict) -> str:
    return "{" + ", ".join(f"{k}: {v * 1e3:.1f}ms" for k, v in points.items()) + "}"


def predict(measured: dict, trial: dict, log=print) -> dict:
    """Step (4) for one round of ``measured["rounds"]``: the simulator configured from
    ``measured`` (``measure_real``'s micro-benchmarks, shapes and that round's probes,
    not its real figures) per mode, the laptop's CPU costs scaled by the run's CPU
    stretch over its probe's (``rollart.sim.contention.scaled``); trajectories/s, and
    ``sim_probe_stretch``: the same unscaled."""
    from rollart.sim import simulate

    sim, results, plain = {}, {}, {}
    for mode, graph in trial["graphs"].items():
        fits, control = dict(trial["fits"]), measured["control"]
        turn_s, key = measured.get("turn_s", 0.0), _fit_key(mode)
        args = (measured["shapes"], measured["steps"], mode, trial["seed"])
        r = simulate(laptop_sim_config(graph, fits, control, *args, turn_s))
        plain[mode] = r.throughput["trajectories_s"]
        # the CPU costs at the run's contention: run stretch / probe stretch (the model
        # of rollart.sim.contention); 1 where there is no schedstat
        s = trial.get("stretch", {}).get(mode, {})
        k = {role: s.get("run", {}).get(role, nan) / s.get("probe", {}).get(role, nan)
             for role in ("rollout", "trainer")}
        fits[key], control, turn_s = scaled(fits[key], control, turn_s, k["rollout"],
                                            k["trainer"])
        results[mode] = simulate(laptop_sim_config(graph, fits, control, *args, turn_s))
        sim[mode] = results[mode].throughput["trajectories_s"]
        log(f"seed {trial['seed']}: sim {mode}: {sim[mode]:.2f} traj/s at the run's CPU "
            f"stretch (rollout x{k['rollout']:.3f}, trainer x{k['trainer']:.3f} the "
            f"probe's), {plain[mode]:.2f} at the probe's ({results[mode].summary()})")
    return {"sim": sim, "results": results, "sim_probe_stretch": plain}


def _figures(per_mode: list[dict]) -> dict:
    """Median trajectories/s per mode over rounds, and async ÷ sync of the medians (as
    ``benchmarks/pipeline.py`` reports ``throughput_vs_sync``)."""
    out = {m: statistics.median(d[m] for d in per_mode) for m in per_mode[0]}
    out["async_vs_sync"] = out["async"] / out["sync"]
    return out


def _errors(sim: dict, real: dict) -> dict:
    return {k: abs(sim[k] - real[k]) / real[k] for k in real}


def calibration(quick: bool = True, log=print, **options) -> dict:
    """Measure, probe, run for real, simulate; return the figures side by side.

    On ``resources/laptop.py`` with the default multitask graph, one inference pool
    (H800) and straggling envs (``straggler_profile(seed=i)`` per task), as
    ``benchmarks/pipeline.py`` runs it: (1) control-plane and engine micro-benchmarks
    (alone), then ``rounds`` rounds (3; seeds 0, 1, 2) of (2) per mode, a 3-step probe
    of that mode on other seeds (the trainer's step, ``in_situ_trainer``; the engine's
    per-request cost, ``in_situ_engine``; the first sync probe also the tasks' episodes,
    ``measure_shapes``, followed by a run with one trajectory live at a time for the env
    manager's per-turn loop time, ``_lone_turn_s``), then (3) that mode's real run
    (``sync``; ``async`` with 1.5× members); (4) per round the simulator configured from
    (1) and that round's (2), its CPU costs at each run's CPU stretch over its probe's
    (``predict``). The figures compared are the benchmark's: per mode the median over
    the rounds of trajectories/s, real beside simulated, and async ÷ sync of those
    medians. ``options`` go to ``measure_real`` (``rounds``; ``save``: a path for the
    measurements, cloudpickled). Returns ``real``, ``sim``, ``errors`` (relative:
    throughput per mode and async ÷ sync), ``calibration_error`` (the largest), the same
    at the probes' stretch (``sim_probe_stretch``, ``errors_probe_stretch``,
    ``calibration_error_probe_stretch``), ``round_errors`` (each round's own largest
    error, real beside its own prediction), ``stretch`` (per round and mode, probe and
    run) and ``components`` (``real_components`` / ``sim_components`` per round and
    mode)."""
    t0 = time.time()
    save = options.pop("save", None)
    measured = measure_real(quick, log=log, **options)
    if save:  # the measurements, to look at the prediction again without re-running
        import cloudpickle

        Path(save).write_bytes(cloudpickle.dumps(measured))
    rounds = measured["rounds"]
    predicted = [predict(measured, tr, log=log) for tr in rounds]
    comps = []
    for tr, p in zip(rounds, predicted):
        comps.append({"real": {m: real_components(rs) for m, rs in tr["rows"].items()},
                      "sim": {m: sim_components(r) for m, r in p["results"].items()}})
        log(f"components, seed {tr['seed']} (real beside simulated):\n"
            + components_table(comps[-1]["real"], comps[-1]["sim"]))
    real = _figures([tr["real"] for tr in rounds])
    sim = _figures([p["sim"] for p in predicted])
    plain = _figures([p["sim_probe_stretch"] for p in predicted])
    errors, plain_errors = _errors(sim, real), _errors(plain, real)
    round_errors = [max(_errors(_figures([p["sim"]]), _figures([tr["real"]])).values())
                    for tr, p in zip(rounds, predicted)]
    log("per round (real beside its own prediction): calibration_error "
        + ", ".join(f"seed {tr['seed']} {e:.3f}" for tr, e in zip(rounds, round_errors)))
    return {"real": real, "sim": sim, "errors": errors,
            "calibration_error": max(errors.values()),
            "sim_probe_stretch": plain, "errors_probe_stretch": plain_errors,
            "calibration_error_probe_stretch": max(plain_errors.values()),
            "round_errors": round_errors,
            "stretch": [tr["stretch"] for tr in rounds],
            "engine_fit_error": max(f.fit_error for tr in rounds
                                    for f in tr["fits"].values()),
            "control": measured["control"], "turn_s": measured["turn_s"],
            "shapes": measured["shapes"], "steps": measured["steps"],
            "results": [p["results"] for p in predicted], "components": comps,
            "wall_s": time.time() - t0}
