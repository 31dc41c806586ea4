"""``LLMProxy``: routes each trajectory's generation calls to ``InferenceWorker`` s.

Consumes ``(traj_id, GenRequest, pools, task)`` from an env manager; produces the
worker's ``GenResult``. Every routing decision is its ``rollart.policy.routing.Router``'s
(the cluster simulator calls the same object); this module makes the actor calls.
Routing, in order:

1. **Task affinity** (``rollart.policy.affinity``): a task pinned to pools uses only those; a
   task with ``prefill=``/``decode=`` runs its prefill on one pool and its decode on the
   other (PD disaggregation: the KV cache goes from the prefill worker to the decode
   worker directly, ``rollart.rollout.kv``); an ``auto`` task goes to a compute pool
   while it looks prefill-heavy and to a bandwidth pool while it looks decode-heavy,
   judged from the prompt/response tokens this proxy has seen of it.
2. **Prefix stickiness**: a trajectory's later turns go to the worker that served its
   earlier ones, whose prefix cache holds its context (``GenRequest.cache_key`` is the
   trajectory id), so only the new tokens are prefilled.
3. **Load**: a new trajectory (or a decode phase) goes to the allowed worker with the
   fewest queued + in-flight tokens sent through this proxy (prompt tokens still to
   prefill + tokens to generate), ties round robin.

``rescore`` sends a stale member's tokens to be re-scored (``rollart.env.rescore``) the
same way, to the trajectory's worker (a PD task: its prefill pool).

The proxy is a plain picklable object shipped into env-manager actors: its counters are
local to each copy, so routing costs no extra Dask hop. Await ``generate`` on the event
loop of the Dask worker (or asynchronous client) that holds the actor handles.

A worker whose process is lost (its actor call raises ``OSError`` or "Worker holding
Actor was lost") is marked dead in this copy and the request is re-sent to another
worker of the allowed pools (requests carry the whole context, so any worker can serve
them); the driver re-creates the actor and hands the managers a new list.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from rollart.policy.affinity import BANDWIDTH_TAGS, COMPUTE_TAGS, Affinity
from rollart.runtime.near import near
from rollart.policy.routing import Router, WorkerLostError  # noqa: F401 (re-exported)
from rollart.types import GenRequest, GenResult, ScoreRequest, ScoreResult
from rollart.runtime.lost import is_lost


class LLMProxy:
    """Affinity-, prefix- and load-aware router over ``[(actor_handle, pool_tag), ...]``.

    ``routes``: ``{task name: Affinity}`` (``rollart.policy.affinity.task_routes``);
    ``sticky=False`` turns prefix stickiness off (for comparison); ``auto_ratio`` is the
    prompt/response ratio from which an ``auto`` task counts as prefill-heavy, decided
    after ``auto_min_turns`` observed turns. Every decision is its ``Router``'s
    (``rollart.policy.routing``); this object makes the actor calls.
    """

    def __init__(self, workers: list[tuple[Any, str]], routes: dict[str, Affinity] | None = None,
                 *, sticky: bool = True, auto_ratio: float = 2.0, auto_min_turns: int = 4,
                 compute_pools: tuple[str, ...] = COMPUTE_TAGS,
                 bandwidth_pools: tuple[str, ...] = BANDWIDTH_TAGS, _check: bool = True):
        if not workers:
            raise ValueError("LLMProxy needs at least one (InferenceWorker actor, pool) pair")
        self.workers = [(actor, str(pool)) for actor, pool, *_ in workers]
        self.router = Router([pool for _, pool in self.workers], routes, sticky=sticky,
                             auto_ratio=auto_ratio, auto_min_turns=auto_min_turns,
                             compute_pools=compute_pools, bandwidth_pools=bandwidth_pools,
                             check=_check)
        self._pd = {"requests": 0, "kv_bytes": 0}
        self._near: dict = {}  # (index, actor key) -> handle or co-located object
        self.rerouted = 0  # requests re-sent after their worker was lost

    def with_workers(self, workers: list[tuple[Any, str]]) -> "LLMProxy":
        """This proxy's routing over a new worker list (after the driver re-created a
        lost worker): the same task routes, stickiness, pools and ``auto`` observations,
        and cumulative counters; per-worker state starts afresh. A route whose pool has
        no worker right now is kept (its worker is being replaced), not refused."""
        new = LLMProxy.__new__(LLMProxy)
        new.workers = [(actor, str(pool)) for actor, pool, *_ in workers]
        if not new.workers:
            raise ValueError("LLMProxy needs at least one (InferenceWorker actor, pool) pair")
        new.router = self.router.with_pools([pool for _, pool in new.workers])
        new._pd, new._near, new.rerouted = dict(self._pd), {}, self.rerouted
        return new

    # -- pickling: the router resets its in-flight counts; handles are rebuilt --------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_near"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def routes(self) -> dict[str, Affinity]:
        return self.router.routes

    @property
    def sticky(self) -> bool:
        return self.router.sticky

    @property
    def dead(self) -> set[int]:
        return self.router.dead

    @property
    def pools(self) -> tuple[str, ...]:
        """The pool tags carried by at least one worker, sorted."""
        return self.router.pools

    def _near_handle(self, idx: int):
        """Worker ``idx``'s handle, or its object when it shares this Dask worker
        (``rollart.runtime.near``: no comm, e.g. on ``resources/laptop.py``)."""
        actor = self.workers[idx][0]
        key = (idx, getattr(actor, "key", id(actor)))
        if key not in self._near:
            self._near[key] = near(actor)
        return self._near[key]

    def _guard(self):
        """The router's lock (created on first use, never pickled)."""
        return self.router.guard()

    # -- routing: the Router's decisions ----------------------------------------------
    def route(self, traj_id: str | None, pools: tuple[str, ...] | None = None,
              tokens: int = 0) -> int:
        """Index of the worker for ``traj_id`` (``Router.route``); pair with ``done``."""
        return self.router.route(traj_id, pools=pools, tokens=tokens)

    def done(self, idx: int, tokens: int = 0) -> None:
        self.router.done(idx, tokens)

    def pools_for(self, task: str | None, pools=None):
        """The pools a task's (colocated) generation may use now."""
        return self.router.pools_for(task, pools)

    def classification(self, task: str) -> str | None:
        """``"prefill"`` / ``"decode"``-heavy from observed tokens, ``None`` before enough."""
        return self.router.classification(task)

    # -- generation -------------------------------------------------------------------
    async def generate(self, traj_id: str, req: GenRequest, pools: tuple[str, ...] | None = None,
                       task: str | None = None) -> GenResult:
        """Send ``req`` (a turn of trajectory ``traj_id`` of ``task``) to its worker(s)."""
        if req.cache_key is None:
            req = replace(req, cache_key=traj_id)
        aff = self.router.disaggregated(task)
        if aff is not None:
            res = await self._generate_pd(traj_id, req, aff)
        else:
            new = 0  # prompt tokens the worker routed to lacks in its cache (each try)

            def cost() -> int:
                nonlocal new
                new = self.router.new_tokens(traj_id, len(req.prompt_ids))
                return new + req.max_new_tokens

            async def send(idx: int, worker) -> GenResult:
                self.router.count_reuse(traj_id, idx, len(req.prompt_ids), new)
                try:
                    return await worker.generate(req)
                except asyncio.CancelledError:  # our trajectory was cancelled: free its row
                    if req.request_id is not None:
                        _fire_and_forget(worker.abort(req.request_id))
                    raise

            res = await self._on_live_worker(traj_id, task, pools, cost, send)
            self.router.served(traj_id, len(req.prompt_ids) + max(len(res.token_ids) - 1, 0))
        self.router.observe(task, len(req.prompt_ids), len(res.token_ids))
        return res

    async def _generate_pd(self, traj_id: str, req: GenRequest, aff: Affinity) -> GenResult:
        """Prefill on ``aff.prefill`` (sticky: its prefix cache), decode on ``aff.decode``
        (least loaded); the KV goes between the two workers, not through here."""
        r = self.router
        new = r.new_tokens(traj_id, len(req.prompt_ids))
        p = r.route(traj_id, pools=(aff.prefill,), tokens=new)
        r.count_reuse(traj_id, p, len(req.prompt_ids), new)
        prefill_worker = self.workers[p][0]
        try:
            kv = await prefill_worker.prefill(req)
        finally:
            r.done(p, new)
        r.served(traj_id, len(req.prompt_ids))
        d = r.route(None, pools=(aff.decode,), tokens=req.max_new_tokens)
        try:
            res = await self.workers[d][0].decode(req, kv)
        finally:
            r.done(d, req.max_new_tokens)
            asyncio.ensure_future(_drop(prefill_worker, kv["key"]))
        with r.guard():
            self._pd["requests"] += 1
            self._pd["kv_bytes"] += int(kv.get("nbytes", 0))
        return res

    async def rescore(self, traj_id: str, req: ScoreRequest, pools=None,
                      task: str | None = None, wait: float = 0.0) -> ScoreResult:
        """Re-score a trajectory's tokens (``InferenceWorker.rescore``, waiting up to
        ``wait`` s for ``req.min_version``) on the worker its generations go to (a PD
        task: its prefill pool), re-sent elsewhere when that worker was lost."""
        aff = self.router.disaggregated(task)
        if aff is not None:
            task, pools = None, (aff.prefill,)
        return await self._on_live_worker(traj_id, task, pools, lambda: len(req.token_ids),
                                          lambda idx, worker: worker.rescore(req, wait))

    async def _on_live_worker(self, traj_id: str, task, pools, cost, send):
        """``send(idx, worker)`` to the worker routed to for ``traj_id``, its ``cost()``
        tokens counted on it meanwhile; re-sent to another worker while the one it went
        to was lost (``is_lost``). Any other error, or a cancellation, goes to the caller."""
        while True:
            tokens = cost()
            idx = self.router.route(traj_id, task, pools, tokens)
            try:
                return await send(idx, self._near_handle(idx))
            except Exception as e:  # its worker was lost: re-send to another one
                if not is_lost(e):
                    raise
                self.router.lost(idx, traj_id)
                self.rerouted += 1
            finally:
                self.router.done(idx, tokens)

    def release(self, traj_id: str) -> None:
        """Forget ``traj_id`` (call when the trajectory is finished)."""
        self.router.release(traj_id)

    def stats(self) -> dict:
        """Per-worker routed/in-flight counts, reuse and PD figures of this proxy copy."""
        out = self.router.stats()
        for i, (w, (actor, _)) in enumerate(zip(out["workers"], self.workers)):
            w["key"] = str(getattr(actor, "key", i))
        out.update(pd_requests=self._pd["requests"], pd_kv_bytes=self._pd["kv_bytes"],
                   rerouted=self.rerouted)
        return out


def _fire_and_forget(call) -> None:
    """Run an actor call in the background; its outcome does not matter to anyone."""

    async def run():
        try:
            await call
        except Exception:  # noqa: BLE001 - best effort: the row also ends on its own
            pass

    try:
        asyncio.ensure_future(run())
    except RuntimeError:  # no running loop (interpreter shutting down)
        pass


async def _drop(worker, key: str) -> None:
    try:
        await worker.drop_kv(key)
    except Exception:  # noqa: BLE001 - the worker may be gone; its memory went with it
        pass
