"""Side by side with Hugging Face TRL on a real model: SmolLM2-135M-Instruct learning
``graphs/real.py``'s multi-turn task (``guess_number``) with TRL's ``GRPOTrainer`` and
with rollart's default (async), timed to a held-out target fixed before any run.

**The same everything, each at its full strength.** The model (``--model
smollm2-135m-instruct``, untrained), the task, its reward (the env's, through
``_trl_real.GameEnv.get_reward`` on TRL's side), its system prompt and chat template
(the same token sequences: ``_trl_real.GAME_TEMPLATE``), the episode seeds in the order
rollart draws them, and GRPO settings matched as far as the two allow, taken from
``graphs/real.py`` before any run: group size 8, 4 groups a step, LoRA rank 16 (alpha
32, every linear layer but the head) at lr 1e-4, or (``--method full``) every weight at
1e-5; constant learning rate, clip ε 0.2, token-mean loss, rewards scaled by the batch's
standard deviation, no KL, temperature 1, the task's per-turn token limit and turn count.
TRL runs the task through its ``environment_factory`` (its recommended multi-turn set-up)
in a fresh process on all of this machine's cores; rollart runs ``graphs/real.py``
restricted to the task on ``resources/laptop.py`` (rollout in one worker process, the
trainer in another), its default mode.

**The target** is the untrained model's held-out success on the same held-out seeds
plus 0.15 (the real-model goal's gain, ``benchmarks/real_model.py``), computed before
any run and printed; ``--target`` fixes it by hand instead. Every runner saves its
policy every ``--eval-every`` steps inside its timed window (TRL: ``save_pretrained``
from a callback; rollart: its checkpoints); after all runs, outside every window, each
snapshot is evaluated on the same ``--eval-seeds`` held-out seeds (``rollart eval``'s)
and mapped to the wall time its step finished (from the first trainer step; set-up
excluded for both). A runner's time to the target is its first snapshot at or above it;
one that never gets there has none (``inf``): reported as missed, never re-targeted.

Per seed: ``speedup`` = TRL's time ÷ rollart's (> 1: rollart sooner; ``inf`` when only
rollart got there, 0 when only TRL did, ``nan`` when neither did), and the held-out
success of each at equal wall time (the last snapshot of each at or before the earlier
of the two runs' ends). The RESULT line gives the median over seeds, the win count and
the spread::

    flock /tmp/rollart-bench.lock python benchmarks/vs_trl_real.py            # 3 seeds
    python benchmarks/vs_trl_real.py --quick    # 1 seed, 2 tiny steps: a smoke run

RESULT keys: ``speedup`` (median), ``speedup_each``, ``rollart_wins`` (seeds where
rollart got there first, or alone), ``t_trl``, ``t_rollart`` (medians, s),
``heldout_equal_trl``, ``heldout_equal_rollart`` (medians), ``heldout_final_trl``,
``heldout_final_rollart``, ``before``, ``target``, ``seeds``, ``steps``, ``method``,
``task``. Appends a record to ``benchmarks/results/vs_trl_real.jsonl`` with every
curve. TRL is the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py, _trl_*.py, vs_trl.py

from _results import Kept, Run, add_arguments  # noqa: E402

MODEL = "smollm2-135m-instruct"
TASK = "guess_number"
GOAL_GAIN = 0.15  # the real-model goal: +0.15 held-out success


@dataclass(frozen=True)
class Settings:
    """What both runners share, fixed before a run (``graphs/real.py``'s values)."""

    steps: int = 40
    group_size: int = 8
    groups_per_step: int = 4
    lr: float = 1e-4
    lora_rank: int = 16  # 0: full fine-tuning
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    scale_rewards: str = "batch"
    max_completion_length: int = 512
    seed: int = 0
    eval_every: int = 10
    eval_seeds: int = 128


def settings(a) -> Settings:
    from graphs import real

    s = Settings(lr=real.LORA_LR if a.method == "lora" else real.LR,
                 lora_rank=real.LORA_RANK if a.method == "lora" else 0)
    if a.quick:
        s = replace(s, steps=2, group_size=4, groups_per_step=2, eval_every=1, eval_seeds=8)
    given = {"steps": a.steps, "eval_every": a.eval_every, "eval_seeds": a.eval_seeds}
    return replace(s, **{k: v for k, v in given.items() if v is not None})


def the_task():
    from graphs import real

    return next(t for t in real.tasks() if t.name == TASK)


def rollart_graph(s: Settings, model_dir: str):
    from graphs import real

    g = real.lora() if s.lora_rank else real.graph()
    algo = replace(g.algo, group_size=s.group_size, groups_per_step=s.groups_per_step,
                   lr=s.lr, clip_eps=s.clip_eps, max_grad_norm=s.max_grad_norm,
                   scale_rewards=s.scale_rewards, kl_coef=0.0)
    return replace(g, name=f"vs_trl_real-{g.name}", tasks=(the_task(),), algo=algo,
                   policy=replace(g.policy, model=model_dir), steps=s.steps, seed=s.seed,
                   checkpoint_every=s.eval_every)


def run_rollart(client, model_dir: str, s: Settings, run_dir: Path):
    """One rollart run: ``(rows, snapshots)``, snapshots ``(step, time, model folder)``."""
    import rollart

    from vs_trl import snapshots

    rows = rollart.train(rollart_graph(s, model_dir), client=client, run_dir=run_dir,
                         progress=False, eval_seeds=0).metrics
    return rows, snapshots(rows, run_dir)


def run_trl(model_dir: str, s: Settings, out_dir: str, threads: int):
    """TRL's run in a fresh process (its imports and GIL-heavy training away from the
    Dask scheduler in this one)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import _trl_real
    from vs_trl import group_seeds

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_trl_real.run_trl, model_dir, asdict(s), the_task(),
                           group_seeds(s.seed, s.steps * s.groups_per_step), out_dir,
                           threads).result()


def heldout(path: str, s: Settings) -> float:
    from rollart.control.loop import EVAL_SEED_BASE
    from rollart.observe.evaluate import evaluate

    from graphs import real

    opts = real.graph().policy.conversation_options()
    seeds = range(EVAL_SEED_BASE, EVAL_SEED_BASE + s.eval_seeds)
    return evaluate(path, [the_task()], seeds, **opts)[TASK]


def time_to(curve, target: float) -> float:
    """The wall time of the first snapshot at or above ``target`` (inf: never).

    >>> time_to([(0, 0.0, 0.2), (10, 50.0, 0.3), (20, 99.0, 0.4)], 0.35)
    99.0
    """
    return next((t for _, t, v in curve if v >= target), math.inf)


def at_time(curve, t: float) -> float:
    """Held-out success of the last snapshot at or before wall time ``t``.

    >>> at_time([(0, 0.0, 0.2), (10, 50.0, 0.3), (20, 99.0, 0.4)], 80.0)
    0.3
    """
    return [v for _, when, v in curve if when <= t][-1]


def speedup(t_trl: float, t_rollart: float) -> float:
    """TRL's time ÷ rollart's (inf: only rollart reached the target; nan: neither)."""
    if math.isinf(t_trl) and math.isinf(t_rollart):
        return math.nan
    return t_trl / t_rollart


def one_seed(s: Settings, model_dir: str, before: float, target: float, a) -> dict:
    """TRL, then rollart on a fresh cluster, then every snapshot's evaluation."""
    import torch
    from distributed import Client

    import rollart

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        trl = run_trl(model_dir, s, str(tmp / "trl"), torch.get_num_threads())
        print(f"seed {s.seed}: TRL ran {len(trl[0])} steps ({time.time() - t0:.0f}s)",
              flush=True)
        res = rollart.load_resources(a.resources)
        if a.in_process:
            res = replace(res, processes=False, dashboard_address=":0")
        t0 = time.time()
        with res.make_cluster() as cluster, Client(cluster) as client:
            ra = run_rollart(client, model_dir, s, tmp / "rollart")
        print(f"seed {s.seed}: rollart ran {len(ra[0])} steps ({time.time() - t0:.0f}s)",
              flush=True)
        curves = {name: [(0, 0.0, before)] + [(st, t, heldout(p, s)) for st, t, p in snaps]
                  for name, (_, snaps) in (("trl", trl), ("rollart", ra))}
    end = min(curves["trl"][-1][1], curves["rollart"][-1][1])
    out = {"seed": s.seed, "curves": curves,
           "t": {k: time_to(c, target) for k, c in curves.items()},
           "equal": {k: at_time(c, end) for k, c in curves.items()},
           "final": {k: c[-1][2] for k, c in curves.items()},
           "wall": {k: c[-1][1] for k, c in curves.items()}}
    out["speedup"] = speedup(out["t"]["trl"], out["t"]["rollart"])
    print(f"seed {s.seed}: time to {target:.2f}: TRL {out['t']['trl']:.0f}s, rollart "
          f"{out['t']['rollart']:.0f}s; held-out at {end:.0f}s: TRL {out['equal']['trl']:.2f}"
          f", rollart {out['equal']['rollart']:.2f}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=("lora", "full"), default="lora")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (1 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default 40)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-seeds", type=int, default=None, help="held-out seeds (128)")
    p.add_argument("--target", type=float, default=None,
                   help=f"held-out success to reach (default: untrained + {GOAL_GAIN})")
    p.add_argument("--resources", default="laptop")
    p.add_argument("--in-process", action="store_true",
                   help="rollart's cluster as threads of this process (tests)")
    p.add_argument("--quick", action="store_true",
                   help="one seed, 2 steps of 2 groups of 4, 8 held-out seeds")
    p.add_argument("--resume", action="store_true",
                   help="go on from the seeds an earlier invocation of the same settings "
                        "finished (runs/bench-vs_trl_real/METHOD; about 1.5 h a seed); "
                        "without that folder, from the newest record of the same settings")
    add_arguments(p)
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # graphs/
    run = Run("vs_trl_real", a, argv)
    s = settings(a)
    from rollart.app.cli import quiet
    from rollart.pretrained import resolve_model

    quiet()
    model_dir = resolve_model(MODEL)
    # each seed's result is kept (``_results.Kept``): one cut short goes on with --resume
    # rollart's side as its default resolves (a series of seeds is of one default: a
    # resume after the default changed is refused, not mixed)
    g = rollart_graph(s, model_dir)
    side = {"mode": g.mode, "max_in_flight": g.max_in_flight,
            "stale_members": g.stale_members}
    kept = Kept("vs_trl_real", f"quick-{a.method}" if a.quick else a.method,
                {**asdict(s), "target": a.target, "resources": a.resources,
                 "rollart": side}, a.resume)
    before = kept.before(lambda: {"heldout": heldout(model_dir, s)})["heldout"]
    target = a.target if a.target is not None else round(before + GOAL_GAIN, 4)
    print(f"untrained held-out success {before:.3f} on {s.eval_seeds} seeds: target "
          f"{target:.3f}; {s}", flush=True)
    runs = [kept.seed(k, lambda _: one_seed(replace(s, seed=k), model_dir, before, target, a))
            for k in range(1 if a.quick else a.seeds)]
    med = lambda key, who: statistics.median(r[key][who] for r in runs)  # noqa: E731
    ups = [r["speedup"] for r in runs]
    figures = {
        "speedup": statistics.median(ups),
        "speedup_each": "/".join(f"{x:.3g}" for x in ups),
        "rollart_wins": sum(r["t"]["rollart"] < r["t"]["trl"] for r in runs),
        "t_trl": med("t", "trl"), "t_rollart": med("t", "rollart"),
        "heldout_equal_trl": med("equal", "trl"),
        "heldout_equal_rollart": med("equal", "rollart"),
        "heldout_final_trl": med("final", "trl"),
        "heldout_final_rollart": med("final", "rollart"),
        "before": before, "target": target, "seeds": len(runs), "steps": s.steps,
        "method": a.method, "task": TASK,
    }
    run.result(figures, {"settings": asdict(s), "rollart": side, "runs": runs,
                         **kept.record()})


if __name__ == "__main__":
    main()
