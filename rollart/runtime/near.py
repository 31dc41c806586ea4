"""Calls to a Dask actor that lives on the caller's own worker, without the comm.

Dask sends a call to an ``async`` actor method over TCP even when caller and actor share
a worker (both ends serialise the arguments and the result). ``near(actor)`` gives a
``Near`` wrapper around the actor's object instead when it lives on this worker, and the
actor handle itself otherwise, so code awaits ``near(x).method(...)`` either way. Used
by env managers for the sample buffer and by ``LLMProxy`` for inference workers: on a
layout that puts them on one worker (``resources/laptop.py``) a turn then costs no
serialisation at all. No state of its own.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter

#: calls made through ``Near`` in this process, by method name (for tests and profiling)
calls: Counter = Counter()


class Near:
    """An actor that lives on this very worker, called without a round trip through the
    worker's own comm (Dask sends an ``async`` actor method to itself over TCP, with
    both ends serialising). Each call still runs as a task of its own that the caller's
    cancellation does not reach, as a remote call would: a trajectory cancelled while it
    delivers does not cut the buffer's bookkeeping short, and one cancelled while it
    waits for its tokens leaves the request to ``abort``. Arguments and results are
    shared, not copied: a caller hands them over."""

    def __init__(self, actor, obj):
        self.actor, self._obj = actor, obj

    def __getattr__(self, name):  # first use of ``name``: the wrapper is kept
        method = getattr(self._obj, name)
        if not callable(method):
            return method
        run = method if inspect.iscoroutinefunction(method) else \
            (lambda *a, **k: asyncio.to_thread(method, *a, **k))  # Dask threads these

        def call(*args, **kwargs):
            calls[name] += 1
            return asyncio.shield(asyncio.ensure_future(run(*args, **kwargs)))

        self.__dict__[name] = call
        return call

    def __reduce__(self):  # travels (e.g. in a checkpoint) as the actor handle
        return (_identity, (self.actor,))


def _identity(x):
    return x


def near(actor):
    """``actor`` itself, or a ``Near`` to its object when it lives on this worker."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return actor
    if getattr(actor, "_address", None) != worker.address:
        return actor
    obj = worker.state.actors.get(getattr(actor, "key", None))
    return actor if obj is None else Near(actor, obj)
