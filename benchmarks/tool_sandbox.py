"""Tool sandbox benchmark: a process forked from the zygote per call against an
interpreter started per call (``rollart.env.adapters.sandbox``), side by side.

Three measures, each both ways, in alternating blocks (fresh, zygote, fresh, zygote …;
the figure of a side is its median block):

* ``seq``: one call after another of calc's tool (``run_python("7 * 8")``): ms a call,
  and the machine's CPU seconds a call (``psutil.cpu_times`` of every core, so the
  sandbox processes' CPU counts, not only this process's);
* ``par``: calls on 4 threads at once, as the warm-up plays calc's episodes: calls/s;
* ``calc``: warm-up batches/s of calc alone with its tool undeclared (the chat graph's
  first warm-up stage, ``warmup_batch`` of 32 episodes on 4 threads, no model); both
  ways build the same ids (checked).

RESULT keys: ``seq_ms_fresh``, ``seq_ms_zygote``, ``cpu_ms_fresh``, ``cpu_ms_zygote``,
``par_calls_s_fresh``, ``par_calls_s_zygote``, ``calc_batches_s_fresh``,
``calc_batches_s_zygote``, ``seq_speedup``, ``par_speedup``, ``calc_speedup``
(zygote ÷ fresh, time or rate), ``blocks``.

    python benchmarks/tool_sandbox.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py

from _results import Run, add_arguments  # noqa: E402


def _cpu_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0)


def seq(fresh: bool, calls: int) -> tuple[float, float]:
    """(ms a call, machine CPU ms a call) of ``calls`` calls one after another."""
    from rollart.env.adapters.tool import run_python

    c0, t0 = _cpu_seconds(), time.perf_counter()
    for i in range(calls):
        out = run_python(f"{i} * 7", fresh=fresh)
        if out.output != str(i * 7):
            raise AssertionError(f"{'fresh' if fresh else 'zygote'}: {i} * 7 gave {out}")
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    return 1000 * wall / calls, 1000 * cpu / calls


def par(fresh: bool, calls: int, threads: int = 4) -> float:
    """Calls/s of ``calls`` calls on ``threads`` threads."""
    from rollart.env.adapters.tool import run_python

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(lambda i: run_python(f"{i} + 1", fresh=fresh).output,
                             range(calls)))
        rate = calls / (time.perf_counter() - t0)
    if outs != [str(i + 1) for i in range(calls)]:
        raise AssertionError("a parallel call returned another call's output")
    return rate


def calc_batches(fresh: bool, tasks, tok, batches: int):
    """Warm-up batches/s of calc alone, tools undeclared, and the ids built."""
    import rollart.env.adapters.tool as tool
    from rollart.chat.conversation import ConversationFormat
    from rollart.env.adapters.sandbox import run_code
    from rollart.trainer.warmup import warmup_batch

    fmt = ConversationFormat(tok, "chat", max_context=2048)
    rng = random.Random(0)
    ids = []
    saved = tool.run_code
    tool.run_code = lambda *a: run_code(*a[:4], fresh=fresh)  # what CalcToolEnv calls
    try:
        with ThreadPoolExecutor(4) as pool:
            t0 = time.perf_counter()
            for _ in range(batches):
                ids.append(warmup_batch(tasks, tok, 32, rng, fmt, {}, False, pool=pool)[0])
            rate = batches / (time.perf_counter() - t0)
    finally:
        tool.run_code = saved
    return rate, ids


def main(argv=None) -> dict:
    import torch

    from graphs.chat import tasks as chat_tasks
    from rollart.corpus import chat_corpus
    from rollart.env.adapters.sandbox import can_fork
    from rollart.model import build_tiny_model, load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=3, help="blocks a side, alternating")
    p.add_argument("--calls", type=int, default=200, help="calls a block (seq and par)")
    p.add_argument("--batches", type=int, default=10, help="calc warm-up batches a block")
    p.add_argument("--quick", action="store_true", help="1 block of 20 calls, 2 batches")
    add_arguments(p)
    args = p.parse_args(argv)
    run = Run("tool_sandbox", args, argv)
    if not can_fork():
        raise SystemExit("this platform has no os.fork / socket.send_fds: no zygote")
    blocks, calls, batches = ((1, 20, 2) if args.quick
                              else (args.blocks, args.calls, args.batches))
    torch.set_num_threads(1)
    tasks = chat_tasks()
    calc = [t for t in tasks if t.name == "calc"]
    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(build_tiny_model(d, chat_corpus(tasks), chat=True))
    seq(False, 3)  # start the zygote and warm both paths
    seq(True, 3)
    got: dict = {}
    ids: dict = {}
    for _ in range(blocks):
        for fresh in (True, False):
            side = "fresh" if fresh else "zygote"
            ms, cpu = seq(fresh, calls)
            got.setdefault(f"seq_ms_{side}", []).append(ms)
            got.setdefault(f"cpu_ms_{side}", []).append(cpu)
            got.setdefault(f"par_calls_s_{side}", []).append(par(fresh, calls))
            rate, built = calc_batches(fresh, calc, tok, batches)
            got.setdefault(f"calc_batches_s_{side}", []).append(rate)
            ids.setdefault(side, built)
    if any(not torch.equal(a, b) for a, b in zip(ids["fresh"], ids["zygote"])):
        raise AssertionError("the two sandboxes' warm-up batches differ")
    # unrounded: the RESULT line gives 4 significant digits, so each speedup agrees with
    # the figures it divides at any size
    result = {k: statistics.median(v) for k, v in got.items()}
    result["seq_speedup"] = result["seq_ms_fresh"] / result["seq_ms_zygote"]
    result["par_speedup"] = result["par_calls_s_zygote"] / result["par_calls_s_fresh"]
    result["calc_speedup"] = result["calc_batches_s_zygote"] / result["calc_batches_s_fresh"]
    result["blocks"] = blocks
    run.result(result)
    return result


if __name__ == "__main__":
    main()
