"""Side by side with Hugging Face TRL: GRPOTrainer vs rollart sync vs rollart async.

One invocation, one warmed-up tiny model (``rollart.model`` + the format warm-up of
``rollart.trainer.warmup``), one multi-turn task (``gridnav``: walk to a goal on a 5×5
grid, up to 8 turns; ``--task guess`` for the number game), the same episode seeds in
the same order, and GRPO settings matched as far as the two allow: group size, groups
per step, learning
rate (constant), AdamW betas, clip ε, token-mean loss, group-normalised advantages, no
KL, sampling temperature 1, per-turn and per-episode token limits. TRL runs the task
through its ``environment_factory`` (``benchmarks/_trl_env.py``: the same token
sequences as rollart's); rollart runs it on the local tagged Dask cluster.

Two workloads, each run by TRL, rollart ``sync`` and rollart ``async`` back to back:

* ``no_latency`` — the env answers at once;
* ``latency`` — every env step first waits a heavy-tailed delay, as sandboxes and web
  tools do: lognormal with a 20 ms median and σ = 1.2 (mean 41 ms, p99 ≈ 0.33 s;
  ``rollart.env.faults.Latency``), drawn the same way for both trainers.

Runs are 80 trainer steps without latency and 25 with it (``Settings``). Per run it
prints the wall time to a target reward (smoothed over 5 steps, from the first full
window at step 5; counted from the first trainer step; set-up excluded for both), best
and final reward (mean of the last 5 steps), generated tokens/s, trajectories/s and wall
time; then one line

    RESULT speedup_no_latency=… speedup_latency=… …

where ``speedup_<workload>`` is TRL's time to the target ÷ rollart async's. When a run
of a workload misses ``--target``, that workload's runs are all timed to the best
smoothed reward every one of them reached (``target_used_<workload>``). A time to a
reward is a noisy figure (32 episodes a step), so the whole comparison is repeated from
``--seeds`` seeds (model, warm-up and episodes; default 3) and every RESULT figure is
the median over them; ``speedup_<workload>_each`` lists each seed's. Not a test:
figures are ratios measured side by side in one run. rollart runs on
``resources/laptop.py`` (rollout in one worker process, the trainer in another: the
layout for one small machine) with one inference pool; ``--resources local
--inference-pools H800,H20`` gives every role its own process instead. TRL is the
``bench`` extra::

    pip install torch==2.13.0 -e '.[bench]'
    python benchmarks/vs_trl.py --quick
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_trl_env.py

TASK = "gridnav"
WORKLOADS = ("no_latency", "latency")
RUNNERS = ("trl", "sync", "async")
WINDOW = 5  # steps in the smoothed reward


@dataclass(frozen=True)
class Settings:
    """What both trainers share.

    ``steps`` per run without latency, ``latency_steps`` with it: TRL's latency runs
    cost over 10× its runs without (its env steps wait one after another), and 25 steps
    there already separate the trainers by an order of magnitude, while without latency
    the runs must be long enough for the reward to climb well past its noise (32
    episodes a step) before a time to a target means anything.

    ``redundancy`` is rollart async's, latency workload only, off by default: redundant
    members are cancelled once the first ``group_size`` finish, and in gridnav the first
    to finish are the successful episodes (they end in fewer turns, so wait fewer
    delays): the trained batch's mean reward would then overstate the policy's and not
    compare with TRL's. ``--redundancy 1.5`` shows it anyway."""

    steps: int = 80
    latency_steps: int = 25
    group_size: int = 8
    groups_per_step: int = 4
    lr: float = 5e-4
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    seed: int = 0
    warmup_steps: int = 200
    target: float = 0.5
    redundancy: float = 1.0

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    def workload(self, name: str) -> "Settings":
        """These settings with ``steps`` the workload's own."""
        return replace(self, steps=self.latency_steps) if name == "latency" else self


