"""``Handle``: the Dask actor handle rollart gives its actors (``rollart.control.stages``).

A plain ``distributed.Actor`` handle unpickled on a worker holds a ``Future`` of the
actor's key that the worker's client is never told about; a call that finds the actor's
worker gone awaits that future (Dask waits for the actor to be re-created under its
key). rollart's actors are pinned to their worker and re-created under new keys
(``Stages.reconcile``), so that wait never ends: an env manager's ``generate`` on a
SIGKILLed inference worker hung, held its group's slot, and the run stalled. A
``Handle`` on a worker has no such future, so the call raises ``OSError("Unable to
contact Actor's worker")`` at once: the proxy re-routes it, a trainer step is re-run.
On the driver the future stays (its status says the worker was lost). Built by
``rollart.control.stages`` for every actor it places; pickles as itself.
"""

from __future__ import annotations

from distributed.actor import Actor

__all__ = ["Handle", "handle"]


class Handle(Actor):
    """A Dask actor handle whose calls made on a worker fail fast on a lost worker."""

    def _try_bind_worker_client(self):
        super()._try_bind_worker_client()
        if self._worker is not None:
            self._future = None

    def __reduce__(self):
        return (Handle, (self._cls, self._address, self.key))


def handle(actor) -> Handle:
    """The ``Handle`` of ``actor`` (the handle an actor future's ``result()`` gave)."""
    return Handle(actor._cls, actor._address, actor.key)
