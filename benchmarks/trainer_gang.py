"""A trainer step on one rank against the same step on a two-rank gang (issue 37).

Side by side on this machine, each side on a fresh process cluster with two TRAIN
workers (one thread each; fresh, so that each process's peak resident memory is that
side's): the one-process ``Trainer`` on the first worker with one torch thread (as a
one-worker TRAIN pool runs it), the same with two torch threads (the strongest
one-process alternative on 2 cores: it may use both), then a ``GangTrainer`` on it with
the second worker as rank 1 (FSDP2 over gloo, one thread a rank, buckets written by both
ranks). All train the same fixed batches from their own ``SampleBuffer``: ``--groups``
groups of ``--size`` random trajectories (``rollart.testing.random_batch``, a group's
rows sharing a prompt). The model is a tiny one built here (``--hidden``, ``--layers``;
rows of about 35 tokens: ``TOY``), the quick default and CI's workload, or with
``--model`` a pretrained model folder or known name (``rollart.pretrained``), trained on
rows of a few hundred tokens (``REAL``). The first step of each side is a warm-up and not
timed; then ``--steps`` timed steps each (a step: take the batch, forward, backward,
clip, AdamW, publish the version). The settings are fixed here, before any run.

What to expect on 2 cores: little or no gain over one rank on two threads. Two ranks
split the batch, but each rank also gathers every tensor whole to publish and pays
gloo's collectives, and the two worker processes share the machine's two cores with the
scheduler and the driver. The gang is
for a model that does not fit one device or a batch that needs several; on a host with
a core (or a GPU) per rank the compute halves.

Each invocation appends one record to ``benchmarks/results/trainer_gang.jsonl`` (date,
commit, load average before, command, figures). Run it alone on an idle machine::

    flock /tmp/rollart-bench.lock python benchmarks/trainer_gang.py
    flock /tmp/rollart-bench.lock python benchmarks/trainer_gang.py \\
        --model smollm2-135m-instruct   # the real model: ~10 minutes on 2 cores
    python benchmarks/trainer_gang.py --quick      # a smoke run (tiny model)

RESULT keys: ``gang_step_s_1``, ``gang_step_s_1t2`` and ``gang_step_s_2`` (median seconds a
step: one rank, one rank on two threads, two ranks), ``gang_step_ratio`` (one rank's ÷
two ranks': > 1 means the gang is faster) and ``gang_step_ratio_t2`` (one rank on two
threads ÷ two ranks); ``train_tok_s_1``, ``train_tok_s_1t2``, ``train_tok_s_2`` (trained
tokens, the loss mask's, of the timed steps ÷ their seconds, publishing included);
``peak_rss_mb_1``, ``peak_rss_mb_1t2`` (the trainer's worker process), ``peak_rss_mb_2_rank0``
and ``peak_rss_mb_2_rank1`` (each rank's worker process): peak resident memory
(``VmHWM``), MB, of a process that started with the side (the worker's own ~60 MB
included; the record's ``rss_start_mb_<side>`` is each worker's before the trainer, and
``idle_peak_rss_mb_1`` the one-rank side's idle second worker);
``params_m`` (the model's parameters, millions), ``rows`` (a batch), ``row_tokens`` (mean
tokens a row), ``steps``, ``cores``, ``model`` (``tiny`` or what ``--model`` named).
Run it for seeds 0, 1 and 2 (``--seed``) and take the median and spread of the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py

from _results import Run, add_arguments, fill  # noqa: E402


#: the tiny model's settings (the quick default and CI's workload): rows of about 60 tokens
TOY = {"steps": 8, "groups": 8, "size": 4, "lengths": (24, 40), "prompt": (2, 6),
       "lr": 1e-4, "micro_batch_tokens": 512}
#: a pretrained model's (``--model``), fixed before any run: rows of a few hundred tokens
#: (a prompt of 128-192, a response of 96-192, as graphs/real.py's chat turns run), 2
#: groups of 4 a step, the learning rate and micro-batch of graphs/real.py; 3 timed steps a
#: side (SmolLM2-135M-Instruct: about 10 minutes in all on 2 cores)
REAL = {"steps": 3, "groups": 2, "size": 4, "lengths": (96, 192), "prompt": (128, 192),
        "lr": 1e-5, "micro_batch_tokens": 2048}


def _model(path: Path, hidden: int, layers: int) -> str:
    from rollart.model import build_tiny_model

    corpus = ["gridnav : goal 3 right 1 up ; act ? left down , stop ."]
    return str(build_tiny_model(path, corpus, hidden_size=hidden, num_layers=layers,
                                num_heads=4))


def _rss_mb() -> dict:
    """This process's peak and current resident memory, MB (``/proc/self/status``:
    ``VmHWM``, ``VmRSS``); runs in each worker (``Client.run``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) / 1024  # kB
    return {"peak": out["VmHWM"], "now": out["VmRSS"]}


