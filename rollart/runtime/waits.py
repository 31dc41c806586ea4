"""Bounds on the waits of start-up, recovery and shutdown: no wait is silent.

An actor whose constructor hangs (a model folder that never loads, a worker whose only
thread is blocked) or a call that never returns would leave a run waiting with no word.
``Waits`` holds the bounds, read from Dask's config ``rollart.waits``; ``stuck(what,
seconds, setting)`` is the ``StuckError`` past one, naming ``what`` is stuck (the actor,
its worker, its pool) and the setting that raises the bound. The driver waits on actors
only through ``rollart.control.door.Door`` (the run's ``Fleet`` is one), which raises it:
placing and reconciling actors, restoring a trainer, the first publish, saves and
checkpoints. ``Bounded`` is a future with a deadline for code that polls it (the
warm-up's progress bar); ``close_bounded`` closes a client and its cluster within a
bound (``benchmarks/chaos.py``); ``wait_result`` waits on a Dask future from a coroutine
within a time-out, whatever the client (``result_unless``: the synchronous client's
thread, which the wait releases when it ends); ``stop_process`` / ``stop_processes`` end
child processes within a bound (a polite exit line on stdin when asked, then terminate,
then kill).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

__all__ = ["Bounded", "CONFIG", "StuckError", "Waits", "close_bounded",
           "result_unless", "stop_process", "stop_processes", "stuck", "wait_result"]

logger = logging.getLogger(__name__)

CONFIG = "rollart.waits"  # Dask config section of ``Waits``


class StuckError(RuntimeError):
    """An actor did not start, or a call on it did not return, within its ``Waits``
    bound; the message names the actor, its worker and the setting to raise."""


@dataclass(frozen=True)
class Waits:
    """Bounds (seconds) on what start-up, recovery and shutdown wait for.

    ``start``: an actor's constructor (it loads a model: raise it for a large one);
    ``call``: one call on an actor (publish, a weight load, a checkpoint, a save);
    the warm-up: ``call + warmup_step × (Policy.warmup_steps +
    warmup_bare_tool_steps)``. Set them through Dask's config, e.g.
    ``dask.config.set({"rollart.waits.start": 1800})`` or the environment variable
    ``DASK_ROLLART__WAITS__START=1800`` (in the driver's process).

    >>> Waits(call=60, warmup_step=2).warmup(100)
    260.0
    """

    start: float = 900.0  # seconds for an actor's constructor (it loads a model)
    call: float = 600.0  # seconds for one call on an actor (publish, a load, a save)
    warmup_step: float = 30.0  # seconds per warm-up step, on top of ``call``

    def __post_init__(self):
        for name in ("start", "call", "warmup_step"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"dask config {CONFIG}.{name.replace('_', '-')} must be a "
                                 f"number of seconds > 0, got {v!r}")

    @classmethod
    def from_config(cls) -> Waits:
        """The bounds in Dask's config ``rollart.waits`` (``start``, ``call``,
        ``warmup-step``), defaults for those not set."""
        import dask

        cfg = dask.config.get(CONFIG, default=None) or {}
        return cls(**{k.replace("-", "_"): float(v) for k, v in cfg.items()})

    def warmup(self, steps: int) -> float:
        return float(self.call + self.warmup_step * max(int(steps), 0))


class Bounded:
    """``fut`` with a deadline, for code that polls ``done()`` then calls ``result()``
    (``rollart.observe.progress.warmup_bar``): done once ``fut`` is or ``seconds`` have passed;
    ``result()`` past the deadline is ``stuck``'s ``StuckError``."""

    def __init__(self, fut, seconds: float, what: str, setting: str = "call"):
        self.fut, self.what, self.setting = fut, what, setting
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def done(self) -> bool:
        return self.fut.done() or time.monotonic() >= self.end

    def result(self, timeout=None):
        try:
            return self.fut.result(timeout=max(self.end - time.monotonic(), 0.01))
        except TimeoutError:
            raise stuck(self.what, self.seconds, self.setting) from None


def stuck(what: str, seconds: float, setting: str) -> StuckError:
    """The ``StuckError`` for ``what`` past its ``seconds`` bound (``Waits.<setting>``),
    saying how to raise it (``"the Trainer on ADDR (TRAIN) did not start"``)."""
    env = f"DASK_ROLLART__WAITS__{setting.upper().replace('-', '_')}"
    return StuckError(
        f"{what} within {seconds:g} s; see that worker's log (its `dask worker` output, "
        f"or the dashboard's Info page). If it is only slow, raise the bound: "
        f"dask.config.set({{'{CONFIG}.{setting}': S}}) or {env}=S")


