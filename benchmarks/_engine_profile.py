"""Where the torch engine's per-request CPU time goes, on the default graph's turn shape.

Drives ``TorchEngine.serve`` with the built-in tiny model (the default graph's, untrained)
and a stream like a run's (docs/benchmarks/limits.md, "Rollout"): ``--trajs`` concurrent
trajectories in groups sharing their first prompt, each turn a prompt of the trajectory's
context so far plus a few new observation tokens (the earlier part from the prefix
cache: ``cache_key`` is the trajectory), ``--new`` tokens at most, temperature 1, top-p,
a per-request seed as the env manager sets it (``request_seed``). A finished turn
queues the trajectory's next one, so the batch stays continuously fed; a trajectory that
reaches ``--turns`` starts over as a new one. Its next turn becomes available 1 to
``--lag`` admission polls later (its env step), so arrivals spread as in a run.

Reports the engine thread's tokens per CPU second (``time.thread_time``) and, with
``--profile``, cProfile's top functions. ``--compare`` runs the stream alternately with
the previous per-row sampler (``legacy_pick``, kept here only for this comparison) and
the engine's, in one process, and prints the ratio: the machine may be shared, so only
the ratio means anything.

``--against DIR`` compares the whole engine instead: the stream alternately on the
``rollart`` package under ``DIR`` (e.g. an older commit's, ``git archive <commit> rollart
| tar -x -C DIR``) and on this one, each run in a fresh process.

    PYTHONPATH=$PWD python benchmarks/_engine_profile.py --compare
    PYTHONPATH=$PWD python benchmarks/_engine_profile.py --against /tmp/engine-base
    PYTHONPATH=$PWD python benchmarks/_engine_profile.py --profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time
from collections import deque

import torch

from rollart.env.trajectory import request_seed
from rollart.rollout.engine import TorchEngine
from rollart.types import GenRequest


def legacy_pick(logits, temperatures, top_ps, rngs):
    """The sampler before the batched one (``sampling.pick``'s signature): one
    ``multinomial`` per sampled row, after a sort of its own for top-p."""
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures])
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    greedy = torch.argmax(logits, dim=-1).tolist()
    picks = [greedy[i] if t <= 0 else _legacy_sample(logp[i], top_ps[i], rngs[i])
             for i, t in enumerate(temperatures)]
    lps = logp[torch.arange(len(picks)), torch.tensor(picks)].tolist()
    return picks, lps


def _legacy_sample(logp, top_p, rng) -> int:
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p
        keep[0] = True
        trunc = torch.zeros_like(probs)
        trunc[order[keep]] = sorted_p[keep]
        probs = trunc
    return int(torch.multinomial(probs, 1, generator=rng))


class Stream:
    """Trajectories taking turns: ``admit`` hands out their pending turns, ``deliver``
    extends the trajectory and queues its next turn."""

    def __init__(self, a, vocab: int, requests: int):
        self.a, self.vocab, self.left = a, vocab, requests
        self.rand = random.Random(a.seed)
        self.pending: deque = deque()
        self.later: list[tuple[int, tuple]] = []  # (the poll it is ready at, item)
        self.polls = 0
        self.contexts: dict[str, list[int]] = {}
        self.turn: dict[str, int] = {}
        self.done = self.tokens = 0
        self.next_id = 0
        for g in range(a.trajs // a.group):
            self._new_group(g)

    def _words(self, n: int) -> list[int]:
        return [self.rand.randrange(1, self.vocab) for _ in range(n)]

    def _new_group(self, g: int) -> None:
        first = self._words(self.a.prompt)
        for _ in range(self.a.group):
            tid = f"t{self.next_id}"
            self.next_id += 1
            self.contexts[tid], self.turn[tid] = list(first), 0
            self._queue(tid)

    def _queue(self, tid: str) -> None:
        if self.left <= 0:
            return
        self.left -= 1
        req = GenRequest(list(self.contexts[tid]), self.a.new, 1.0, self.a.top_p, (),
                         request_seed(0, tid, self.turn[tid]), request_id=f"{tid}/x",
                         cache_key=tid)
        self.later.append((self.polls + self.rand.randint(1, self.a.lag), (req, tid)))

    def admit(self, free: int) -> list:
        self.polls += 1
        ready = [x for x in self.later if x[0] <= self.polls]
        if not ready and not self.pending and self.later:  # nothing else would run
            ready = [min(self.later, key=lambda x: x[0])]
        self.later = [x for x in self.later if x not in ready]
        self.pending.extend(item for _, item in ready)
        return [self.pending.popleft() for _ in range(min(free, len(self.pending)))]

    def deliver(self, tid, res) -> None:
        if isinstance(res, BaseException):
            raise res
        self.done += 1
        self.tokens += len(res.token_ids)
        self.turn[tid] += 1
        if self.turn[tid] >= self.a.turns:
            del self.contexts[tid], self.turn[tid]
            if len(self.contexts) <= self.a.trajs - self.a.group:
                self._new_group(self.next_id)
            return
        self.contexts[tid] += res.token_ids + self._words(self.a.obs)
        self._queue(tid)


def run(engine: TorchEngine, a, requests: int) -> tuple[int, float]:
    """Serve ``requests`` turns; (tokens generated, engine thread CPU seconds)."""
    stream = Stream(a, engine.vocab_size, requests)
    c0 = time.thread_time()
    engine.serve(stream.admit, stream.deliver)
    return stream.tokens, time.thread_time() - c0


def build_engine(a) -> TorchEngine:
    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model

    path = build_tiny_model(tempfile.mkdtemp() + "/m", task_corpus(list(BUILTIN_TASKS)))
    return TorchEngine(path, max_batch=a.max_batch)


def compare(engine: TorchEngine, a) -> None:
    """Alternate the legacy and the current sampler; print tokens per CPU second."""
    from rollart.rollout import sampling

    current = sampling.pick
    rates: dict[str, list[float]] = {"legacy": [], "current": []}
    for _ in range(a.rounds):
        for name, fn in (("legacy", legacy_pick), ("current", current)):
            sampling.pick = fn
            tokens, cpu = run(engine, a, a.requests)
            rates[name].append(tokens / cpu)
    sampling.pick = current
    for name, r in rates.items():
        print(f"{name:8s} tokens/CPU-s " + " ".join(f"{x:7.0f}" for x in r))
    ratios = [c / l for c, l in zip(rates["current"], rates["legacy"])]
    print("current/legacy per round " + " ".join(f"{x:.2f}" for x in ratios) +
          f"  median {sorted(ratios)[len(ratios) // 2]:.2f}")


def against(base: str, a) -> None:
    """Alternate fresh processes on ``base``'s ``rollart`` and this one; print the rates."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, os.path.abspath(__file__), "--requests", str(a.requests),
            "--new", str(a.new), "--top-p", str(a.top_p), "--lag", str(a.lag),
            "--trajs", str(a.trajs), "--max-batch", str(a.max_batch)]
    rates: dict[str, list[float]] = {"base": [], "current": []}
    for _ in range(a.rounds):
        for name, path in (("base", base), ("current", here)):
            env = {**os.environ, "PYTHONPATH": path}
            out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
            line = next(x for x in out.stdout.splitlines() if "tokens/CPU-s" in x)
            rates[name].append(float(line.split(" tokens/CPU-s")[0].split()[-1]))
    for name, r in rates.items():
        print(f"{name:8s} tokens/CPU-s " + " ".join(f"{x:7.0f}" for x in r))
    ratios = [c / b for c, b in zip(rates["current"], rates["base"])]
    print("current/base per round " + " ".join(f"{x:.2f}" for x in ratios) +
          f"  median {sorted(ratios)[len(ratios) // 2]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajs", type=int, default=48, help="concurrent trajectories")
    p.add_argument("--group", type=int, default=8, help="trajectories sharing a first prompt")
    p.add_argument("--prompt", type=int, default=30, help="first prompt's tokens")
    p.add_argument("--obs", type=int, default=7, help="new observation tokens per turn")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new", type=int, default=2, help="max_new_tokens")
    p.add_argument("--lag", type=int, default=4, help="polls until a next turn arrives")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3, help="--compare: alternations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="cProfile the current engine")
    p.add_argument("--sort", default="tottime", help="--profile: cProfile's sort key")
    p.add_argument("--lines", type=int, default=30, help="--profile: functions shown")
    p.add_argument("--compare", action="store_true", help="legacy vs current sampler")
    p.add_argument("--against", metavar="DIR", help="whole engine: DIR's rollart vs this")
    a = p.parse_args()
    if a.against:
        against(a.against, a)
        return
    torch.set_num_threads(1)
    engine = build_engine(a)
    run(engine, a, 300)  # warm-up
    if a.compare:
        compare(engine, a)
        return
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    tokens, cpu = run(engine, a, a.requests)
    if prof:
        prof.disable()
    print(f"{a.requests} requests, {tokens} tokens, {cpu:.2f} CPU s: "
          f"{tokens / cpu:.0f} tokens/CPU-s, {1e3 * cpu / a.requests:.3f} ms/request; "
          f"prefill {engine.prefill_tokens} tokens, decode steps {engine.decode_steps}")
    if prof:
        pstats.Stats(prof).sort_stats(a.sort).print_stats(a.lines)


if __name__ == "__main__":
    main()
