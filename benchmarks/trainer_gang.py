"""A trainer step on one rank against the same step on a two-rank gang (issue 37).

Side by side on this machine, on one process cluster with two TRAIN workers (one thread
each): the one-process ``Trainer`` on the first worker with one torch thread (as a
one-worker TRAIN pool runs it), the same with two torch threads (the strongest
one-process alternative on 2 cores: it may use both), then a ``GangTrainer`` on it with
the second worker as rank 1 (FSDP2 over gloo, one thread a rank, buckets written by both
ranks). Both train the
same fixed batches from their own ``SampleBuffer``: ``--groups`` groups of ``--size``
random trajectories (``rollart.testing.random_batch``, about 60 tokens a row) on a model
folder built here (``--hidden``, ``--layers``). The first step of each side is a warm-up
and not timed; then ``--steps`` timed steps each (a step: take the batch, forward,
backward, clip, AdamW, publish the version). The settings are fixed here, before any run.

What to expect on 2 cores: little or no gain over one rank on two threads. Two ranks
split the batch, but each rank also gathers every tensor whole to publish and pays
gloo's collectives, and the two worker processes share the machine's two cores with the
scheduler and the driver. The gang is
for a model that does not fit one device or a batch that needs several; on a host with
a core (or a GPU) per rank the compute halves.

Each invocation appends one record to ``benchmarks/results/trainer_gang.jsonl`` (date,
commit, load average before, command, figures). Run it alone on an idle machine::

    flock /tmp/rollart-bench.lock python benchmarks/trainer_gang.py
    python benchmarks/trainer_gang.py --quick      # a smoke run

RESULT keys: ``gang_step_s_1``, ``gang_step_s_1t2`` and ``gang_step_s_2`` (median seconds a
step: one rank, one rank on two threads, two ranks), ``gang_step_ratio`` (one rank's ÷
two ranks': > 1 means the gang is faster) and ``gang_step_ratio_t2`` (one rank on two
threads ÷ two ranks),
``params_m`` (the model's parameters, millions), ``rows`` (a batch), ``steps``, ``cores``.
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

from _results import Run, add_arguments  # noqa: E402


def _model(path: Path, hidden: int, layers: int) -> str:
    from rollart.model import build_tiny_model

    corpus = ["gridnav : goal 3 right 1 up ; act ? left down , stop ."]
    return str(build_tiny_model(path, corpus, hidden_size=hidden, num_layers=layers,
                                num_heads=4))


def _time_side(client, cls, kwargs, model, store, algo, batches, where, size) -> list[float]:
    from rollart.buffer import SampleBuffer
    from rollart.runtime.handles import handle
    from rollart.types import TRAIN

    trainer = handle(client.submit(cls, model, store, algo, actor=True, workers=[where],
                                   resources={TRAIN: 1}, **kwargs).result())
    buf = handle(client.submit(SampleBuffer, None, actor=True, workers=[where]).result())
    for batch in batches:
        for t in batch:
            buf.put(t, size).result()
    trainer.publish().result()
    times = []
    for step, _ in enumerate(batches, start=1):
        t0 = time.perf_counter()
        row = trainer.train_step(buf, step).result()
        times.append(time.perf_counter() - t0)
        assert row["trainer/batch_size"] == len(batches[0]), row
    return times[1:]  # the first step warms up (the gang forms at its first publish)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (tiny model, 2 steps)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the batches' seed")
    add_arguments(ap)
    args = ap.parse_args(argv)
    run = Run("trainer_gang", args, argv)
    if args.quick:
        args.steps, args.groups, args.hidden, args.layers = 2, 4, 64, 2

    from distributed import Client, LocalCluster

    from rollart.config.graph import GRPO
    from rollart.testing import random_batch
    from rollart.trainer import Trainer
    from rollart.trainer.gang import GangTrainer
    from rollart.types import TRAIN

    algo = GRPO(group_size=args.size, groups_per_step=args.groups, lr=1e-4, alpha=10**6,
                micro_batch_tokens=512)
    with tempfile.TemporaryDirectory(prefix="rollart-gang-bench-") as tmp:
        tmp = Path(tmp)
        model = _model(tmp / "model", args.hidden, args.layers)
        from rollart.model import load_model

        params = sum(p.numel() for p in load_model(model).parameters())
        vocab = load_model(model).config.vocab_size
        batches = [random_batch(vocab, groups=args.groups, size=args.size, seed=1000 * args.seed + s,
                                shared_prompt=True, lengths=(24, 40))
                   for s in range(args.steps + 1)]
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          resources={TRAIN: 1}, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            a, b = sorted(client.scheduler_info()["workers"])
            one = _time_side(client, Trainer, {}, model, str(tmp / "w1"), algo, batches, a,
                             args.size)
            one_t2 = _time_side(client, Trainer, {"threads": 2}, model, str(tmp / "w1t2"),
                                algo, batches, a, args.size)
            two = _time_side(client, GangTrainer, {"ranks": 2}, model, str(tmp / "w2"),
                             algo, batches, a, args.size)
    s1, s1t2, s2 = statistics.median(one), statistics.median(one_t2), statistics.median(two)
    # unrounded: the RESULT line gives 4 significant digits, so a ratio and the times it
    # divides agree there (seconds rounded to 3 decimals did not: 0.033 / 0.066 = 0.49)
    out = {"gang_step_s_1": s1, "gang_step_s_1t2": s1t2, "gang_step_s_2": s2,
           "gang_step_ratio": s1 / s2, "gang_step_ratio_t2": s1t2 / s2,
           "params_m": round(params / 1e6, 2),
           "rows": args.groups * args.size, "steps": args.steps, "cores": os.cpu_count()}
    run.result(out, {"seed": args.seed, "steps_s_1": one, "steps_s_1t2": one_t2,
                     "steps_s_2": two})
    return out


if __name__ == "__main__":
    main()
