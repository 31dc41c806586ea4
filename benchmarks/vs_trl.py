"""Side by side with Hugging Face TRL: GRPOTrainer vs rollart ``sync+``, ``sync`` and
``async``, timed to a held-out success fixed in advance.

One invocation, one warmed-up tiny model (``rollart.model`` + the format warm-up of
``rollart.trainer.warmup``), one multi-turn task (``gridnav``: walk to a goal on a 5×5
grid, up to 8 turns; ``--task guess`` for the number game), the same episode seeds in
the same order, and GRPO settings matched as far as the two allow: group size, groups
per step, learning rate (constant), AdamW betas, clip ε, token-mean loss,
group-normalised advantages, no KL, sampling temperature 1, per-turn and per-episode
token limits. TRL runs the task through its ``environment_factory``
(``benchmarks/_trl_env.py``: the same token sequences as rollart's); rollart runs it on
the local tagged Dask cluster.

**The target is a held-out success fixed before any run** (``Settings.target``, 0.5 on
gridnav: between the warm-up policy's ~0.3 and the optimal player's 1.0,
``benchmarks/baselines.py``), the same for every runner and never lowered after a run.
Every runner saves its policy every ``eval_every`` steps (TRL: ``save_pretrained`` from
a callback; rollart: its checkpoints, ``Graph.checkpoint_every``), both inside the timed
window; after all runs, outside it, every snapshot is evaluated on the same held-out
seeds (``rollart.observe.evaluate`` on ``rollart.env.scripted.heldout_seeds``: the seeds
``rollart train`` evaluates on) and mapped to the wall time its step finished (counted
from the first trainer step; set-up excluded for both). A runner's time to the target
is the first snapshot at or above it; a runner that never gets there within its steps
has no time (``nan``) and no speed-up: reported as missed, not re-targeted.

Workloads (``--workloads``): ``no_latency`` (the env answers at once; the default) and
``latency`` (every env step first waits a lognormal delay, 20 ms median, σ 1.2: p99 ≈
0.33 s, as sandboxes and web tools do; TRL steps its envs one after another, so its runs
there cost ~10× more). The rollart modes run in a shuffled order per seed, on one
cluster, after TRL (in a child process). One line::

    RESULT speedup_async_no_latency=… speedup_syncplus_no_latency=… …

``speedup_<mode>_<workload>`` = TRL's time to the target ÷ that rollart mode's
(> 1: rollart sooner), ``t_<runner>`` the times, ``heldout_<runner>`` the last
snapshot's held-out success, ``throughput_<mode>`` trained trajectories/s ÷ TRL's,
``best_mode`` the rollart mode with the shortest median time, ``trl_faster_than`` the
modes TRL beat on the median; medians over ``--seeds`` seeds (3 by default, ``_each``:
each seed's). rollart runs on ``resources/laptop.py`` (rollout in one worker process,
the trainer in another: the layout for one small machine) with one inference pool.
TRL is the ``bench`` extra::

    pip install torch==2.13.0 -e '.[bench]'
    python benchmarks/vs_trl.py --quick        # 1 seed, 10 steps: a few minutes
    python benchmarks/vs_trl.py --seeds 1 --seed 0   # one seed of the full run
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _trl_env.py, _vs_trl_figures.py

from _results import Run, add_arguments  # noqa: E402

from _vs_trl_figures import (MODES, SETTING_KEYS, aggregate, aggregate_files,  # noqa: E402,F401
                             combine, key, parse_result, ratios, speedup, summarise,
                             time_to, verdict)

TASK = "gridnav"
WORKLOADS = ("no_latency", "latency")
RUNNERS = ("trl",) + MODES


@dataclass(frozen=True)
class Settings:
    """What every runner shares, fixed before a run.

    ``target``: the held-out success to reach (gridnav: the warm-up policy is at ~0.3,
    the optimal player at 1.0). ``eval_every``: steps between policy snapshots (and the
    last step); ``eval_seeds``: held-out episodes per snapshot. ``steps`` per run without
    latency, ``latency_steps`` with it (TRL's latency runs cost ~10× its others).

    ``redundancy`` is rollart async's, latency workload only, off by default: redundant
    members are cancelled once the first ``group_size`` finish, and in gridnav the first
    to finish are the successful episodes (fewer turns, fewer delays), so the trained
    batch would favour them. ``--redundancy 1.5`` shows it anyway."""

    steps: int = 60
    latency_steps: int = 20
    group_size: int = 8
    groups_per_step: int = 4
    lr: float = 5e-4
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    seed: int = 0
    warmup_steps: int = 200
    target: float = 0.5
    eval_every: int = 10
    eval_seeds: int = 64
    redundancy: float = 1.0
    conversation: str = "raw"

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    def workload(self, name: str) -> "Settings":
        """These settings with ``steps`` the workload's own."""
        return replace(self, steps=self.latency_steps) if name == "latency" else self


def latency_faults(seed: int = 0):
    """The ``latency`` workload's env: a lognormal step delay (median 20 ms, σ 1.2)."""
    from rollart.chaos.faults import Faults, Latency

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


def warm_model(path: Path, task, steps: int, seed: int = 0,
               conversation: str = "raw") -> tuple[str, int]:
    """The built-in tiny model after its format warm-up, shared by every run, and the
    torch thread count this process uses from then on (``fastest_threads``).
    ``conversation="chat"``: the chat toy (byte-level BPE, ChatML template:
    ``build_tiny_model(chat=True)``) warmed up in chat form."""
    from rollart.corpus import chat_corpus
    from rollart.env.tasks import task_corpus
    from rollart.model import build_tiny_model, load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup

    chat = conversation == "chat"
    corpus = chat_corpus([task]) if chat else task_corpus([task])
    init = build_tiny_model(str(path / "init"), corpus, chat=chat, seed=seed)
    model, tok = load_model(init), load_tokenizer(init)
    threads = fastest_threads(model, tok, task)
    run_warmup(model, tok, [task], steps=steps, batch_size=32, lr=3e-3, seed=seed,
               conversation=conversation)
    model.save_pretrained(path / "warm")
    tok.save_pretrained(path / "warm")
    return str(path / "warm"), threads


# -- TRL ------------------------------------------------------------------------------
def run_trl(model_dir: str, jobs: list[tuple[Settings, object, str]], task, threads: int):
    """TRL's runs (one per ``(settings, faults, out_dir)`` job, one after another) in one
    fresh process (``_trl_env.run_trl``), so that neither its imports nor its GIL-heavy
    training touch the Dask scheduler that lives in this process; the imports are paid
    once for every workload (each run's clock starts at its first trainer step).
    Returns ``[(rows, snapshots)]`` in job order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import asdict

    import _trl_env

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        futures = [pool.submit(_trl_env.run_trl, model_dir, asdict(s), task.name, faults,
                               group_seeds(s.seed, s.steps * s.groups_per_step), out_dir,
                               threads) for s, faults, out_dir in jobs]
        return [f.result() for f in futures]


# -- rollart --------------------------------------------------------------------------
def rollart_graph(s: Settings, task, model_dir: str, mode: str, redundancy: float,
                  pools: tuple[str, ...] = ("H800",)):
    from rollart import GRPO, Graph, Policy, Rollout

    algo = GRPO(group_size=s.group_size, groups_per_step=s.groups_per_step, lr=s.lr,
                clip_eps=s.clip_eps, max_grad_norm=s.max_grad_norm, kl_coef=0.0)
    return Graph(name=f"vs_trl-{mode.replace('+', 'plus')}", tasks=(task,),
                 policy=Policy(model=model_dir, conversation=s.conversation), algo=algo,
                 rollout=Rollout(redundancy=redundancy, inference_pools=pools),
                 steps=s.steps, seed=s.seed, mode=mode, checkpoint_every=s.eval_every)


def run_rollart(client, model_dir: str, s: Settings, task, mode: str, redundancy: float,
                run_dir: Path, pools: tuple[str, ...] = ("H800",)):
    """One rollart run; returns ``(rows, snapshots)``: snapshots are its checkpoints'
    model folders as ``(step, time the step finished, path)``."""
    import rollart

    graph = rollart_graph(s, task, model_dir, mode, redundancy, pools)
    rows = rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                         eval_seeds=0).metrics
    return rows, snapshots(rows, run_dir)


def snapshots(rows: list[dict], run_dir: Path) -> list[tuple[int, float, str]]:
    """A rollart run's complete checkpoints as ``(step, time the step finished, model
    folder)``, oldest first."""
    done = {r["step"]: r["time"] for r in rows}
    snaps = []
    for path in sorted((run_dir / "checkpoints").glob("step-*")):
        step = int(path.name.split("-")[1])
        if (path / "COMPLETE").exists() and step in done:
            snaps.append((step, done[step], str(path / "model")))
    return snaps


# -- figures --------------------------------------------------------------------------
def heldout_curve(start: float, snaps, task, s: Settings) -> list[tuple[int, float, float]]:
    """``[(step, time, held-out success)]`` from step 0 (the warmed-up model, ``start``)
    through every snapshot, on the first ``eval_seeds`` held-out seeds."""
    from rollart.chaos.faults import without_faults
    from rollart.env.scripted import heldout_seeds
    from rollart.observe.evaluate import evaluate

    seeds = heldout_seeds(s.eval_seeds)
    plain = without_faults(task)
    return [(0, 0.0, start)] + [
        (step, t, evaluate(path, [plain], seeds, conversation=s.conversation)[plain.name])
        for step, t, path in snaps]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="one seed, 10 steps, snapshots every 5, 32 held-out seeds")
    p.add_argument("--steps", type=int, default=None,
                   help="trainer steps per run without latency (default 60)")
    p.add_argument("--latency-steps", type=int, default=None,
                   help="trainer steps per run with latency (default 20, or --steps)")
    p.add_argument("--redundancy", type=float, default=None,
                   help="rollart async's redundant members per group, latency workload "
                   "(default 1: none; see Settings)")
    p.add_argument("--target", type=float, default=None,
                   help="held-out success to reach (default 0.5; fix it before running)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-seeds", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--groups-per-step", type=int, default=None)
    p.add_argument("--task", default=TASK, help="a built-in task name")
    p.add_argument("--seed", type=int, default=None, help="model, warm-up and episode seeds")
    p.add_argument("--seeds", type=int, default=None,
                   help="repeats from seeds seed, seed+1, ... (default 3; 1 with --quick): "
                   "the RESULT figures are medians over them")
    p.add_argument("--lr", type=float, default=None, help="every trainer's learning rate")
    p.add_argument("--workloads", default="no_latency",
                   help="comma-separated, of: " + ", ".join(WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES), help="the rollart modes to run")
    p.add_argument("--resources", default="laptop",
                   help="rollart's layout (resources/NAME.py); laptop: rollout in one "
                   "worker, the trainer in another")
    p.add_argument("--inference-pools", default="H800",
                   help="comma-separated inference pool tags rollart's graph uses")
    p.add_argument("--in-process", action="store_true",
                   help="rollart's cluster as threads of this process (tests)")
    p.add_argument("--conversation", choices=("raw", "chat"), default="raw",
                   help="raw: the word-level toy, obs/action text concatenated; chat: the "
                   "chat toy (ChatML template), rollart Policy(conversation='chat') and "
                   "TRL's tool loop rendered by the same template")
    p.add_argument("--aggregate", nargs="+", metavar="FILE", default=None,
                   help="run nothing: combine the RESULT lines of these saved outputs "
                   "(one seed each) into medians with their min and max")
    add_arguments(p)
    return p.parse_args(argv)


def settings(a) -> Settings:
    s = Settings()
    if a.quick:
        s = replace(s, steps=10, latency_steps=10, warmup_steps=100, eval_every=5,
                    eval_seeds=32)
    given = {"steps": a.steps, "latency_steps": a.latency_steps or a.steps,
             "target": a.target, "warmup_steps": a.warmup_steps, "eval_every": a.eval_every,
             "eval_seeds": a.eval_seeds, "group_size": a.group_size,
             "groups_per_step": a.groups_per_step, "seed": a.seed, "lr": a.lr,
             "redundancy": a.redundancy, "conversation": a.conversation}
    return replace(s, **{k: v for k, v in given.items() if v is not None})


def main(argv=None) -> dict:
    a = parse_args(argv)
    run = Run("vs_trl", a, argv)
    if a.aggregate:
        return {"result": aggregate_files(a.aggregate)}
    s = settings(a)
    workloads = [w for w in a.workloads.split(",") if w]
    modes = [m for m in a.modes.split(",") if m]
    bad = [w for w in workloads if w not in WORKLOADS] + [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown workload/mode {bad}; workloads: {', '.join(WORKLOADS)}; "
                         f"modes: {', '.join(MODES)}")

    from rollart.app.cli import quiet

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
        runs[seed], threads = run_seed(replace(s, seed=seed), base, workloads, modes, a)
        per_seed.append({f"{k}_{w}": v for w in workloads
                         for k, v in ratios(runs[seed][w]).items()})
        print(f"seed {seed}: " + " ".join(f"{k}={v:.3g}" for k, v in per_seed[-1].items()
                                          if k.startswith(("speedup_", "t_", "heldout_"))),
              flush=True)
    figures = combine(per_seed)
    for w in workloads:
        figures.update(verdict(figures, w, modes))
    figures = {**{k: figures.pop(k) for k in list(figures) if k.startswith("speedup_")
                  and not k.endswith("_each")}, **figures}  # the headline figures first
    figures.update({"seeds": "/".join(map(str, seeds)), "target": s.target,
                    "conversation": s.conversation,
                    **{f"steps_{w}": s.workload(w).steps for w in workloads},
                    "eval_every": s.eval_every, "eval_seeds": s.eval_seeds,
                    "redundancy": s.redundancy, "trl_threads": threads,
                    "resources": a.resources,
                    "inference_pools": a.inference_pools.replace(",", "+"),
                    "total_s": round(time.time() - t_all)})
    run.result(figures, fmt=lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))
    return {"runs": runs[seeds[0]], "seeds": runs, "result": figures}


def run_seed(s: Settings, base, workloads: list[str], modes: list[str], a):
    """Every runner on every workload from one seed's warmed-up model: TRL first (in a
    child process, with no Dask workers idling beside it), then the rollart modes in an
    order shuffled by the seed, on a fresh cluster; then, outside every timed window,
    the held-out evaluation of every snapshot. Returns ``({workload: {runner:
    summary}}, TRL's threads)``."""
    from distributed import Client

    import rollart
    from rollart.chaos.faults import with_faults

    out: dict = {w: {} for w in workloads}
    raw: dict = {w: {} for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        model, threads = warm_model(tmp / "model", base, s.warmup_steps, s.seed,
                                    s.conversation)
        print(f"warm-up: {s.warmup_steps} steps in {time.time() - t0:.0f}s; TRL uses "
              f"{threads} torch thread(s); {s}", flush=True)
        faults = {w: latency_faults(s.seed) if w == "latency" else None for w in workloads}
        t0 = time.time()
        trl = run_trl(model, [(s.workload(w), faults[w], str(tmp / f"trl-{w}"))
                              for w in workloads], base, threads)
        for w, run in zip(workloads, trl):
            raw[w]["trl"] = run
            print(f"{w:10s} trl   ran {len(run[0])} steps", flush=True)
        print(f"TRL's process, every workload: {time.time() - t0:.0f}s", flush=True)
        order = list(modes)
        random.Random(s.seed).shuffle(order)
        res = rollart.load_resources(a.resources)
        pools = tuple(t for t in a.inference_pools.split(",") if t)
        if a.in_process:
            res = replace(res, processes=False, dashboard_address=":0")
        with res.make_cluster() as cluster, Client(cluster) as client:
            for w in workloads:
                task = with_faults(base, faults[w]) if faults[w] else base
                for r in order:
                    t0 = time.time()
                    red = s.redundancy if (r == "async" and faults[w]) else 1.0
                    raw[w][r] = run_rollart(client, model, s.workload(w), task, r, red,
                                            tmp / f"{key(r)}-{w}", pools)
                    print(f"{w:10s} {r:5s} ran {len(raw[w][r][0])} steps "
                          f"(run {time.time() - t0:.0f}s)", flush=True)
        t0 = time.time()
        start = heldout_curve(0.0, [(0, 0.0, model)], base, s)[1][2]
        for w in workloads:
            for r in ("trl", *order):
                rows, snaps = raw[w][r]
                curve = heldout_curve(start, snaps, base, s)
                out[w][r] = summarise(rows, curve, s.batch_size, s.target)
                print(f"{w:10s} {r:5s} " + " ".join(
                    f"{k}={v:.3g}" for k, v in out[w][r].items() if k != "curve")
                    + " heldout " + " ".join(f"{st}:{v:.2f}" for st, _, v in curve),
                    flush=True)
        print(f"held-out evaluation of every snapshot: {time.time() - t0:.0f}s "
              "(outside the timed windows)", flush=True)
    return out, threads


if __name__ == "__main__":
    main()
