"""The trainer first on a shared host: rollout processes yield the CPU to the trainer's.

In the asynchronous modes the trainer steps while rollout runs. Where they share a host
(``resources/local.py``: five worker processes on a laptop's cores) the OS splits the
cores evenly between every busy thread, so the trainer's step — which every step needs
— ran at a fraction of a core while rollout, which only has to finish the next batch by
the time the trainer wants it, took the rest. ``yield_to_trainer`` raises the nice value
of the other worker processes on the trainer's host (their threads; ``ROLLOUT_NICE``),
so the trainer gets a core when it computes and rollout every cycle it leaves. Workers
on other hosts, the driver's process and an in-process cluster's workers (the driver's
process too) are left alone. Called once per cluster by ``AsyncPipeline.keep_taking``;
a nice value cannot be lowered again without privileges, so it lasts as long as the
worker process does (``rollart train`` starts and stops its own cluster).
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

ROLLOUT_NICE = 10  # measured on 2 cores: the trainer's step 1.98 s -> 1.25 s (README)


def host_and_pid() -> tuple[str, int]:
    """This process's host name and pid (run on each worker by ``client.run``)."""
    return socket.gethostname(), os.getpid()


def lower_priority(nice: int = ROLLOUT_NICE) -> int:
    """Raise every thread of this process to at least ``nice``; returns how many threads
    changed. Linux sets nice per thread, so each one in ``/proc/self/task`` is set."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's own value
        tids = [0]
    changed = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # a thread that just ended
            continue
    return changed


def yield_to_trainer(client, trainer_address: str, nice: int = ROLLOUT_NICE) -> list[str]:
    """Lower the priority of the worker processes on ``trainer_address``'s host other
    than the trainer's (and the driver's) to ``nice``; returns their addresses."""
    where = client.run(host_and_pid)
    if trainer_address not in where:
        return []
    host, trainer_pid = where[trainer_address]
    mine = (socket.gethostname(), os.getpid())
    others = [a for a, (h, pid) in where.items()
              if h == host and pid != trainer_pid and (h, pid) != mine]
    if others:
        client.run(lower_priority, nice, workers=others)
        logger.info("rollout workers %s yield the CPU to the trainer (nice %d)", others, nice)
    return others
