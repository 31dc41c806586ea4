"""``WeightPrefetch``: an ``InferenceWorker``'s prefetch thread, which finds and loads
weight versions while its engine keeps decoding.

It watches the worker's ``WeightStore`` (``latest()`` every ``watch`` seconds, and at
once when a caller waits for a version), holds a version while reading it so the store's
gc keeps it, and stages it with the engine: a bucketed full version as a started
``BucketStream`` (``request_stream``; the engine copies each bucket in at a decode-step
boundary), anything else whole (``request_update``), a LoRA adapter with its base's
full weights when the engine lacks them. A mixin of ``rollart.rollout.worker.
InferenceWorker``, whose condition (``_cond``), wanted/fetched versions, waiters and
engine it uses; ``InferenceWorker.__init__`` starts the thread.
"""

from __future__ import annotations

import time

from rollart.weights import lora
from rollart.weights.store import BucketStream, WeightStore


class WeightPrefetch:
    """The prefetch-thread half of ``InferenceWorker`` (module docstring)."""

    def _prefetch_loop(self) -> None:
        # the watch looks every ``watch`` seconds, however often the condition wakes this
        # thread (every request submitted notifies it: looking at each wake-up made as
        # many store reads as requests, 3-4x the watch's rate in the weight-sync runs)
        next_look = 0.0  # time.monotonic() of the watch's next look
        while True:
            with self._cond:
                if not (self._stop or self._wanted > self._fetched or self._look_now):
                    wait = max(next_look - time.monotonic(), 0.0) if self.watch else None
                    if wait is None or wait > 0:
                        self._cond.wait(wait)
                if self._stop:
                    return
                target = self._wanted if self._wanted > self._fetched else None
                due = bool(self.watch) and time.monotonic() >= next_look
                look, self._look_now = due or self._look_now, False
            if target is None:
                if look:
                    if self.watch:
                        next_look = time.monotonic() + self.watch
                    self._look()
                continue
            t0 = time.perf_counter()
            try:
                target = self._stage(target)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to wait_version callers
                error = exc
            self.prefetch_seconds += time.perf_counter() - t0
            self.prefetches += error is None
            with self._cond:
                if error is None:
                    self._fetched = max(self._fetched, target)
                else:
                    self._load_error, self._failed_at = (target, error), time.monotonic()
                    if self._wanted == target:  # nothing newer asked for: allow a retry
                        self._wanted = self._fetched
                    self._settle_waiters(target, error)
                self._cond.notify_all()  # wakes an idle engine thread to apply it

    def _look(self) -> None:
        """Watch the store (prefetch thread): a version newer than held or asked for is
        wanted now; one that failed to load is tried again after ``retry_after`` s."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            latest = self._open_store().latest()
            self._watch_error = None
        except Exception as exc:  # noqa: BLE001 - reported in stats(), tried again
            self._watch_error = f"reading the store's latest version: {exc!r}"
            return
        finally:  # what watching costs (the weight-sync benchmark compares the stores)
            self.watches += 1
            self.watch_seconds += time.perf_counter() - t0
            self.watch_cpu_seconds += time.thread_time() - c0
        self._latest_seen = latest
        with self._cond:
            err = self._load_error
            if err is not None and err[0] >= latest and \
                    time.monotonic() - self._failed_at < self.retry_after:
                return
            if latest > max(self._wanted, self._fetched, self.engine.version):
                self._wanted = latest

    def _open_store(self) -> WeightStore:
        if self._store is None:
            self._store = WeightStore(self.store_url)
        return self._store

    def _stage(self, target: int) -> int:
        """Fetch ``target`` (``_fetch``) and stage it with the engine; returns the
        version staged."""
        got, target = self._fetch(target)
        if isinstance(got, BucketStream):
            try:
                self.engine.request_stream(got, target)  # the engine closes it
            except BaseException:
                got.close()
                raise
            self.streamed += 1
        else:
            self.engine.request_update(got, target)
        return target

    def _fetch(self, target: int) -> tuple[dict | BucketStream, int]:
        """``(weights, version)`` of ``target`` from the store. Held (``hold``) so garbage
        collection keeps it while it is read; if it was collected before the hold (newer
        versions exist), the newest instead.

        A bucketed full version, for an engine that ``streams_weights``, comes as a
        started ``BucketStream`` for ``request_stream``: it reads two buckets ahead now
        and the engine copies each in at its next decode-step boundary, so this worker
        never holds a second copy of the model; the hold ends when the stream is closed
        (loaded or superseded). Anything else (one blob, a LoRA adapter, an engine with
        LoRA) is read whole: a state dict for ``request_update``."""
        store, reader = self._open_store(), self._reader
        store.hold(reader, target)
        try:
            try:
                stream = store.iter_buckets(target, reader=reader,
                                            on_close=self._releaser(store, target))
            except KeyError:
                newest = store.latest()
                if newest <= target:
                    raise
                target = newest
                store.hold(reader, target)
                with self._cond:
                    self._wanted = max(self._wanted, newest)
                stream = store.iter_buckets(target, reader=reader,
                                            on_close=self._releaser(store, target))
        except BaseException:
            store.release(reader)
            raise
        with self._cond:
            self._holding = target
        try:
            if stream.names and lora.base_of(stream.metadata) is None and \
                    getattr(self.engine, "streams_weights", False):
                self._base = target  # a full version is a base of its own
                return stream.start(), target
            if stream.names:  # whole: the buckets in parallel
                state = store.get(target, reader=reader)
            else:
                state = dict(next(iter(stream))[1])
            state = self._with_base(store, target, state, stream.metadata)
        except BaseException:
            stream.close()
            raise
        stream.close()
        return state, target

    def _releaser(self, store: WeightStore, version: int):
        """``on_close`` of ``version``'s stream: release the hold unless this worker
        holds a newer version by now."""

        def release():
            with self._cond:
                if self._holding not in (None, version):
                    return
                self._holding = None
            store.release(self._reader)

        return release

    def _with_base(self, store: WeightStore, target: int, state: dict, meta: dict) -> dict:
        """A LoRA adapter version (``rollart.weights.lora``) with the full weights of its
        base when the engine was not sent them yet (a worker that joined after the
        warm-up's base was published); a full version is a base of its own."""
        base = lora.base_of(meta)
        if base is None:
            self._base = target
            return state
        if base == self._base:
            return state
        if base < 0:  # the model folder's weights: the engine would have to reload them
            raise RuntimeError(
                f"weight version {target} is an adapter on the model folder's weights, and "
                f"this engine was sent other full weights (v{self._base}): the store mixes "
                "two runs? Give each run its own weight store")
        self._base = base
        return {**store.get(base), **state}
