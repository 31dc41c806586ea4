"""``LLMProxy``: routes each trajectory's generation calls to one ``InferenceWorker``.

Consumes ``(traj_id, GenRequest, pools)`` from an env manager; produces the worker's
``GenResult``. A trajectory sticks to the worker that served its first turn (its
prompt prefix lives there); a new one goes to the least-loaded worker (fewest
in-flight calls through this proxy, ties round robin) among the allowed pools. The
proxy is a plain picklable object shipped into env-manager actors: all counters are
local to the copy, so routing costs no extra Dask hop. Await ``generate`` on the event
loop of the Dask worker (or asynchronous client) that holds the actor handles.

A worker whose process is lost (its actor call raises ``OSError`` or "Worker holding
Actor was lost") is marked dead in this copy and the request is re-sent to another
worker of the allowed pools (requests carry the whole context, so any worker can serve
them); the driver re-creates the actor and hands the managers a new list.
"""

from __future__ import annotations

import threading
from typing import Any

from rollart.types import GenRequest, GenResult


class LLMProxy:
    """Sticky, load-balancing router over ``[(actor_handle, pool_tag), ...]``."""

    def __init__(self, workers: list[tuple[Any, str]]):
        if not workers:
            raise ValueError("LLMProxy needs at least one (InferenceWorker actor, pool) pair")
        self.workers = [(actor, str(pool)) for actor, pool in workers]
        self._sticky: dict[str, int] = {}
        self._in_flight = [0] * len(self.workers)
        self._routed = [0] * len(self.workers)
        self._next = 0  # round-robin cursor for ties
        self._lock: threading.Lock | None = None
        self.dead: set[int] = set()  # workers found lost (never routed to again)
        self.rerouted = 0  # requests re-sent after their worker was lost

    # -- pickling: locks and in-flight counts are local to one copy -----------------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_in_flight"] = [0] * len(self.workers)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def pools(self) -> tuple[str, ...]:
        """The pool tags carried by at least one worker, sorted."""
        return tuple(sorted({pool for _, pool in self.workers}))

    def _guard(self) -> threading.Lock:
        if self._lock is None:
            self._lock = threading.Lock()
        return self._lock

    # -- routing ----------------------------------------------------------------------
    def _allowed(self, pools) -> list[int]:
        if pools is None:
            return list(range(len(self.workers)))
        if isinstance(pools, str):
            pools = (pools,)
        if not pools:
            raise ValueError(f"pools is empty: pass None or some of {list(self.pools)}")
        unknown = [p for p in pools if p not in self.pools]
        if len(unknown) == len(pools):  # some missing is fine (a lost worker's pool)
            raise ValueError(
                f"no inference worker carries pool(s) {unknown}; available pools: "
                f"{list(self.pools)}"
            )
        return [i for i, (_, pool) in enumerate(self.workers) if pool in pools]

    def route(self, traj_id: str, pools: tuple[str, ...] | None = None) -> int:
        """Index of the worker for ``traj_id`` (sticky; else least loaded, ties RR)."""
        allowed = [i for i in self._allowed(pools) if i not in self.dead]
        if not allowed:
            raise WorkerLostError(f"every inference worker of pools {pools or self.pools} "
                                  "was lost; the driver re-creates them when their workers "
                                  "come back")
        with self._guard():
            idx = self._sticky.get(traj_id)
            if idx is None or idx not in allowed:
                least = min(self._in_flight[i] for i in allowed)
                ties = [i for i in allowed if self._in_flight[i] == least]
                n = len(self.workers)
                idx = min(ties, key=lambda i: (i - self._next) % n)
                self._next = (idx + 1) % n
                self._sticky[traj_id] = idx
            self._routed[idx] += 1
            self._in_flight[idx] += 1
        return idx

    async def generate(
        self, traj_id: str, req: GenRequest, pools: tuple[str, ...] | None = None
    ) -> GenResult:
        """Send ``req`` to ``traj_id``'s worker and return its ``GenResult``."""
        while True:
            idx = self.route(traj_id, pools)
            try:
                return await self.workers[idx][0].generate(req)
            except Exception as e:
                if not is_worker_lost(e):
                    raise
                with self._guard():
                    self.dead.add(idx)
                    self._sticky.pop(traj_id, None)
                    self.rerouted += 1
            finally:
                with self._guard():
                    self._in_flight[idx] -= 1

    def release(self, traj_id: str) -> None:
        """Forget ``traj_id`` (call when the trajectory is finished)."""
        with self._guard():
            self._sticky.pop(traj_id, None)

    def stats(self) -> dict:
        """Per-worker routed/in-flight counts of this proxy copy."""
        with self._guard():
            workers = [
                {
                    "key": str(getattr(actor, "key", i)),
                    "pool": pool,
                    "routed": self._routed[i],
                    "in_flight": self._in_flight[i],
                }
                for i, (actor, pool) in enumerate(self.workers)
            ]
            return {"workers": workers, "trajectories": len(self._sticky),
                    "dead": len(self.dead), "rerouted": self.rerouted}


class WorkerLostError(RuntimeError):
    """No live inference worker is left to serve a request."""


def is_worker_lost(error: BaseException) -> bool:
    """True when ``error`` says the Dask worker holding an actor is gone."""
    if isinstance(error, TimeoutError):  # an OSError subclass, but not a lost worker
        return False
    return isinstance(error, OSError) or (
        isinstance(error, RuntimeError) and "Worker holding Actor was lost" in str(error))