def latency_faults(seed: int = 0):
    """The ``latency`` workload's env: a lognormal step delay (median 20 ms, σ 1.2)."""
    from rollart.env.faults import Faults, Latency

    return Faults(step=Latency("lognormal", seconds=0.02, sigma=1.2), seed=seed)


def group_seeds(seed: int, n_groups: int, n_tasks: int = 1) -> list[int]:
    """Episode seeds in the order rollart's pipeline draws them (``Pipeline.next_group``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        rng.choices(range(n_tasks))
        out.append(rng.randrange(1_000_000))
    return out


def fastest_threads(model, tok, task) -> int:
    """The faster of 1 thread and torch's default for this process's training steps.

    TRL trains in this process; on a shared 2-core machine two torch threads can be
    several times slower than one (they spin waiting for each other), so TRL gets
    whichever is faster now (rollart's workers use one thread each).
    """
    import copy

    import torch

    from rollart.trainer.warmup import run_warmup

    timing = {}
    for n in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        run_warmup(copy.deepcopy(model), tok, [task], steps=3, batch_size=32, lr=1e-9)
        timing[n] = time.perf_counter() - t0
    best = min(timing, key=timing.get)
    torch.set_num_threads(best)
    return best


def warm_model(path: Path, task, steps: int, seed: int = 0) -> tuple[str, int]:
    """The built-in tiny model after its format warm-up, shared by every run, and the
    torch thread count this process uses from then on (``fastest_threads``)."""
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model, load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup

    init = build_tiny_model(str(path / "init"), task_corpus([task]), seed=seed)
    model, tok = load_model(init), load_tokenizer(init)
    threads = fastest_threads(model, tok, task)
    run_warmup(model, tok, [task], steps=steps, batch_size=32, lr=3e-3, seed=seed)
    model.save_pretrained(path / "warm")
    tok.save_pretrained(path / "warm")
    return str(path / "warm"), threads


# -- TRL ------------------------------------------------------------------------------
def run_trl(model_dir: str, s: Settings, task, faults, out_dir: str, threads: int):
    """TRL's run in a fresh process (``_trl_env.run_trl``), so that neither its imports
    nor its GIL-heavy training touch the Dask scheduler that lives in this process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import asdict

    import _trl_env

    seeds = group_seeds(s.seed, s.steps * s.groups_per_step)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_trl_env.run_trl, model_dir, asdict(s), task.name, faults, seeds,
                           out_dir, threads).result()


# -- rollart --------------------------------------------------------------------------
def rollart_graph(s: Settings, task, model_dir: str, mode: str, redundancy: float,
                  pools: tuple[str, ...] = ("H800",)):
    from rollart import GRPO, Graph, Policy, Rollout

    algo = GRPO(group_size=s.group_size, groups_per_step=s.groups_per_step, lr=s.lr,
                clip_eps=s.clip_eps, max_grad_norm=s.max_grad_norm, kl_coef=0.0)
    return Graph(name=f"vs_trl-{mode}", tasks=(task,), policy=Policy(model=model_dir),
                 algo=algo, rollout=Rollout(redundancy=redundancy, inference_pools=pools),
                 steps=s.steps, seed=s.seed, mode=mode)


def run_rollart(client, model_dir: str, s: Settings, task, mode: str, redundancy: float,
                run_dir: Path, pools: tuple[str, ...] = ("H800",)) -> list[dict]:
    import rollart

    graph = rollart_graph(s, task, model_dir, mode, redundancy, pools)
    return rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                         eval_seeds=0).metrics


# -- figures --------------------------------------------------------------------------
def time_to(curve: list[tuple[float, float]], target: float) -> float:
    """First time the smoothed reward reaches ``target`` (nan if it never does)."""
    return next((t for t, v in curve if v >= target), math.nan)


