"""``InferenceWorker``: a Dask actor that serves ``GenRequest``s from one ``TorchEngine``.

Consumes ``GenRequest``s (from ``LLMProxy`` inside env-manager actors) and weight-version
announcements (from the trainer / weight sync, ``update_weights``); produces
``GenResult``s stamped with this worker's address. Its methods are ``async`` and run on
the Dask worker's event loop; the model runs on one engine thread the actor owns, which
batches whatever requests are pending, so heartbeats and comms are never blocked.

Weight updates follow the asynchronous protocol: ``update_weights(v)`` returns at once;
a prefetch thread loads ``v`` from the ``WeightStore`` while the engine keeps decoding,
then stages it with ``TorchEngine.request_update``. The engine swaps it in at the next
decode-step boundary (suspend -> update -> resume) and re-prefills the in-flight rows
(recompute KV), or at once when idle. Tokens generated before the swap keep their
version; later ones carry ``v``. ``wait_version(v)`` resolves when the swap happened.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from rollart.rollout.engine import TorchEngine
from rollart.types import GenRequest, GenResult
from rollart.weights.store import WeightStore


@dataclass
class _Pending:
    req: GenRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _resolve(future: asyncio.Future, loop: asyncio.AbstractEventLoop, value) -> None:
    """Complete ``future`` on its own loop with a result or an exception (thread-safe)."""

    def setter():
        if future.done():  # the caller went away (cancelled)
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(setter)
    except RuntimeError:  # loop closed: nobody is waiting any more
        pass


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return ""


class InferenceWorker:
    """Serve generation requests from one model; batch concurrent calls together."""

    def __init__(
        self,
        model_path: str,
        store_url: str,
        *,
        pool: str,
        version: int = 0,
        max_batch: int = 64,
        threads: int | None = None,
    ):
        if threads:
            torch.set_num_threads(int(threads))
        self.pool = pool
        self.store_url = str(store_url)
        self.address = _worker_address()
        self.engine = TorchEngine(model_path, version=version, max_batch=max_batch,
                                  on_update=self._on_update)
        self.max_batch = self.engine.max_batch
        self._cond = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._in_flight = 0
        self._wanted = int(version)  # newest version asked for by update_weights
        self._fetched = int(version)  # newest version handed to the engine
        self._load_error: tuple[int, BaseException] | None = None
        self._waiters: list[tuple[int, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._stop = False
        self.prefetch_seconds = 0.0
        self.prefetches = 0  # versions read from the store and staged
        self._store: WeightStore | None = None  # opened by the prefetch thread
        self._reader = f"{self.address or 'local'}/{pool}/{id(self):x}"
        self._thread = threading.Thread(
            target=self._run, name=f"rollart-engine-{pool}", daemon=True
        )
        self._prefetcher = threading.Thread(
            target=self._prefetch_loop, name=f"rollart-prefetch-{pool}", daemon=True
        )
        self._thread.start()
        self._prefetcher.start()

    # -- actor API (async: runs on the worker's event loop) -----------------------------
    async def generate(self, req: GenRequest) -> GenResult:
        """Queue ``req`` for the next batch and wait for its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._stop:
                raise RuntimeError(f"InferenceWorker {self.address or self.pool} is closed")
            self._pending.append(_Pending(req, future, loop))
            self._cond.notify_all()
        result = await future
        result.worker = self.address
        return result

    async def update_weights(self, version: int) -> None:
        """Ask for ``version``; returns at once.

        The weights are read from the store in the background and swapped in at the next
        decode-step boundary (the running batch continues under them after re-prefilling
        its KV cache), or at once when the engine is idle. Versions not newer than the
        held or already requested one are ignored; a failed load is reported to
        ``wait_version`` callers and the worker keeps serving its current weights.
        """
        with self._cond:
            if int(version) > max(self._wanted, self.engine.version):
                self._wanted = int(version)
                self._load_error = None
                self._cond.notify_all()

    async def wait_version(self, version: int, timeout: float = 60) -> int:
        """Wait until the engine holds ``version`` or newer; return the held version."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self.engine.version >= version:
                return self.engine.version
            if self._load_error and self._load_error[0] >= version > self._fetched:
                raise self._load_error[1]
            self._waiters.append((int(version), future, loop))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"weight version {version} not loaded within {timeout}s on "
                f"{self.address or self.pool} (holds {self.engine.version}; was "
                "update_weights called?)"
            ) from None

    async def stats(self) -> dict:
        eng = self.engine
        with self._cond:
            queued, in_flight = len(self._pending), self._in_flight
        return {
            "address": self.address,
            "pool": self.pool,
            "version": eng.version,
            "tokens_generated": eng.tokens_generated,
            "requests": eng.requests,
            "batches": eng.batches,
            "busy_seconds": eng.busy_seconds,
            "queued": queued,
            "in_flight": in_flight,
            "mean_batch_size": eng.requests / eng.batches if eng.batches else 0.0,
            "decode_steps": eng.decode_steps,
            "pending_version": eng.pending_version,
            "suspends": eng.suspends,
            "recompute_tokens": eng.recompute_tokens,
            "stall_seconds": eng.stall_seconds,
            "prefetch_seconds": self.prefetch_seconds,
            "prefetches": self.prefetches,
        }

    async def close(self) -> None:
        """Stop the engine and prefetch threads; pending requests fail with ``RuntimeError``."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join, 60)
        await loop.run_in_executor(None, self._prefetcher.join, 60)

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not (self._stop or self._pending or eng.pending_version is not None):
                    self._cond.wait()
                if self._stop:
                    break
                batch = []
                while self._pending and len(batch) < self.max_batch:
                    batch.append(self._pending.popleft())
                self._in_flight = len(batch)
            if batch:  # generate applies a staged update first, then at step boundaries
                self._serve(batch)
            else:
                try:
                    eng.apply_pending_update()
                except Exception:  # noqa: BLE001 - reported through _on_update
                    pass
            with self._cond:
                self._in_flight = 0
        self._fail_all(RuntimeError(f"InferenceWorker {self.address or self.pool} closed"))

    def _on_update(self, version: int, error: BaseException | None) -> None:
        """Engine hook (engine thread): a staged version was swapped in, or failed to."""
        with self._cond:
            if error is not None:
                self._load_error = (version, error)
                if self._fetched <= version:  # nothing newer staged behind it
                    self._fetched = self.engine.version
                if self._wanted <= version:
                    self._wanted = self.engine.version
            self._settle_waiters(version, error)

    # -- prefetch thread ----------------------------------------------------------------
    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._wanted > self._fetched):
                    self._cond.wait()
                if self._stop:
                    return
                target = self._wanted
            t0 = time.perf_counter()
            try:
                state_dict, target = self._fetch(target)
                self.engine.request_update(state_dict, target)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to wait_version callers
                error = exc
            self.prefetch_seconds += time.perf_counter() - t0
            self.prefetches += error is None
            with self._cond:
                if error is None:
                    self._fetched = max(self._fetched, target)
                else:
                    self._load_error = (target, error)
                    if self._wanted == target:  # nothing newer asked for: allow a retry
                        self._wanted = self._fetched
                    self._settle_waiters(target, error)
                self._cond.notify_all()  # wakes an idle engine thread to apply it

    def _fetch(self, target: int) -> tuple[dict, int]:
        """Read ``target`` from the store, held so garbage collection keeps it meanwhile.
        If it was collected before the hold (newer versions exist), read the newest."""
        if self._store is None:
            self._store = WeightStore(self.store_url)
        store, reader = self._store, self._reader
        store.hold(reader, target)
        try:
            try:
                return store.get(target), target
            except KeyError:
                newest = store.latest()
                if newest <= target:
                    raise
                store.hold(reader, newest)
                with self._cond:
                    self._wanted = max(self._wanted, newest)
                return store.get(newest), newest
        finally:
            store.release(reader)

    def _settle_waiters(self, version: int, error: BaseException | None) -> None:
        """Resolve waiters now satisfied, or failed by ``error`` (hold ``_cond``)."""
        held = self.engine.version
        keep = []
        for want, future, loop in self._waiters:
            if held >= want:
                _resolve(future, loop, held)
            elif error is not None and self._fetched < want <= version:
                _resolve(future, loop, error)
            else:
                keep.append((want, future, loop))
        self._waiters = keep

    def _serve(self, batch: list[_Pending]) -> None:
        """Generate for ``batch``; a bad request fails alone, the rest still run."""
        good = []
        for item in batch:
            try:
                self.engine.validate(item.req)
                good.append(item)
            except Exception as exc:  # noqa: BLE001 - goes back to that caller
                _resolve(item.future, item.loop, exc)
        if not good:
            return
        try:
            outcomes = self.engine.generate([item.req for item in good])
        except Exception as exc:  # noqa: BLE001
            if len(good) == 1:
                outcomes = [exc]
            else:  # find the culprit: retry one at a time
                outcomes = [self._generate_one(item.req) for item in good]
        for item, outcome in zip(good, outcomes):
            _resolve(item.future, item.loop, outcome)

    def _generate_one(self, req: GenRequest):
        try:
            return self.engine.generate([req])[0]
        except Exception as exc:  # noqa: BLE001
            return exc

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), deque()
            waiters, self._waiters = self._waiters, []
        for item in pending:
            _resolve(item.future, item.loop, exc)
        for _, future, loop in waiters:
            _resolve(future, loop, exc)
