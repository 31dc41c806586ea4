"""What the first minutes of a run print: the cluster starting, the model, the warm-up.

Consumes the control loop's start-up phases; produces progress lines and ``tqdm`` bars
on the terminal (nothing when ``enabled`` is false: notebooks' ``start_run`` and the
tests). The warm-up runs inside the trainer actor; ``warmup_bar`` polls the actor's
``warmup_done`` counter from the driver (an attribute read, served by the worker's event
loop while the warm-up computes in the trainer's own thread), so it never blocks it.
Called by ``rollart.control.loop``.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager


def say(text: str, enabled: bool = True) -> None:
    """One progress line on stderr (stdout stays for results)."""
    if enabled:
        print(f"rollart: {text}", file=sys.stderr, flush=True)


@contextmanager
def phase(text: str, enabled: bool = True):
    """``rollart: TEXT ...`` now, ``rollart: TEXT: done in 3.2 s`` after."""
    t0 = time.time()
    say(f"{text} ...", enabled)
    yield
    say(f"{text}: done in {time.time() - t0:.1f} s", enabled)


def _bar(total: int, desc: str, enabled: bool, unit: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


@contextmanager
def cluster_bar(n_workers: int, enabled: bool = True, interval: float = 0.25):
    """A bar of workers connected while a ``SpecCluster`` starts in this process (the
    constructor blocks; a thread counts the workers of the newest local scheduler)."""
    if not enabled:
        yield
        return
    from distributed import Scheduler

    known = set(Scheduler._instances)  # schedulers from before: not ours
    bar = _bar(n_workers, "starting Dask workers", enabled, "worker")
    stop = threading.Event()

    def poll():
        while not stop.wait(interval):
            new = [s for s in list(Scheduler._instances) if s not in known]
            if new and min(len(new[-1].workers), n_workers) != bar.n:
                bar.n = min(len(new[-1].workers), n_workers)
                bar.refresh()

    thread = threading.Thread(target=poll, name="rollart-cluster-bar", daemon=True)
    thread.start()
    try:
        yield
        bar.n = n_workers
    finally:
        stop.set()
        thread.join(timeout=2)
        bar.close()


def warmup_bar(trainer, future, total: int, enabled: bool = True,
               interval: float = 0.5, stop=None):
    """Wait for the warm-up ``future`` (an actor call on ``trainer``) with a bar of its
    steps; returns its result (re-raises its error). Once ``stop()`` is true (the run
    was asked to stop: ``rollart.observe.metrics.stop_requested``) the trainer is told
    to end the warm-up after its current step (``Trainer.stop_warmup``)."""
    bar = _bar(total, "format warm-up", enabled, "step")
    stopping = None
    try:
        while not future.done():
            time.sleep(interval)
            if stopping is None and stop is not None and stop():
                stopping = trainer.stop_warmup()  # the warm-up's future ends soon after
            if enabled:
                try:
                    done = min(int(trainer.warmup_done), total)
                except Exception:  # noqa: BLE001 - the bar is best effort
                    continue
                if done != bar.n:
                    bar.n = done
                    bar.refresh()
        result = future.result()
        bar.n = total
        return result
    finally:
        bar.close()