def summarise(rows: list[dict], batch_size: int, target: float) -> dict:
    """Time to the target (smoothed reward), throughput, final reward, wall time.

    The smoothed curve starts at the first full window (step ``WINDOW``): before it a
    "mean over 5 steps" would be one or two batches, and a lucky first batch (32
    episodes) would count as reaching the target."""
    from rollart.report import smooth

    reward = smooth([r["reward/mean"] for r in rows], WINDOW)
    first = WINDOW - 1 if len(rows) >= WINDOW else 0
    curve = [(r["time"], v) for r, v in list(zip(rows, reward))[first:]]
    wall = rows[-1]["time"]
    return {"time_to_target_s": time_to(curve, target),
            "best_reward": max(v for _, v in curve),
            "final_reward": sum(r["reward/mean"] for r in rows[-5:]) / len(rows[-5:]),
            "tokens_per_s": rows[-1]["rollout/tokens_generated"] / wall,
            "traj_per_s": len(rows) * batch_size / wall, "wall_s": wall,
            "steps": len(rows), "curve": curve}


def ratios(runs: dict, target: float) -> dict:
    """Ratios of one workload's runs (TRL ÷ rollart for times, rollart ÷ TRL for rates).

    If a run missed ``target``, every run of the workload is timed to the best smoothed
    reward all of them reached instead, and ``target_used`` says so.
    """
    used = target
    if any(math.isnan(run["time_to_target_s"]) for run in runs.values()):
        used = min(run["best_reward"] for run in runs.values())
    t = {r: time_to(run["curve"], used) for r, run in runs.items()}
    trl, asyn = runs["trl"], runs["async"]
    return {"speedup": t["trl"] / t["async"], "sync_speedup": t["trl"] / t["sync"],
            "throughput_ratio": asyn["traj_per_s"] / trl["traj_per_s"],
            "tokens_ratio": asyn["tokens_per_s"] / trl["tokens_per_s"],
            "reward_gap": asyn["final_reward"] - trl["final_reward"],
            "target_used": used, **{f"t_{r}": v for r, v in t.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="one seed, 10 steps: about 3 minutes on 2 cores")
    p.add_argument("--steps", type=int, default=None,
                   help="trainer steps per run (both workloads; default 80 without latency)")
    p.add_argument("--latency-steps", type=int, default=None,
                   help="trainer steps per run with latency (default 25, or --steps)")
    p.add_argument("--redundancy", type=float, default=None,
                   help="rollart async's redundant members per group, latency workload "
                   "(default 1: none; see Settings)")
    p.add_argument("--target", type=float, default=None, help="smoothed reward to reach")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--groups-per-step", type=int, default=None)
    p.add_argument("--task", default=TASK, help="a built-in task name")
    p.add_argument("--seed", type=int, default=None, help="model, warm-up and episode seeds")
    p.add_argument("--seeds", type=int, default=None,
                   help="repeats from seeds seed, seed+1, ... (default 3; 1 with --quick): "
                   "the RESULT figures are medians over them")
    p.add_argument("--lr", type=float, default=None, help="both trainers' learning rate")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--resources", default="laptop",
                   help="rollart's layout (resources/NAME.py); laptop: rollout in one "
                   "worker, the trainer in another")
    p.add_argument("--inference-pools", default="H800",
                   help="comma-separated inference pool tags rollart's graph uses")
    p.add_argument("--in-process", action="store_true",
                   help="rollart's cluster as threads of this process (tests)")
    a = p.parse_args(argv)
    s = Settings()
    if a.quick:
        s = replace(s, steps=10, latency_steps=10, warmup_steps=100)
    given = {"steps": a.steps, "latency_steps": a.latency_steps or a.steps,
             "target": a.target, "warmup_steps": a.warmup_steps,
             "group_size": a.group_size, "groups_per_step": a.groups_per_step, "seed": a.seed,
             "lr": a.lr, "redundancy": a.redundancy}
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    workloads = [w for w in a.workloads.split(",") if w]

    from rollart.cli import quiet

    quiet()
    import warnings

    warnings.filterwarnings("ignore")
    from rollart.env.tasks import get_task

    base = get_task(a.task)
    t_all = time.time()
    seeds = [s.seed + k for k in range(a.seeds or (1 if a.quick else 3))]
    runs: dict = {}
    threads = 0
    per_seed = []
    for seed in seeds:
        runs[seed], threads = run_seed(replace(s, seed=seed), base, workloads, a)
        per_seed.append({f"{k}_{w}": v for w in workloads
                         for k, v in ratios(runs[seed][w], s.target).items()})
        print(f"seed {seed}: " + " ".join(f"speedup_{w}={per_seed[-1][f'speedup_{w}']:.3g}"
                                          for w in workloads), flush=True)
    figures = combine(per_seed)
    figures = {**{k: figures.pop(k) for k in list(figures) if k.startswith("speedup_")},
               **figures}  # the two headline figures first
    figures.update({"seeds": "/".join(map(str, seeds)),
                    **{f"steps_{w}": s.workload(w).steps for w in workloads},
                    "redundancy": s.redundancy,
                    "target": s.target, "trl_threads": threads, "resources": a.resources,
                    "inference_pools": a.inference_pools.replace(",", "+"),
                    "total_s": round(time.time() - t_all)})
    print("RESULT " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in figures.items()))
    return {"runs": runs[seeds[0]], "seeds": runs, "result": figures}


