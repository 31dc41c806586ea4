"""``LLMProxy``: routes each trajectory's generation calls to ``InferenceWorker`` s.

Consumes ``(traj_id, GenRequest, pools, task)`` from an env manager; produces the
worker's ``GenResult``. Routing, in order:

1. **Task affinity** (``rollart.affinity``): a task pinned to pools uses only those; a
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
import threading
from dataclasses import replace
from typing import Any

from rollart.affinity import BANDWIDTH_TAGS, COMPUTE_TAGS, Affinity, classify
from rollart.near import near
from rollart.types import GenRequest, GenResult


class LLMProxy:
    """Affinity-, prefix- and load-aware router over ``[(actor_handle, pool_tag), ...]``.

    ``routes``: ``{task name: Affinity}`` (``rollart.affinity.task_routes``);
    ``sticky=False`` turns prefix stickiness off (for comparison); ``auto_ratio`` is the
    prompt/response ratio from which an ``auto`` task counts as prefill-heavy, decided
    after ``auto_min_turns`` observed turns.
    """

    def __init__(self, workers: list[tuple[Any, str]], routes: dict[str, Affinity] | None = None,
                 *, sticky: bool = True, auto_ratio: float = 2.0, auto_min_turns: int = 4,
                 compute_pools: tuple[str, ...] = COMPUTE_TAGS,
                 bandwidth_pools: tuple[str, ...] = BANDWIDTH_TAGS):
        if not workers:
            raise ValueError("LLMProxy needs at least one (InferenceWorker actor, pool) pair")
        self.workers = [(actor, str(pool)) for actor, pool, *_ in workers]
        self.routes = dict(routes or {})
        self.sticky = bool(sticky)
        self.auto_ratio, self.auto_min_turns = float(auto_ratio), int(auto_min_turns)
        self.compute_pools, self.bandwidth_pools = tuple(compute_pools), tuple(bandwidth_pools)
        for task, aff in self.routes.items():
            missing = [t for t in aff.tags() if t not in self.pools]
            if missing:
                raise ValueError(f"task {task!r} asks for pool(s) {missing} but no inference "
                                 f"worker carries them; available pools: {list(self.pools)}")
        self._sticky: dict[str, int] = {}
        self._context: dict[str, int] = {}  # traj -> tokens cached on its sticky worker
        self._in_flight = [0] * len(self.workers)
        self._tokens = [0] * len(self.workers)  # queued + in-flight tokens per worker
        self._routed = [0] * len(self.workers)
        self._task_tokens: dict[str, list[int]] = {}  # task -> [prompt, response, turns]
        self._reuse = {"turns": 0, "sticky_turns": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._pd = {"requests": 0, "kv_bytes": 0}
        self._next = 0  # round-robin cursor for ties
        self._near: dict = {}  # (index, actor key) -> handle or co-located object
        self._lock: threading.Lock | None = None
        self.dead: set[int] = set()  # workers found lost (never routed to again)
        self.rerouted = 0  # requests re-sent after their worker was lost

    def with_workers(self, workers: list[tuple[Any, str]]) -> "LLMProxy":
        """This proxy's routing over a new worker list (after the driver re-created a
        lost worker): the same task routes, stickiness, pools and ``auto`` observations,
        and cumulative counters; per-worker state starts afresh. A route whose pool has
        no worker right now is kept (its worker is being replaced), not refused."""
        new = LLMProxy(workers, sticky=self.sticky, auto_ratio=self.auto_ratio,
                       auto_min_turns=self.auto_min_turns, compute_pools=self.compute_pools,
                       bandwidth_pools=self.bandwidth_pools)
        with self._guard():
            new.routes = dict(self.routes)
            new._task_tokens = {t: list(v) for t, v in self._task_tokens.items()}
            new._reuse, new._pd = dict(self._reuse), dict(self._pd)
            new.rerouted = self.rerouted
        return new

    # -- pickling: locks and in-flight counts are local to one copy -----------------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_in_flight"] = [0] * len(self.workers)
        state["_tokens"] = [0] * len(self.workers)
        state["_near"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def pools(self) -> tuple[str, ...]:
        """The pool tags carried by at least one worker, sorted."""
        return tuple(sorted({pool for _, pool in self.workers}))

    def _near_handle(self, idx: int):
        """Worker ``idx``'s handle, or its object when it shares this Dask worker
        (``rollart.near``: no comm, e.g. on ``resources/laptop.py``)."""
        actor = self.workers[idx][0]
        key = (idx, getattr(actor, "key", id(actor)))
        if key not in self._near:
            self._near[key] = near(actor)
        return self._near[key]

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

    def _least_loaded(self, allowed: list[int]) -> int:
        """Fewest queued + in-flight tokens, then fewest calls; ties round robin."""
        least = min((self._tokens[i], self._in_flight[i]) for i in allowed)
        ties = [i for i in allowed if (self._tokens[i], self._in_flight[i]) == least]
        n = len(self.workers)
        idx = min(ties, key=lambda i: (i - self._next) % n)
        self._next = (idx + 1) % n
        return idx

    def route(self, traj_id: str | None, pools: tuple[str, ...] | None = None,
              tokens: int = 0) -> int:
        """Index of the worker for ``traj_id`` and count ``tokens`` of load on it.

        Sticky (when on) to the worker that served the trajectory before, else the least
        loaded allowed one. ``traj_id=None`` never sticks (a decode phase). Pair with
        ``done(idx, tokens)``.
        """
        allowed = [i for i in self._allowed(pools) if i not in self.dead]
        if not allowed:
            raise WorkerLostError(f"every inference worker of pools {pools or self.pools} "
                                  "was lost; the driver re-creates them when their workers "
                                  "come back")
        with self._guard():
            idx = self._sticky.get(traj_id) if (self.sticky and traj_id is not None) else None
            if idx is None or idx not in allowed:
                idx = self._least_loaded(allowed)
                if traj_id is not None:
                    if self._sticky.get(traj_id) != idx:
                        self._context.pop(traj_id, None)  # its prefix is not cached there
                    self._sticky[traj_id] = idx
            self._routed[idx] += 1
            self._in_flight[idx] += 1
            self._tokens[idx] += int(tokens)
        return idx

    def done(self, idx: int, tokens: int = 0) -> None:
        with self._guard():
            self._in_flight[idx] -= 1
            self._tokens[idx] -= int(tokens)

    def pools_for(self, task: str | None, pools=None):
        """The pools a task's (colocated) generation may use now."""
        aff = self.routes.get(task) if task is not None else None
        if aff is None:
            return pools
        if aff.pools:
            return aff.pools
        kind = self.classification(task) if aff.auto else None
        want = {"prefill": self.compute_pools, "decode": self.bandwidth_pools}.get(kind, ())
        have = tuple(p for p in want if p in self.pools)
        return have or pools

    def classification(self, task: str) -> str | None:
        """``"prefill"`` / ``"decode"``-heavy from observed tokens, ``None`` before enough."""
        prompt, response, turns = self._task_tokens.get(task, (0, 0, 0))
        if turns < self.auto_min_turns:
            return None
        return classify(prompt, response, self.auto_ratio)

    # -- generation -------------------------------------------------------------------
    async def generate(self, traj_id: str, req: GenRequest, pools: tuple[str, ...] | None = None,
                       task: str | None = None) -> GenResult:
        """Send ``req`` (a turn of trajectory ``traj_id`` of ``task``) to its worker(s)."""
        if req.cache_key is None:
            req = replace(req, cache_key=traj_id)
        aff = self.routes.get(task) if task is not None else None
        if aff is not None and aff.disaggregated:
            res = await self._generate_pd(traj_id, req, aff)
        else:
            while True:
                new = self._new_tokens(traj_id, req)
                cost = new + req.max_new_tokens
                idx = self.route(traj_id, self.pools_for(task, pools), cost)
                self._count_reuse(traj_id, idx, req, new)
                worker = self._near_handle(idx)
                try:
                    res = await worker.generate(req)
                    break
                except asyncio.CancelledError:  # our trajectory was cancelled: free its row
                    if req.request_id is not None:
                        _fire_and_forget(worker.abort(req.request_id))
                    raise
                except Exception as e:  # its worker was lost: re-send to another one
                    if not is_worker_lost(e):
                        raise
                    with self._guard():
                        self.dead.add(idx)
                        self._sticky.pop(traj_id, None)
                        self._context.pop(traj_id, None)
                        self.rerouted += 1
                finally:
                    self.done(idx, cost)
            self._context[traj_id] = len(req.prompt_ids) + max(len(res.token_ids) - 1, 0)
        self._observe(task, req, res)
        return res

    async def _generate_pd(self, traj_id: str, req: GenRequest, aff: Affinity) -> GenResult:
        """Prefill on ``aff.prefill`` (sticky: its prefix cache), decode on ``aff.decode``
        (least loaded); the KV goes between the two workers, not through here."""
        new = self._new_tokens(traj_id, req)
        p = self.route(traj_id, (aff.prefill,), new)
        self._count_reuse(traj_id, p, req, new)
        prefill_worker = self.workers[p][0]
        try:
            kv = await prefill_worker.prefill(req)
        finally:
            self.done(p, new)
        self._context[traj_id] = len(req.prompt_ids)
        d = self.route(None, (aff.decode,), req.max_new_tokens)
        try:
            res = await self.workers[d][0].decode(req, kv)
        finally:
            self.done(d, req.max_new_tokens)
            asyncio.ensure_future(_drop(prefill_worker, kv["key"]))
        with self._guard():
            self._pd["requests"] += 1
            self._pd["kv_bytes"] += int(kv.get("nbytes", 0))
        return res

    def _new_tokens(self, traj_id: str, req: GenRequest) -> int:
        """Prompt tokens not cached on the trajectory's sticky worker."""
        cached = self._context.get(traj_id, 0) if self.sticky else 0
        return max(len(req.prompt_ids) - cached, 1)

    def _count_reuse(self, traj_id: str, idx: int, req: GenRequest, new: int) -> None:
        with self._guard():
            r = self._reuse
            r["turns"] += 1
            r["prompt_tokens"] += len(req.prompt_ids)
            if traj_id in self._context and self._sticky.get(traj_id) == idx:
                r["sticky_turns"] += 1
                r["cached_tokens"] += len(req.prompt_ids) - new

    def _observe(self, task: str | None, req: GenRequest, res: GenResult) -> None:
        if task is None:
            return
        with self._guard():
            t = self._task_tokens.setdefault(task, [0, 0, 0])
            t[0] += len(req.prompt_ids)
            t[1] += len(res.token_ids)
            t[2] += 1

    def release(self, traj_id: str) -> None:
        """Forget ``traj_id`` (call when the trajectory is finished)."""
        with self._guard():
            self._sticky.pop(traj_id, None)
            self._context.pop(traj_id, None)

    def stats(self) -> dict:
        """Per-worker routed/in-flight counts, reuse and PD figures of this proxy copy."""
        with self._guard():
            workers = [
                {
                    "key": str(getattr(actor, "key", i)),
                    "pool": pool,
                    "routed": self._routed[i],
                    "in_flight": self._in_flight[i],
                    "tokens": self._tokens[i],
                }
                for i, (actor, pool) in enumerate(self.workers)
            ]
            r = self._reuse
            return {"workers": workers, "trajectories": len(self._sticky),
                    "sticky_turns": r["sticky_turns"], "turns": r["turns"],
                    "expected_reuse": r["cached_tokens"] / max(r["prompt_tokens"], 1),
                    "pd_requests": self._pd["requests"], "pd_kv_bytes": self._pd["kv_bytes"],
                    "dead": len(self.dead), "rerouted": self.rerouted,
                    "tasks": {t: {"prompt_tokens": v[0], "response_tokens": v[1],
                                  "turns": v[2], "class": self.classification(t)}
                              for t, v in self._task_tokens.items()}}


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


class WorkerLostError(RuntimeError):
    """No live inference worker is left to serve a request."""


def is_worker_lost(error: BaseException) -> bool:
    """True when ``error`` says the Dask worker holding an actor is gone."""
    if isinstance(error, TimeoutError):  # an OSError subclass, but not a lost worker
        return False
    return isinstance(error, OSError) or (
        isinstance(error, RuntimeError) and "Worker holding Actor was lost" in str(error))
