"""The one rule for "is this actor lost?", used on the driver and on the workers alike.

A Dask actor lives in one worker process; when that worker dies, calls on the actor
fail in one of a few ways, and the scheduler stops listing the worker a moment later.
``is_lost(error, actor, live)`` answers from what is known where it is asked:

* the error alone (on a worker: ``LLMProxy`` re-routing a generation): an ``OSError``
  that is not a time-out ("Unable to contact Actor's worker", a closed comm), or
  Dask's ``RuntimeError("Worker holding Actor was lost")``;
* with the actor and the scheduler's live workers (on the driver: ``rollart.control``'s
  ``Fleet``): also when its worker is no longer listed or its future failed, whatever
  the error was (a call that was in flight when the worker died may fail otherwise).

No Dask calls here: the caller passes what the scheduler said (``live``: address ->
resources, ``rollart.runtime.resources.cluster_tags``).

>>> is_lost(OSError("Unable to contact Actor's worker"))
True
>>> is_lost(TimeoutError("no answer"))
False
>>> class A: _address = "tcp://a:1"
>>> is_lost(ValueError("bad"), A(), live={"tcp://b:2": {}}), is_lost(None, A(), {"tcp://a:1": {}})
(True, False)
"""

from __future__ import annotations

__all__ = ["gone", "is_lost"]


def _lost_error(error: BaseException | None) -> bool:
    if error is None or isinstance(error, TimeoutError):  # TimeoutError is an OSError
        return False
    return isinstance(error, OSError) or (
        isinstance(error, RuntimeError) and "Worker holding Actor was lost" in str(error))


def gone(actor, live: dict) -> bool:
    """``actor``'s worker is not among ``live``, or the future that built it failed."""
    fut = getattr(actor, "_future", None)
    return (fut is not None and fut.status == "error") or actor._address not in live


def is_lost(error: BaseException | None, actor=None, live: dict | None = None) -> bool:
    """Did ``error`` (None: no call failed) come from losing ``actor``'s worker? With
    ``actor`` and ``live`` the scheduler's view decides too (see the module doc)."""
    if _lost_error(error):
        return True
    return actor is not None and live is not None and gone(actor, live)