def combine(per_seed: list[dict]) -> dict:
    """One figure per key over seeds: the median; for the speedups also each seed's
    value (``speedup_<workload>_each``, in seed order), since one seed's time to a
    target is a noisy figure.

    >>> combine([{"speedup_a": 1.0, "x": 2.0}, {"speedup_a": 3.0, "x": 4.0},
    ...          {"speedup_a": 2.0, "x": 9.0}])
    {'speedup_a': 2.0, 'x': 4.0, 'speedup_a_each': '1/3/2'}
    """
    import statistics

    out = {k: statistics.median(d[k] for d in per_seed) for k in per_seed[0]}
    if len(per_seed) > 1:
        out.update({f"{k}_each": "/".join(f"{d[k]:.3g}" for d in per_seed)
                    for k in per_seed[0] if k.startswith("speedup_")})
    return out


def run_seed(s: Settings, base, workloads: list[str], a) -> tuple[dict, int]:
    """Every runner on every workload from one seed's warmed-up model: TRL first (in a
    child process, with no Dask workers idling beside it), then rollart sync and async
    on a fresh cluster. Returns ``({workload: {runner: summary}}, TRL's threads)``."""
    from distributed import Client

    import rollart
    from rollart.env.faults import with_faults

    out: dict = {w: {} for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        model, threads = warm_model(tmp / "model", base, s.warmup_steps, s.seed)
        print(f"warm-up: {s.warmup_steps} steps in {time.time() - t0:.0f}s; TRL uses "
              f"{threads} torch thread(s); {s}", flush=True)
        faults = {w: latency_faults(s.seed) if w == "latency" else None for w in workloads}

        def record(w, r, rows, t0):
            out[w][r] = summarise(rows, s.batch_size, s.target)
            print(f"{w:10s} {r:5s} " + " ".join(
                f"{k}={v:.3g}" for k, v in out[w][r].items() if k != "curve")
                + f" (run {time.time() - t0:.0f}s)", flush=True)

        for w in workloads:
            t0 = time.time()
            record(w, "trl", run_trl(model, s.workload(w), base, faults[w],
                                     str(tmp / f"trl-{w}"), threads), t0)
        res = rollart.load_resources(a.resources)
        pools = tuple(t for t in a.inference_pools.split(",") if t)
        if a.in_process:
            res = replace(res, processes=False, dashboard_address=":0")
        with res.make_cluster() as cluster, Client(cluster) as client:
            for w in workloads:
                task = with_faults(base, faults[w]) if faults[w] else base
                for r in ("sync", "async"):
                    t0 = time.time()
                    red = s.redundancy if (r == "async" and faults[w]) else 1.0
                    rows = run_rollart(client, model, s.workload(w), task, r, red,
                                       tmp / f"{r}-{w}", pools)
                    record(w, r, rows, t0)
    return out, threads


if __name__ == "__main__":
    main()
