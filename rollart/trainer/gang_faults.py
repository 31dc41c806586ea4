"""What a trainer gang's rank 0 does about faults besides failing as one
(``rollart.trainer.gang``): it waits for TRAIN workers and says so, and it keeps the
record of its restarts.

* ``wait_for_workers``: the other ranks' workers, waiting for a lost one to come back
  (its Nanny, or a ``dask worker`` started by hand). After ``NOTICE_AFTER`` s it says on
  the driver's console how many workers with the ``TRAIN`` resource to start
  (``notice``: a Dask event on the ``NOTICES`` topic, which
  ``rollart.control.supervisor.Supervisor`` prints); after the gang's ``join_timeout``
  it raises ``GangWaitError``, which ``rollart.control.loop`` turns into a checkpoint
  and one error line.
* ``Restarts``: the gang that failed (its workers, when, in what) until the next one
  forms, then one event per rank whose worker was replaced (the run's
  ``recovery.json``, through the step's ``trainer/gang_events``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from rollart.types import TRAIN

logger = logging.getLogger(__name__)

__all__ = ["GangWaitError", "NOTICES", "NOTICE_AFTER", "Restarts", "notice",
           "wait_for_workers"]

NOTICES = "rollart-trainer"  #: the Dask event topic of the trainer's console lines
NOTICE_AFTER = 3.0  #: seconds a gang waits for TRAIN workers before it says so


class GangWaitError(RuntimeError):
    """The gang could not form: fewer TRAIN workers than its ranks for its
    ``join_timeout`` (the message says how many to start). Not a lost worker: the run
    ends with a checkpoint (``rollart.control.loop``)."""


def notice(text: str) -> None:
    """``text`` in this worker's log and as one line on the driver's console (a Dask
    event on ``NOTICES``: ``rollart.control.supervisor.Supervisor`` logs it)."""
    from distributed import get_worker

    logger.warning("%s", text)
    try:
        get_worker().log_event(NOTICES, {"text": text})
    except ValueError:  # not on a Dask worker (a trainer built in a test's process)
        pass


async def wait_for_workers(client, me: str, world: int, timeout: float) -> list[str]:
    """``world - 1`` live TRAIN workers besides ``me`` (sorted), waiting up to
    ``timeout`` s for them (said after ``NOTICE_AFTER`` s); ``GangWaitError`` after."""
    from rollart.runtime.resources import workers_with

    loop = asyncio.get_running_loop()
    t0, said = loop.time(), False
    while True:
        found = [a for a in await loop.run_in_executor(None, workers_with, client, TRAIN)
                 if a != me]
        more = world - 1 - len(found)
        if more <= 0:
            if said:
                notice(f"the trainer gang of {world} ranks has its TRAIN workers again "
                       f"after {loop.time() - t0:.0f} s; it forms")
            return sorted(found)[:world - 1]
        if loop.time() - t0 > timeout:
            raise GangWaitError(
                f"the trainer gang has {world} ranks but only {len(found) + 1} TRAIN "
                f"workers are alive after {timeout:.0f} s; start {more} more (or raise "
                f"Dask's config rollart.waits.start)")
        if not said and loop.time() - t0 >= NOTICE_AFTER:
            said = True
            notice(f"the trainer gang of {world} ranks waits for {more} more worker(s) "
                   f"with the {TRAIN!r} resource ({len(found) + 1} alive): start {more} "
                   f"(dask worker SCHEDULER --resources {TRAIN}=1), or let a Nanny "
                   f"restart a lost one; it waits {timeout:.0f} s (Dask's config "
                   "rollart.waits.start), then the run stops with a checkpoint")
        await asyncio.sleep(0.5)


class Restarts:
    """The record of a gang's restarts: ``failed`` when the gang fails (the first
    failure counts until it forms again), ``formed`` when a gang forms, ``take`` the
    events not reported yet.

    >>> r = Restarts()
    >>> r.failed(["a", "b"], "a step: OSError()")
    >>> r.formed("a", ["c"], 2, 4)
    >>> [(e["rank"], e["address"], e["replacement"]) for e in r.take()], r.take()
    ([(1, 'b', 'c')], [])
    """

    def __init__(self):
        self.count = 0  # gangs formed again after a rank failed (trainer/gang_restarts)
        self._failure: dict | None = None
        self._events: list[dict] = []

    def failed(self, ranks: list[str], what: str) -> None:
        """The gang over ``ranks`` (rank 0's worker first) failed in ``what``."""
        self.count += 1
        if self._failure is None:  # a second failure before it formed: the first counts
            self._failure = {"ranks": list(ranks), "at": time.time(), "what": what[:300]}

    def formed(self, me: str, others: list[str], world: int, version: int) -> None:
        """A gang of ``world`` ranks formed (rank 0 on ``me``, the others on ``others``)
        from weights ``version``: after a failure, one event per rank whose worker was
        replaced (the failed gang's not in this one), or one for the gang if every
        worker stayed (a broken or timed-out collective)."""
        failed, now = self._failure, time.time()
        if failed is None:
            return
        self._failure = None
        gone = [(r, a) for r, a in enumerate(failed["ranks"]) if a not in others and a != me]
        new = [a for a in others if a not in failed["ranks"]]
        for i, (rank, addr) in enumerate(gone or [(None, ", ".join(failed["ranks"]))]):
            self._events.append({"role": "trainer", "rank": rank, "address": addr,
                                 "replacement": new[i] if i < len(new) else me,
                                 "lost_at": failed["at"], "recovered_at": now,
                                 "recovery_s": now - failed["at"], "ranks": world,
                                 "restored_from": f"weights v{version}",
                                 "gang_restart": failed["what"]})

    def take(self) -> list[dict]:
        """The events not taken yet (a step's ``trainer/gang_events``)."""
        out, self._events = self._events, []
        return out