def _time_side(cls, kwargs, model, store, algo, batches, size) -> dict:
    """One side on a fresh cluster of two TRAIN worker processes (so each process's peak
    resident memory is this side's): seconds and trained tokens of each timed step, and
    each worker's resident memory before the trainer and its peak after the steps
    (``rank0`` the trainer's worker, ``rank1`` the other)."""
    from distributed import Client, LocalCluster

    from rollart.buffer import SampleBuffer
    from rollart.runtime.handles import handle
    from rollart.types import TRAIN

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      resources={TRAIN: 1}, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        start = client.run(_rss_mb)
        trainer = handle(client.submit(cls, model, store, algo, actor=True, workers=[a],
                                       resources={TRAIN: 1}, **kwargs).result())
        buf = handle(client.submit(SampleBuffer, None, actor=True, workers=[a]).result())
        for batch in batches:
            for t in batch:
                buf.put(t, size).result()
        trainer.publish().result()
        times, tokens = [], []
        for step, _ in enumerate(batches, start=1):
            t0 = time.perf_counter()
            row = trainer.train_step(buf, step).result()
            times.append(time.perf_counter() - t0)
            tokens.append(row["trainer/tokens"])
            assert row["trainer/batch_size"] == len(batches[0]), row
        end = client.run(_rss_mb)
        del trainer, buf
    # the first step warms up (the gang forms at its first publish)
    return {"times": times[1:], "tokens": tokens[1:],
            "rss_start_mb": [start[a]["now"], start[b]["now"]],
            "peak_rss_mb": [end[a]["peak"], end[b]["peak"]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (tiny model, 2 steps)")
    ap.add_argument("--model", default=None,
                    help="a model folder or known name (smollm2-135m-instruct) instead of "
                         "the tiny model built here; its own defaults (REAL)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side")
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the batches' seed")
    add_arguments(ap)
    args = ap.parse_args(argv)
    run = Run("trainer_gang", args, argv)
    if args.quick and args.model:
        ap.error("--quick is the tiny model's smoke run: leave out --model (or --quick)")
    shape = REAL if args.model else TOY
    if args.quick:
        args.hidden, args.layers = 64, 2
        shape = {**shape, "steps": 2, "groups": 4}
    fill(args, {k: shape[k] for k in ("steps", "groups", "size")})

    from rollart.config.graph import GRPO
    from rollart.model import load_model
    from rollart.pretrained import resolve_model
    from rollart.testing import random_batch
    from rollart.trainer import Trainer
    from rollart.trainer.gang import GangTrainer

    algo = GRPO(group_size=args.size, groups_per_step=args.groups, lr=shape["lr"],
                alpha=10**6, micro_batch_tokens=shape["micro_batch_tokens"])
    with tempfile.TemporaryDirectory(prefix="rollart-gang-bench-") as tmp:
        tmp = Path(tmp)
        model = (resolve_model(args.model) if args.model
                 else _model(tmp / "model", args.hidden, args.layers))
        loaded = load_model(model)
        params, vocab = sum(p.numel() for p in loaded.parameters()), loaded.config.vocab_size
        del loaded
        batches = [random_batch(vocab, groups=args.groups, size=args.size,
                                seed=1000 * args.seed + s, shared_prompt=True,
                                lengths=shape["lengths"], prompt_lengths=shape["prompt"])
                   for s in range(args.steps + 1)]
        row_tokens = statistics.mean(len(t.prompt_ids) + len(t.response_ids)
                                     for b in batches for t in b)
        print(f"model {args.model or 'tiny'} ({params / 1e6:.1f} M parameters); "
              f"{args.groups * args.size} rows a step, {row_tokens:.0f} tokens a row; "
              f"{args.steps} timed steps a side", flush=True)
        sides = {}
        for name, cls, kwargs in (("1", Trainer, {}), ("1t2", Trainer, {"threads": 2}),
                                  ("2", GangTrainer, {"ranks": 2})):
            t0 = time.perf_counter()
            sides[name] = _time_side(cls, kwargs, model, str(tmp / f"w{name}"), algo,
                                     batches, args.size)
            r = sides[name]
            print(f"side {name}: steps {[round(x, 2) for x in r['times']]} s, peak RSS "
                  f"{[round(x) for x in r['peak_rss_mb']]} MB (before the trainer "
                  f"{[round(x) for x in r['rss_start_mb']]}); "
                  f"{time.perf_counter() - t0:.0f} s in all", flush=True)
    if len({tuple(r["tokens"]) for r in sides.values()}) != 1:
        raise RuntimeError(f"the sides trained different tokens: "
                           f"{ {k: r['tokens'] for k, r in sides.items()} }")
    med = {k: statistics.median(r["times"]) for k, r in sides.items()}
    tok_s = {k: sum(r["tokens"]) / sum(r["times"]) for k, r in sides.items()}
    s1, s1t2, s2 = med["1"], med["1t2"], med["2"]
    # unrounded: the RESULT line gives 4 significant digits, so a ratio and the times it
    # divides agree there (seconds rounded to 3 decimals did not: 0.033 / 0.066 = 0.49)
    out = {"gang_step_s_1": s1, "gang_step_s_1t2": s1t2, "gang_step_s_2": s2,
           "gang_step_ratio": s1 / s2, "gang_step_ratio_t2": s1t2 / s2,
           "train_tok_s_1": tok_s["1"], "train_tok_s_1t2": tok_s["1t2"],
           "train_tok_s_2": tok_s["2"],
           "peak_rss_mb_1": sides["1"]["peak_rss_mb"][0],
           "peak_rss_mb_1t2": sides["1t2"]["peak_rss_mb"][0],
           "peak_rss_mb_2_rank0": sides["2"]["peak_rss_mb"][0],
           "peak_rss_mb_2_rank1": sides["2"]["peak_rss_mb"][1],
           "params_m": round(params / 1e6, 2), "rows": args.groups * args.size,
           "row_tokens": round(row_tokens), "steps": args.steps, "cores": os.cpu_count(),
           "model": args.model or "tiny"}
    run.result(out, {"seed": args.seed,
                     **{f"steps_s_{k}": r["times"] for k, r in sides.items()},
                     **{f"tokens_{k}": r["tokens"] for k, r in sides.items()},
                     **{f"rss_start_mb_{k}": r["rss_start_mb"] for k, r in sides.items()},
                     "idle_peak_rss_mb_1": sides["1"]["peak_rss_mb"][1]})
    return out


if __name__ == "__main__":
    main()
