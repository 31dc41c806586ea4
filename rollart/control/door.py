"""``Door``: how the driver reaches one actor, with the one time-out and the one lost rule.

A call on an actor goes through a ``Door``: ``call`` (or ``submit`` then ``result``)
waits for it, judges its error and ends its wait. The run's ``Fleet``
(``rollart.control.fleet``) is the ``Door`` with the scheduler's view, the run's actors
and its supervisor; what places and restores actors below the Fleet (``Stages``:
``rollart.control.stages``, the ``Supervisor``'s restore, a checkpoint written without a
pipeline) uses a ``Door`` without a view (``Door()``): the same waits and time-outs,
every error the caller's as raised. ``tests/control/test_one_door.py`` fails when
control code waits on an actor any other way (``.result()`` on an actor call, or the
former ``rollart.runtime.waits.bounded``).

The rules, in one place:

* **lost**: with a view (``live``: the scheduler's workers), an error that says the
  actor's worker was lost, or any error once that worker is no longer listed, is
  ``ActorLost`` (``rollart.runtime.lost.is_lost``), and a wait gives up on a call as
  soon as its worker leaves. Without a view nothing is judged lost.
* **time-out**: a wait past its ``timeout`` is a ``StuckError`` (a ``RuntimeError``,
  never an ``OSError``: a time-out is not a lost worker). With ``stuck`` (what did not
  happen: ``"the trainer on ADDR did not save the model"``) it names the ``Waits``
  ``setting`` that raises the bound (``rollart.runtime.waits.stuck``); without, it names
  the actor. A ``TimeoutError`` the call itself raised is its own, as raised.
"""

from __future__ import annotations

import time

from rollart.runtime.lost import is_lost
from rollart.runtime.waits import StuckError, stuck as stuck_error

__all__ = ["ActorLost", "Door"]


class ActorLost(OSError):
    """A call's actor was lost: its worker left the cluster (``Door``, ``Fleet``)."""


class Door:
    """Calls on actors, their waits and their errors (see the module doc).

    >>> # Door().call(trainer, "save", path, timeout=waits.call,
    >>> #             stuck=f"the trainer on {trainer._address} did not save the model")
    """

    def __init__(self, live=None):
        self._live = live  # () -> {address: resources}: the scheduler's view, or None

    # -- the rule ---------------------------------------------------------------------
    def lost(self, error: BaseException | None, actor=None) -> bool:
        """``error`` came from losing a worker (``actor``'s, if given); without a view,
        never."""
        if self._live is None:
            return False
        return is_lost(error) or (actor is not None and is_lost(None, actor, self._live()))

    def check_alive(self, actor) -> None:
        """``ActorLost`` if ``actor``'s worker left the cluster (with a view)."""
        if self._live is not None and actor is not None and \
                actor._address not in self._live():
            raise ActorLost(f"Unable to contact Actor's worker {actor._address}: it left "
                            "the cluster")

    def _judge(self, error: BaseException, actor) -> BaseException:
        if actor is None or isinstance(error, ActorLost) or not self.lost(error, actor):
            return error
        lost = ActorLost(f"the actor on {actor._address} was lost: "
                         f"{type(error).__name__}: {error}")
        lost.__cause__ = error
        return lost

    # -- calls ------------------------------------------------------------------------
    def attempt(self, actor, fn):
        """``fn()`` (which calls ``actor``); an error that says ``actor`` was lost comes
        out as ``ActorLost``."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - judged, then raised
            judged = self._judge(e, actor)
            if judged is e:
                raise
            raise judged from e

    def submit(self, actor, method: str, *args, **kwargs):
        """``actor.method(*args, **kwargs)``'s future."""
        return self.attempt(actor, lambda: getattr(actor, method)(*args, **kwargs))

    def result(self, fut, actor=None, timeout: float | None = None, *,
               stuck: str | None = None, setting: str = "call"):
        """``fut.result()`` of a call on ``actor`` (None: an actor's start, ``fut`` its
        constructor's): ``ActorLost`` as soon as the scheduler no longer lists
        ``actor``'s worker, ``StuckError`` after ``timeout`` s (the module doc). A call
        made just as an in-process worker closed is proxied by the scheduler, which
        retries connecting to the closed address until Dask's connect time-out
        (``distributed.comm.timeouts.connect``: 30 s; 300 s in ``benchmarks/chaos.py``):
        the driver gives up on a lost worker instead."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.5 if end is None else min(0.5, max(end - time.monotonic(), 0.01))
            try:
                return fut.result(timeout=wait)
            except TimeoutError:
                if not fut.done():
                    if end is not None and time.monotonic() >= end:
                        raise self._late(actor, timeout, stuck, setting) from None
                    self.check_alive(actor)
                    continue
            except Exception:  # noqa: BLE001 - the call's own error: judged below
                pass
            return self.attempt(actor, fut.result)  # done: its result, or its error

    def call(self, actor, method: str, *args, timeout: float | None = None,
             stuck: str | None = None, setting: str = "call", **kwargs):
        """``actor.method(*args, **kwargs)``'s result (``result``)."""
        return self.result(self.submit(actor, method, *args, **kwargs), actor, timeout,
                           stuck=stuck, setting=setting)

    @staticmethod
    def _late(actor, timeout: float, stuck: str | None, setting: str) -> StuckError:
        if stuck is not None:
            return stuck_error(stuck, timeout, setting)
        who = "the call" if actor is None else f"the actor on {actor._address}"
        return StuckError(f"{who} gave no answer within {timeout:g} s")
