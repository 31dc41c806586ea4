"""``WeightPrefetch``: the part of an ``InferenceWorker`` that finds and loads weight
versions on its own thread while the engine keeps decoding.

Consumes the versions in a ``WeightStore`` (``store_url``): it watches the store
(``latest()`` every ``watch`` seconds, and at once when a caller waits for a version),
takes versions asked for (``want``), holds a version while reading it so the store's gc
keeps it, and produces a staged update in its engine: a bucketed full version as a
started ``BucketStream`` (``engine.request_stream``; the engine copies each bucket in at
a decode-step boundary), anything else whole (``engine.request_update``), a LoRA adapter
with its base's full weights when the engine lacks them. ``on_staged()`` is called after
each version staged (the worker wakes its idle engine thread to apply it), and the
engine's ``on_update`` report goes to ``applied``. Waiters (``wait``) are told when the
engine holds their version or when loading it failed.

Owned by ``rollart.rollout.worker.InferenceWorker`` (``worker.prefetch``): its actor
methods ``update_weights``, ``wait_version``, ``stats`` and ``close`` call this part.
Its own state: the versions wanted and fetched, the last error, the waiters, the store
handle and the version held in it, the LoRA base the engine has, and the counters of
``stats()``. It uses of the engine only ``version``, ``mixed``, ``streams_weights``,
``request_update`` and ``request_stream``. No Dask here.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from rollart.weights import lora
from rollart.weights.store import BucketStream, WeightStore


class WeightPrefetch:
    """Find, hold, load and stage weight versions for one engine (module docstring).

    ``version``: the version the engine starts with; ``reader``: this worker's name in
    the store's holds; ``watch``: seconds between two looks at the store's newest
    version (``None``: only when asked); ``retry_after``: seconds before a version that
    failed to load is tried again; ``name``: the thread's name. ``start()`` starts the
    thread, ``stop()`` ends it.
    """

    def __init__(self, store_url: str, engine, *, version: int, reader: str,
                 watch: float | None = 0.25, retry_after: float = 5.0,
                 on_staged: Callable[[], None] | None = None,
                 name: str = "rollart-prefetch"):
        self.store_url = str(store_url)
        self.engine = engine
        self.reader = reader
        self.watch, self.retry_after = watch, float(retry_after)  # s: store polls, retries
        self.on_staged = on_staged
        self._cond = threading.Condition()
        self._stop = False
        self.wanted = int(version)  # newest version asked for (want, or the watch)
        self.fetched = int(version)  # newest version handed to the engine
        self.load_error: tuple[int, BaseException] | None = None
        self._failed_at = 0.0  # when the latest load failed (time.monotonic)
        self._look_now = False  # a waiter: look at the store without waiting
        self.watch_error: str | None = None  # reading the store's latest() failed
        self._waiters: list[tuple[int, Callable[[object], None]]] = []
        self.latest_seen = -1  # the store's latest() at the last look
        self._store: WeightStore | None = None  # opened by the prefetch thread
        self._holding: int | None = None  # the version this worker holds in the store
        # LoRA: the base version (rollart.weights.lora) sent to the engine; -1: the
        # model folder's, None: unknown (send the base again)
        self._base: int | None = -1
        self.prefetch_seconds = 0.0
        self.prefetches = 0  # versions read from the store and staged
        self.streamed = 0  # of them, staged bucket by bucket (request_stream)
        # the watch: latest() calls, their wall time and the prefetch thread's CPU in them
        self.watches, self.watch_seconds, self.watch_cpu_seconds = 0, 0.0, 0.0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # -- the owner's side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread at its next wake-up (``join`` waits for it)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def want(self, version: int) -> None:
        """Load ``version`` now, unless it is not newer than the engine's or the one
        already asked for; a previous load error is forgotten."""
        with self._cond:
            if int(version) > max(self.wanted, self.engine.version):
                self.wanted = int(version)
                self.load_error = None
                self._cond.notify_all()

    def wait(self, version: int, done: Callable[[object], None]) -> int | None:
        """The engine's version if it holds ``version`` or newer; else ``done(held
        version or error)`` is called later (from the prefetch or engine thread) and the
        store is looked at now. Raises the load error of ``version`` if it failed."""
        with self._cond:
            if self.engine.version >= version:
                return self.engine.version
            if self.load_error and self.load_error[0] >= version > self.fetched:
                raise self.load_error[1]
            self._waiters.append((int(version), done))
            self._look_now = True
            self._cond.notify_all()
        return None

    def applied(self, version: int, error: BaseException | None) -> None:
        """The engine's ``on_update``: a staged version was swapped in, or failed to."""
        with self._cond:
            if error is not None:
                if self._base is not None and self._base >= 0:
                    self._base = None  # LoRA: the next fetch sends the base again
                self.load_error, self._failed_at = (version, error), time.monotonic()
                if self.fetched <= version:  # nothing newer staged behind it
                    self.fetched = self.engine.version
                if self.wanted <= version:
                    self.wanted = self.engine.version
                if getattr(self.engine, "mixed", None) is not None:
                    # half of a version was copied in: the engine waits for a whole one;
                    # read this one (or the newest) again at once
                    self.wanted = max(self.wanted, version)
                    self.fetched = min(self.fetched, self.engine.version)
                    self._cond.notify_all()
            self._settle_waiters(version, error)

    def fail_waiters(self, exc: BaseException) -> None:
        """Every waiter gets ``exc`` (the owner is closing)."""
        with self._cond:
            waiters, self._waiters = self._waiters, []
        for _, done in waiters:
            done(exc)

    def error_text(self) -> str | None:
        """The latest failure to find or load a version, as one line (None if none)."""
        err = self.load_error
        if err is not None:
            return f"v{err[0]}: {type(err[1]).__name__}: {err[1]}"
        return self.watch_error

    def stats(self) -> dict:
        """The counters, and the bytes read from the trainer's objects and from relays,
        and the relay reads that fell back to the origin (``WeightStore.transfer``)."""
        t = dict(self._store.transfer) if self._store is not None else {}
        return {"prefetch_seconds": self.prefetch_seconds, "prefetches": self.prefetches,
                "watches": self.watches, "watch_seconds": self.watch_seconds,
                "watch_cpu_seconds": self.watch_cpu_seconds, "streamed": self.streamed,
                "weights_origin_bytes": t.get("origin_bytes", 0),
                "weights_relay_bytes": t.get("relay_bytes", 0),
                "weights_fallbacks": t.get("fallbacks", 0),
                "load_error": self.error_text()}

    # -- the prefetch thread -------------------------------------------------------------
    def _loop(self) -> None:
        # the watch looks every ``watch`` seconds, however often the condition wakes this
        # thread
        next_look = 0.0  # time.monotonic() of the watch's next look
        while True:
            with self._cond:
                if not (self._stop or self.wanted > self.fetched or self._look_now):
                    wait = max(next_look - time.monotonic(), 0.0) if self.watch else None
                    if wait is None or wait > 0:
                        self._cond.wait(wait)
                if self._stop:
                    return
                target = self.wanted if self.wanted > self.fetched else None
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
                target = self._load(target)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to wait_version callers
                error = exc
            self.prefetch_seconds += time.perf_counter() - t0
            self.prefetches += error is None
            with self._cond:
                if error is None:
                    self.fetched = max(self.fetched, target)
                else:
                    self.load_error, self._failed_at = (target, error), time.monotonic()
                    if self.wanted == target:  # nothing newer asked for: allow a retry
                        self.wanted = self.fetched
                    self._settle_waiters(target, error)
            if error is None and self.on_staged is not None:
                self.on_staged()  # wakes an idle engine thread to apply it

    def _settle_waiters(self, version: int, error: BaseException | None) -> None:
        """Resolve waiters now satisfied, or failed by ``error`` (hold ``_cond``)."""
        held = self.engine.version
        keep = []
        for want, done in self._waiters:
            if held >= want:
                done(held)
            elif error is not None and self.fetched < want <= version:
                done(error)
            else:
                keep.append((want, done))
        self._waiters = keep

    def _look(self) -> None:
        """Watch the store (prefetch thread): a version newer than held or asked for is
        wanted now; one that failed to load is tried again after ``retry_after`` s."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            latest = self._open_store().latest()
            self.watch_error = None
        except Exception as exc:  # noqa: BLE001 - reported in stats(), tried again
            self.watch_error = f"reading the store's latest version: {exc!r}"
            return
        finally:  # what watching costs (the weight-sync benchmark compares the stores)
            self.watches += 1
            self.watch_seconds += time.perf_counter() - t0
            self.watch_cpu_seconds += time.thread_time() - c0
        self.latest_seen = latest
        with self._cond:
            err = self.load_error
            if err is not None and err[0] >= latest and \
                    time.monotonic() - self._failed_at < self.retry_after:
                return
            if latest > max(self.wanted, self.fetched, self.engine.version):
                self.wanted = latest

    def _open_store(self) -> WeightStore:
        if self._store is None:
            self._store = WeightStore(self.store_url)
        return self._store

    def _load(self, target: int) -> int:
        """Fetch ``target`` (``fetch``) and stage it with the engine; returns the
        version staged."""
        got, target = self.fetch(target)
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

    def fetch(self, target: int) -> tuple[dict | BucketStream, int]:
        """``(weights, version)`` of ``target`` from the store. Held (``hold``) so garbage
        collection keeps it while it is read; if it was collected before the hold (newer
        versions exist), the newest instead.

        A bucketed full version, for an engine that ``streams_weights``, comes as a
        started ``BucketStream`` for ``request_stream``: it reads two buckets ahead now
        and the engine copies each in at its next decode-step boundary, so this worker
        never holds a second copy of the model; the hold ends when the stream is closed
        (loaded or superseded). Anything else (one blob, a LoRA adapter, an engine with
        LoRA) is read whole: a state dict for ``request_update``."""
        store, reader = self._open_store(), self.reader
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
                    self.wanted = max(self.wanted, newest)
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
            store.release(self.reader)

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
