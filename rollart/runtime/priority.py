"""The trainer first on a shared host: rollout processes yield the CPU to the trainer's.

In the asynchronous modes the trainer steps while rollout runs. Where they share a host
(``resources/local.py``: five worker processes on a laptop's cores) the OS splits the
cores evenly between every busy thread, so the trainer's step — which every step needs
— ran at a fraction of a core while rollout, which only has to finish the next batch by
the time the trainer wants it, took the rest. ``yield_to_trainer`` raises the nice value
of the other worker processes on the trainer's host (their threads; ``ROLLOUT_NICE``),
so the trainer gets a core when it computes and rollout every cycle it leaves. Workers
on other hosts, the driver's process and an in-process cluster's workers (the driver's
process too) are left alone. Called once per run by ``AsyncPipeline.keep_taking``.

``give_back`` undoes it when the run ends (``AsyncPipeline.close``): each thread of
those processes still at the raised value (those started since included: a thread
inherits its creator's nice) goes back to the value the process had, so the next run on
the same cluster — another mode of a benchmark, the next run of a notebook — starts from
the same priorities. Lowering a nice value needs privileges (root, or
``CAP_SYS_NICE``); without them the workers stay niced, and a warning says so and what
to do (a fresh cluster per run: ``rollart train`` starts and stops its own).
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

#: measured on 2 cores: the trainer's step 1.98 s -> 1.25 s (docs/benchmarks/default-run.md)
ROLLOUT_NICE = 10


def host_and_pid() -> tuple[str, int]:
    """This process's host name and pid (run on each worker by ``client.run``)."""
    return socket.gethostname(), os.getpid()


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's own value
        return [0]


def lower_priority(nice: int = ROLLOUT_NICE) -> int | None:
    """Raise every thread of this process to at least ``nice``; returns the nice value
    the process had (its main thread's), or None when no thread changed. Linux sets
    nice per thread, so each one in ``/proc/self/task`` is set."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    changed = 0
    for tid in _threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # a thread that just ended
            continue
    return base if changed else None


def restore_priority(base: int, nice: int = ROLLOUT_NICE) -> tuple[int, int]:
    """Put every thread of this process still at ``nice`` back to ``base``; returns
    ``(restored, refused)`` (refused: lowering needs privileges)."""
    restored = refused = 0
    for tid in _threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) == nice and base < nice:
                os.setpriority(os.PRIO_PROCESS, tid, base)
                restored += 1
        except PermissionError:
            refused += 1
        except OSError:  # a thread that just ended
            continue
    return restored, refused


def thread_nices() -> list[int]:
    """The nice value of each thread of this process (run on workers by checks)."""
    out = []
    for tid in _threads():
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, tid))
        except OSError:
            continue
    return out


def yield_to_trainer(client, trainer_address: str, nice: int = ROLLOUT_NICE
                     ) -> dict[str, int]:
    """Lower the priority of the worker processes on ``trainer_address``'s host other
    than the trainer's (and the driver's) to ``nice``; returns ``{address: the nice
    value it had}`` of those that changed (``give_back``'s input)."""
    where = client.run(host_and_pid)
    if trainer_address not in where:
        return {}
    host, trainer_pid = where[trainer_address]
    mine = (socket.gethostname(), os.getpid())
    others = [a for a, (h, pid) in where.items()
              if h == host and pid != trainer_pid and (h, pid) != mine]
    if not others:
        return {}
    before = client.run(lower_priority, nice, workers=others)
    changed = {a: b for a, b in before.items() if b is not None}
    if changed:
        logger.info("rollout workers %s yield the CPU to the trainer (nice %d)",
                    sorted(changed), nice)
    return changed


def give_back(client, yielded: dict[str, int], nice: int = ROLLOUT_NICE) -> list[str]:
    """Undo ``yield_to_trainer`` on the workers still there; returns the addresses
    that could not be restored (a warning names them and what to do)."""
    live = set(client.scheduler_info().get("workers", {}))
    stuck = []
    for address, base in yielded.items():
        if address not in live:
            continue  # gone: its priority went with its process
        try:
            _, refused = client.run(restore_priority, base, nice,
                                    workers=[address])[address]
        except Exception:  # noqa: BLE001 - the worker left meanwhile
            continue
        if refused:
            stuck.append(address)
    if stuck:
        logger.warning("rollout workers %s stay at nice %d (lowering it back needs root or "
                       "CAP_SYS_NICE): a run started next on this cluster gives its "
                       "trainer's host to the trainer from the start; start a fresh "
                       "cluster per run to compare runs fairly", stuck, nice)
    return stuck
