"""``RequestLog``: a bounded record of the generation requests an ``InferenceWorker``
served, kept only when asked (``InferenceWorker.start_request_log``; off by default, and
then the worker does nothing for it).

The worker stamps a request's arrival when it is queued, notes at admission how many of
its prompt tokens the engine's prefix cache holds (``PrefixCache.peek``), and hands the
request and its ``GenResult`` here when it is delivered. Each record is a plain dict
(it pickles, and crosses ``Client.run`` or an actor call as is):

``arrival`` (seconds after the log started), ``prompt_ids``, ``cached`` (prompt tokens
the prefix cache held when it joined the batch), ``keyed`` (it had a ``cache_key``),
``generated`` (tokens it produced), ``finish_reason``, ``temperature``, ``top_p``,
``seed``, ``stop_ids``, ``stop_strings`` and ``version`` (of its first token).

Only requests that arrived while the log was on and finished normally are kept (an
aborted or failed request is left out; so are PD prefills and decodes); past ``limit``
the oldest records go and ``dropped`` counts them. ``start_request_logs`` and
``take_request_logs`` do the same for every inference worker of a Dask worker, through
``Client.run``: ``benchmarks/limits.py`` reads the log so and replays it into a bare
engine (``benchmarks/_replay.py``).
"""

from __future__ import annotations

import threading
import time
from collections import deque


class RequestLog:
    """Records of served requests (module doc), at most ``limit`` of them."""

    def __init__(self, limit: int = 100_000):
        if limit < 1:
            raise ValueError(f"RequestLog limit must be >= 1, got {limit}")
        self.t0 = time.perf_counter()
        self.records: deque[dict] = deque(maxlen=int(limit))
        self.dropped = 0
        self._lock = threading.Lock()

    def record(self, req, arrived: float, cached: int, result) -> None:
        """Keep one served request (``GenRequest``) and its ``GenResult``; ``arrived``:
        its ``time.perf_counter()`` on arrival, before ``t0`` if it came earlier (then it
        is left out)."""
        if arrived < self.t0 or result.finish_reason == "abort":
            return
        rec = {"arrival": arrived - self.t0, "prompt_ids": list(req.prompt_ids),
               "cached": int(cached), "keyed": req.cache_key is not None,
               "generated": len(result.token_ids), "finish_reason": result.finish_reason,
               "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
               "stop_ids": tuple(req.stop_ids), "stop_strings": tuple(req.stop_strings),
               "version": result.versions[0] if result.versions else None}
        with self._lock:
            if len(self.records) == self.records.maxlen:
                self.dropped += 1
            self.records.append(rec)

    def take(self) -> dict:
        """``{"requests": [...] in arrival order, "dropped", "seconds"}`` (``seconds``:
        since the log started); the log is emptied."""
        with self._lock:
            recs, self.records = list(self.records), deque(maxlen=self.records.maxlen)
            dropped, self.dropped = self.dropped, 0
        recs.sort(key=lambda r: r["arrival"])
        return {"requests": recs, "dropped": dropped,
                "seconds": time.perf_counter() - self.t0}


def start_request_logs(dask_worker, limit: int = 100_000) -> int:
    """``Client.run``: start a request log on each inference worker actor of this Dask
    worker (``InferenceWorker.start_request_log``); how many."""
    workers = [a for a in dask_worker.state.actors.values()
               if callable(getattr(a, "start_request_log", None))]
    for w in workers:
        w.start_request_log(limit)
    return len(workers)


def take_request_logs(dask_worker) -> list[dict]:
    """``Client.run``: the request logs of this Dask worker's inference workers that keep
    one (``InferenceWorker.take_request_log``; they stop)."""
    return [a.take_request_log() for a in dask_worker.state.actors.values()
            if callable(getattr(a, "take_request_log", None))
            and getattr(a, "request_log", None) is not None]