def close_bounded(client, cluster, seconds: float = 120.0) -> None:
    """Close ``client``, then ``cluster``, each within ``seconds``; else ``StuckError``
    naming which did not close and what was still pending on the cluster's event loop
    (an in-process cluster's workers, scheduler and client share it), instead of a wait
    with no word or a bare "join timed out"."""
    for what, close in (("the Dask client", client.close), ("the cluster", cluster.close)):
        try:
            close(timeout=seconds)
        except (TimeoutError, OSError) as e:  # "join timed out" is a TimeoutError
            pending = _pending(cluster)
            if what == "the cluster" and str(getattr(cluster, "status", "")) == \
                    "Status.closed":
                # scheduler and workers closed; only the loop's thread did not stop in
                # its 10 s (tasks left by an actor on a worker closed in-process, whose
                # calls never return): nothing of the run is left in it
                logger.warning("the cluster closed, but its event loop's thread did not "
                               "stop (%r); still pending on it: %s", e, pending)
                return
            raise StuckError(f"{what} did not close within {seconds:g} s ({e!r}); still "
                             f"pending on its event loop: {pending}") from e


def _pending(cluster, most: int = 12) -> str:
    """The coroutines of the tasks still pending on ``cluster``'s loop (best effort)."""
    import asyncio

    try:
        tasks = list(asyncio.all_tasks(cluster.loop.asyncio_loop))
    except Exception as e:  # noqa: BLE001 - a diagnostic only: the loop may be gone
        return f"(not readable: {e!r})"
    names = sorted(getattr(t.get_coro(), "__qualname__", repr(t)) for t in tasks
                   if not t.done())
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more or "nothing"


#: how often a thread waiting on a Dask future looks whether its waiter gave up (s)
POLL_S = 0.5


def result_unless(fut, stop: threading.Event, poll: float = POLL_S):
    """``fut.result()`` for a thread (``asyncio.to_thread``) of a coroutine whose Dask
    client is synchronous; raises ``asyncio.CancelledError`` once ``stop`` is set (the
    coroutine gave up: cancelled, timed out) before the result is in.

    A plain ``fut.result()`` has no end when the cluster closes first (the result can no
    longer arrive, and the client's loop is gone): its thread stayed blocked for good,
    and the event loop's shutdown, which waits for its executor's threads, never ended.
    Seen in CI: an in-process cluster closed after a stopped run raised "join timed out",
    and the process never exited (a reward's ``to_thread(fut.result)`` of a cancelled
    trajectory). The task's own error (a ``TimeoutError`` too) is raised as it is."""
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    while not done.wait(poll):
        if stop.is_set():
            raise asyncio.CancelledError(f"gave up waiting for {fut.key}")
    while True:
        try:
            return fut.result(timeout=poll)  # its value (fetched) or its own error
        except TimeoutError:
            if fut.status != "finished":  # "error": the task raised it itself
                raise
            if stop.is_set():  # a fetch that cannot end (the cluster closed)
                raise asyncio.CancelledError(f"gave up fetching {fut.key}") from None


async def wait_result(fut, client, timeout: float):
    """``fut``'s result from a coroutine within ``timeout`` s (``asyncio.TimeoutError``
    after). The wait is shielded: a time-out or a cancellation here does not cancel a
    gather the client may share with other waits. With a synchronous ``client`` the wait
    runs in a thread (``result_unless``) that ends when this wait does; a waiter left
    behind ends unread."""
    stop = threading.Event()
    if client.asynchronous:
        waiter = asyncio.ensure_future(_awaited(fut))
    else:
        waiter = asyncio.ensure_future(asyncio.to_thread(result_unless, fut, stop))
    try:
        return await asyncio.wait_for(asyncio.shield(waiter), timeout)
    finally:
        stop.set()
        if not waiter.done():
            waiter.add_done_callback(_swallow)


async def _awaited(fut):
    return await fut


def _swallow(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def stop_process(proc, grace: float = 10.0, ask: str | None = None) -> None:
    """End ``proc`` (a ``subprocess.Popen``) if it still runs (``stop_processes``)."""
    stop_processes([proc], grace, ask)


def stop_processes(procs, grace: float = 10.0, ask: str | None = None) -> None:
    """End each of ``procs`` (``subprocess.Popen``) that still runs: with ``ask``, first
    that line on its stdin (a polite exit) and ``grace`` seconds for all of them to go;
    then SIGTERM, then SIGKILL once ``grace`` more pass (a process that ignores SIGTERM
    cannot hold its caller)."""
    import subprocess
    import time

    live = [p for p in procs if p is not None and p.poll() is None]
    if ask is not None:
        for p in live:
            try:
                p.stdin.write(ask if ask.endswith("\n") else ask + "\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):  # gone, or stdin closed
                pass
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        live = [p for p in live if p.poll() is None]
    for p in live:
        p.terminate()
    for p in live:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
