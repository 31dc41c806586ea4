"""``InferenceWorker``: a Dask actor that serves ``GenRequest``s from one engine.

The engine is a ``TorchEngine`` or a ``VLLMEngine`` (``engine="torch"|"vllm"``, from
``Policy.engine``; interface: ``rollart.rollout.base.GenerationEngine``).

Consumes ``GenRequest``s (from ``LLMProxy`` inside env-manager actors) and weight
versions, which it finds itself: its prefetch thread reads the store's ``latest()``
every ``watch`` seconds (a few bytes) and at once when someone waits (``wait_version``),
so nobody relays versions to it (``update_weights`` remains to ask for one at once).
Produces ``GenResult``s stamped with this worker's address, and ``ScoreResult``s
(``rescore``: a stale member's tokens re-scored under the weights held now, on the same
engine thread, at its next admission). Its methods are ``async`` and run on the Dask
worker's event loop; the model runs on one engine thread the actor owns, which batches
requests continuously (they join the running batch at decode-step boundaries and return
as soon as they finish; an aborted request's row is dropped), so heartbeats and comms
are never blocked.

Weight updates follow the asynchronous protocol: once the worker sees ``v`` (its watch
of the store, or ``update_weights(v)``, which returns at once), the prefetch thread
loads ``v`` from the ``WeightStore`` while the engine keeps decoding,
then stages it with the engine's ``request_update``. The engine swaps it in at the next
decode-step boundary (suspend -> update -> resume) and re-prefills the in-flight rows
(recompute KV) or, with ``weight_update="keep"`` (``Policy.weight_update``, an engine
option), lets them go on over the KV they have; or at once when idle. A bucketed full version (a trainer gang's) is
staged as a stream instead (``request_stream``): two buckets are read ahead while the
engine decodes, and at the boundary the engine copies each bucket in as it arrives, so
the worker holds about two buckets instead of a second model copy (the fetch of the
rest then falls inside the suspension; with a Mooncake relay, ``relay_mb``, the buckets
come mostly from the other workers). Tokens generated before the swap keep their
version; later ones carry ``v``. ``wait_version(v)`` resolves when the swap happened.
A version that fails to load is tried again after ``retry_after`` s; the latest error is
in ``stats()["load_error"]`` (the pipeline's stall check names it).

The worker is made of parts it holds: the engine (``self.engine``, whose
``StagedUpdates``, ``engine.updates``, keeps the version staged for the next boundary)
and the prefetch (``self.prefetch``, a ``rollart.rollout.prefetch.WeightPrefetch``: the
store watch, the versions wanted, fetched and waited for, its own thread). The worker
itself owns the request queue, the engine thread and PD's KV handoffs.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from rollart.rollout.base import make_engine
from rollart.rollout.prefetch import WeightPrefetch
from rollart.rollout.request_log import RequestLog
from rollart.types import GenRequest, GenResult, ScoreRequest, ScoreResult


@dataclass
class _Pending:
    req: GenRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    # | "prefill" | "decode" (PD disaggregation, rollart.rollout.pd) | "score" (rescore)
    kind: str = "generate"
    handoff: object = None  # the KVHandoff a "decode" starts from
    aborted: bool = False
    arrived: float = -1.0  # perf_counter() when queued (only while a request log is on)
    cached: int = 0  # prompt tokens in the prefix cache at admission (request log)


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


def _aborted() -> GenResult:
    return GenResult(token_ids=[], logprobs=[], versions=[], finish_reason="abort")


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return ""


class InferenceWorker:
    """Serve generation requests from one model; batch concurrent calls together.

    It holds two parts: ``engine`` (a ``GenerationEngine``; its ``updates`` stage and
    apply weight versions) and ``prefetch`` (a ``WeightPrefetch``: finds, loads and
    stages versions on its own thread). The worker owns the request queue and the engine
    thread that serves it.
    """

    #: a ``RequestLog`` while ``start_request_log`` has one on (None: off, no cost)
    request_log: RequestLog | None = None

    def __init__(
        self,
        model_path: str,
        store_url: str,
        *,
        pool: str,
        version: int = 0,
        max_batch: int = 64,
        threads: int | None = None,
        engine: str = "torch",
        engine_options: dict | None = None,
        watch: float | None = 0.25,
        retry_after: float = 5.0,
    ):
        if threads:
            torch.set_num_threads(int(threads))
        self.pool = pool
        self.address = _worker_address()
        # engine: "torch" (TorchEngine) or "vllm" (VLLMEngine); see rollart.rollout.base
        self.engine = make_engine(engine, model_path, version=version, max_batch=max_batch,
                                  on_update=self._on_update, **(engine_options or {}))
        self.max_batch = self.engine.max_batch
        self._cond = threading.Condition()  # guards the request queue below
        self._pending: deque[_Pending] = deque()
        self._in_flight = 0
        self._stop = False
        self.abandoned = 0  # requests aborted (queued or mid-generation) by their caller
        self._live: dict[str, _Pending] = {}  # request_id -> queued or generating request
        self._kv_held: dict = {}  # key -> Dask Future of a KVHandoff made here
        self.kv_stats = {"sent": 0, "received": 0, "bytes_received": 0,
                         "fetch_seconds": 0.0}
        self.prefetch = WeightPrefetch(
            store_url, self.engine, version=version, watch=watch, retry_after=retry_after,
            reader=f"{self.address or 'local'}/{pool}/{id(self):x}",
            on_staged=self._wake, name=f"rollart-prefetch-{pool}")
        self._thread = threading.Thread(
            target=self._run, name=f"rollart-engine-{pool}", daemon=True
        )
        self._thread.start()
        self.prefetch.start()

    # -- actor API (async: runs on the worker's event loop) -----------------------------
    async def generate(self, req: GenRequest) -> GenResult:
        """Queue ``req`` for the next batch and wait for its result."""
        result = await self._submit(req)
        result.worker = self.address
        return result

    async def _submit(self, req: GenRequest, kind: str = "generate", handoff=None):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        rid = req.request_id if kind in ("generate", "decode") else None
        with self._cond:
            if self._stop:
                raise RuntimeError(f"InferenceWorker {self.address or self.pool} is closed")
            item = _Pending(req, future, loop, kind, handoff)
            if self.request_log is not None and kind == "generate":
                item.arrived = time.perf_counter()
            self._pending.append(item)
            if rid is not None:
                self._live[rid] = item
            self._cond.notify_all()
        try:
            return await future
        finally:
            if rid is not None:
                with self._cond:
                    if self._live.get(rid) is item:
                        del self._live[rid]

    async def abort(self, request_id: str) -> bool:
        """Stop generating for ``request_id`` (its caller went away, e.g. a redundant
        trajectory was cancelled): its row leaves the batch at the next decode-step
        boundary and its call returns an empty ``GenResult`` with ``finish_reason``
        ``"abort"``. Returns whether the request was still queued or generating."""
        with self._cond:
            item = self._live.pop(request_id, None)
            if item is None or item.aborted:
                return False
            item.aborted = True
            if item in self._pending:  # not started: it never takes a row
                self._pending.remove(item)
                self.abandoned += 1
                _resolve(item.future, item.loop, _aborted())
        return True

    async def rescore(self, req: ScoreRequest, wait: float = 0.0) -> ScoreResult:
        """The log-probs of ``req``'s tokens under the weights this worker holds when
        the engine thread reaches it (between two decode steps: one forward, no
        sampling; ``rollart.env.rescore``), and that version. When ``req.min_version`` is
        newer than the weights held, wait up to ``wait`` s for it first (the prefetch
        looks at the store at once); the answer may still carry an older version."""
        if req.min_version is not None and wait > 0 and self.engine.version < req.min_version:
            try:
                await self.wait_version(req.min_version, wait)
            except TimeoutError:
                pass  # the caller sees the version it got and decides
        result = await self._submit(req, "score")
        result.worker = self.address
        return result

    # -- PD disaggregation (KV moves worker to worker; see rollart.rollout.kv) ----------
    async def prefill(self, req: GenRequest) -> dict:
        """Prefill ``req`` and keep its KV in this Dask worker's memory; return its key.

        The decode worker fetches it from here (``decode``) over Dask's comms; callers
        only see ``{"key", "nbytes", "source"}``. ``drop_kv(key)`` frees it.
        """
        from rollart.rollout.kv import hold

        handoff = await self._submit(req, "prefill")
        return await hold(self, handoff)

    async def decode(self, req: GenRequest, kv: dict) -> GenResult:
        """Fetch the KV that ``prefill`` left on another worker and decode from it."""
        from rollart.rollout.kv import fetch

        handoff = await fetch(self, kv)
        result = await self._submit(req, "decode", handoff)
        result.worker = self.address
        return result

    async def drop_kv(self, key: str) -> None:
        """Forget a handoff made by ``prefill`` (after its decode finished)."""
        self._kv_held.pop(key, None)

    async def update_weights(self, version: int) -> None:
        """Ask for ``version``; returns at once.

        The weights are read from the store in the background and swapped in at the next
        decode-step boundary (the running batch continues under them, after re-prefilling
        its KV cache unless the engine's ``weight_update`` is ``"keep"``), or at once
        when the engine is idle. Versions not newer than the
        held or already requested one are ignored; a failed load is reported to
        ``wait_version`` callers and the worker keeps serving its current weights.
        """
        self.prefetch.want(version)

    async def wait_version(self, version: int, timeout: float = 60) -> int:
        """Wait until the engine holds ``version`` or newer; return the held version."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        held = self.prefetch.wait(version, functools.partial(_resolve, future, loop))
        if held is not None:
            return held
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"weight version {version} not loaded within {timeout}s on "
                f"{self.address or self.pool} (holds {self.engine.version}; the store "
                f"{self.prefetch.store_url} has {self.prefetch.latest_seen}; last load "
                f"error: {self.prefetch.error_text()})"
            ) from None

    async def stats(self) -> dict:
        """The engine's counters (``engine.stats()``), the queue, the prefetch's
        (``prefetch.stats()``: loads, watches, bytes, the last error) and PD's."""
        with self._cond:
            queued, in_flight = len(self._pending), self._in_flight
        return {
            "address": self.address,
            "pool": self.pool,
            **self.engine.stats(),
            "queued": queued,
            "in_flight": in_flight,
            **self.prefetch.stats(),
            "abandoned": self.abandoned,
            **self._pd_stats(),
        }

    def _pd_stats(self) -> dict:
        pc = getattr(self.engine, "prefix_cache", None)  # torch engine only
        return {"kv_" + k: v for k, v in self.kv_stats.items()} | {
            "kv_held": len(self._kv_held),
            "prefix_hit_tokens": pc.hit_tokens if pc else 0,
            "prefix_prompt_tokens": pc.prompt_tokens if pc else 0,
            "prefix_reuse": pc.reuse_rate if pc else 0.0,
            # rollart.rollout.pd.prefill (torch engine only)
            "prefill_tokens": getattr(self.engine, "prefill_tokens", 0),
            "prefill_padded": getattr(self.engine, "prefill_padded", 0),
            "prefill_shared": getattr(self.engine, "prefill_shared", 0),
        }

    async def close(self) -> None:
        """Stop the engine and prefetch threads; pending requests fail with ``RuntimeError``."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.prefetch.stop()
        cancel = getattr(self.engine, "cancel_updates", None)
        if cancel is not None:  # an engine waiting to mend mixed weights stops waiting
            cancel()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join, 60)
        await loop.run_in_executor(None, self.prefetch.join, 60)

    # -- request log (benchmarks/limits.py replays it; rollart.rollout.request_log) -----
    def start_request_log(self, limit: int = 100_000) -> None:
        """Record the generation requests that arrive from now on (a new, empty
        ``RequestLog`` of at most ``limit`` records); read back by ``take_request_log``."""
        self.request_log = RequestLog(limit)

    def take_request_log(self, stop: bool = True) -> dict:
        """The requests recorded since ``start_request_log`` (``RequestLog.take``), with
        this worker's ``address`` and ``pool``; ``stop``: turn the log off."""
        log = self.request_log
        if log is None:
            raise RuntimeError(f"InferenceWorker {self.address or self.pool} keeps no "
                               "request log: call start_request_log first")
        if stop:
            self.request_log = None
        return {"address": self.address, "pool": self.pool, **log.take()}

    def _cached_tokens(self, req: GenRequest) -> int:
        pc = getattr(self.engine, "prefix_cache", None)  # torch engine only
        return pc.peek(req, self.engine.version) if pc is not None else 0

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        """Engine thread: continuous batching over whatever requests are queued."""
        eng = self.engine
        while True:
            with self._cond:
                while not (self._stop or self._pending or eng.pending_version is not None):
                    self._cond.wait()
                if self._stop:
                    break
                idle_update = not self._pending
            if idle_update:
                try:
                    eng.apply_pending_update()
                except Exception:  # noqa: BLE001 - reported through _on_update
                    pass
                continue
            eng.serve(self._admit, self._deliver, abandoned=self._abandoned)
        self._fail_all(RuntimeError(f"InferenceWorker {self.address or self.pool} closed"))

    def _admit(self, free: int) -> list[tuple]:
        """Engine hook (engine thread, at a decode-step boundary): up to ``free`` queued
        generate/decode requests join the running batch; queued PD prefills and
        re-scorings run now."""
        prefills, scores, taken = [], [], []
        with self._cond:
            if self._stop:
                return []
            keep = deque()
            while self._pending:
                item = self._pending.popleft()
                if item.future.done() or item.aborted:  # callers that went away
                    continue
                if item.kind == "prefill":
                    prefills.append(item)
                elif item.kind == "score":
                    scores.append(item)
                elif len(taken) < free:
                    if item.arrived >= 0:  # a request log is on: what the cache holds
                        item.cached = self._cached_tokens(item.req)
                    taken.append((item.req, item) if item.kind == "generate"
                                 else (item.req, item, item.handoff))
                else:
                    keep.append(item)
            self._pending = keep
            self._in_flight += len(taken)
        if prefills:
            self._each(prefills, functools.partial(self.engine.prefill, source=self.address))
        if scores:
            self._each(scores, self.engine.score)
        return taken

    def _each(self, items: list[_Pending], run) -> None:
        """PD prefills (no decode here: one ``KVHandoff`` each) or re-scorings (one
        ``ScoreResult`` each), ``run`` on them together; a bad one fails alone."""
        try:
            outcomes = run([it.req for it in items])
        except Exception:  # noqa: BLE001 - each request again, alone
            outcomes = []
            for it in items:
                try:
                    outcomes.append(run([it.req])[0])
                except Exception as one:  # noqa: BLE001 - goes back to that caller
                    outcomes.append(one)
        for item, outcome in zip(items, outcomes):
            _resolve(item.future, item.loop, outcome)

    def _deliver(self, item: _Pending, outcome) -> None:
        with self._cond:
            self._in_flight -= 1
        log = self.request_log
        if log is not None and item.arrived >= 0 and isinstance(outcome, GenResult):
            log.record(item.req, item.arrived, item.cached, outcome)
        _resolve(item.future, item.loop, outcome)

    def _abandoned(self, item: _Pending) -> bool:
        """An aborted request (e.g. of a cancelled redundant trajectory) frees its row."""
        if item.aborted or item.future.done():
            with self._cond:
                self._in_flight -= 1
                self.abandoned += 1
            _resolve(item.future, item.loop, _aborted())
            return True
        return False

    def _on_update(self, version: int, error: BaseException | None) -> None:
        """Engine hook (engine thread): a staged version was swapped in, or failed to."""
        self.prefetch.applied(version, error)

    def _wake(self) -> None:
        """Prefetch hook: a version was staged; an idle engine thread applies it."""
        with self._cond:
            self._cond.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for item in pending:
            _resolve(item.future, item.loop, exc)
        self.prefetch.fail_waiters(exc)
