"""``Router``: which inference worker serves a generation request — the decision alone.

Consumes the workers' pool tags (one per worker index), the graph's task affinities
(``rollart.policy.affinity.task_routes``) and what the caller reports (requests routed and
done, tokens served, prompt/response sizes seen per task); produces a worker index per
request. No Dask, no I/O: ``rollart.rollout.proxy.LLMProxy`` holds one and makes the
actor calls; the cluster simulator (``rollart.sim``) holds one per env manager and
routes its simulated requests with it; tests call it directly.

The rules, in order:

1. **Task affinity**: a task pinned to pools uses only those; a task with
   ``prefill=``/``decode=`` runs its phases on the two pools (``disaggregated``); an
   ``auto`` task goes to a compute pool while it looks prefill-heavy and to a bandwidth
   pool while it looks decode-heavy (``classification``, from ``observe``).
2. **Prefix stickiness**: a trajectory's later turns go to the worker that served its
   earlier ones (its prefix cache holds the context), so only new tokens are prefilled
   (``new_tokens``).
3. **Load**: a new trajectory (or a decode phase, ``traj_id=None``) goes to the allowed
   worker with the fewest queued + in-flight tokens routed through this router, then
   fewest calls; ties round robin.

>>> r = Router(["H800", "H20", "H20"])
>>> r.route("t0", pools=("H20",), tokens=10), r.route("t1", pools=("H20",), tokens=5)
(1, 2)
>>> r.route("t0", pools=("H20",)), r.new_tokens("t0", 40)
(1, 40)
>>> r.served("t0", 30); r.new_tokens("t0", 40)
10
"""

from __future__ import annotations

import threading

from rollart.policy.affinity import BANDWIDTH_TAGS, COMPUTE_TAGS, Affinity, classify


class WorkerLostError(RuntimeError):
    """No live inference worker is left to serve a request."""


class Router:
    """Affinity-, prefix- and load-aware choice over workers given by their pool tags.

    ``routes``: ``{task name: Affinity}``; ``sticky=False`` turns prefix stickiness off;
    ``auto_ratio`` is the prompt/response ratio from which an ``auto`` task counts as
    prefill-heavy, decided after ``auto_min_turns`` observed turns. Counters are local
    to one copy: a pickled copy starts with no load in flight.
    """

    def __init__(self, pools: list[str], routes: dict[str, Affinity] | None = None, *,
                 sticky: bool = True, auto_ratio: float = 2.0, auto_min_turns: int = 4,
                 compute_pools: tuple[str, ...] = COMPUTE_TAGS,
                 bandwidth_pools: tuple[str, ...] = BANDWIDTH_TAGS, check: bool = True):
        self.worker_pools = [str(p) for p in pools]
        self.routes = dict(routes or {})
        self.sticky = bool(sticky)
        self.auto_ratio, self.auto_min_turns = float(auto_ratio), int(auto_min_turns)
        self.compute_pools, self.bandwidth_pools = tuple(compute_pools), tuple(bandwidth_pools)
        if check:
            for task, aff in self.routes.items():
                missing = [t for t in aff.tags() if t not in self.pools]
                if missing:
                    raise ValueError(f"task {task!r} asks for pool(s) {missing} but no "
                                     f"inference worker carries them; available pools: "
                                     f"{list(self.pools)}")
        n = len(self.worker_pools)
        self._sticky: dict[str, int] = {}
        self._context: dict[str, int] = {}  # traj -> tokens cached on its sticky worker
        self._in_flight = [0] * n
        self._tokens = [0] * n  # queued + in-flight tokens per worker
        self._routed = [0] * n
        self._task_tokens: dict[str, list[int]] = {}  # task -> [prompt, response, turns]
        self._reuse = {"turns": 0, "sticky_turns": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._next = 0  # round-robin cursor for ties
        self._lock: threading.Lock | None = None
        self.dead: set[int] = set()  # workers found lost (never routed to again)
        self._live_cache: dict = {}

    def with_pools(self, pools: list[str]) -> "Router":
        """This router over a new worker list: the same routes, stickiness setting and
        ``auto`` observations and cumulative reuse counts; per-worker state afresh. A
        route whose pool has no worker right now is kept (its worker is being
        replaced), not refused."""
        new = Router(pools, self.routes, sticky=self.sticky, auto_ratio=self.auto_ratio,
                     auto_min_turns=self.auto_min_turns, compute_pools=self.compute_pools,
                     bandwidth_pools=self.bandwidth_pools, check=False)
        with self.guard():
            new._task_tokens = {t: list(v) for t, v in self._task_tokens.items()}
            new._reuse = dict(self._reuse)
        return new

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_in_flight"] = [0] * len(self.worker_pools)
        state["_tokens"] = [0] * len(self.worker_pools)
        state["_live_cache"] = {}
        return state

    def guard(self) -> threading.Lock:
        if self._lock is None:
            self._lock = threading.Lock()
        return self._lock

    @property
    def pools(self) -> tuple[str, ...]:
        """The pool tags carried by at least one worker, sorted."""
        return tuple(sorted(set(self.worker_pools)))

    # -- the decision -------------------------------------------------------------------
    def allowed(self, pools) -> list[int]:
        """Worker indices of ``pools`` (``None``: all), dead or not."""
        if pools is None:
            return list(range(len(self.worker_pools)))
        if isinstance(pools, str):
            pools = (pools,)
        if not pools:
            raise ValueError(f"pools is empty: pass None or some of {list(self.pools)}")
        unknown = [p for p in pools if p not in self.pools]
        if len(unknown) == len(pools):  # some missing is fine (a lost worker's pool)
            raise ValueError(f"no inference worker carries pool(s) {unknown}; available "
                             f"pools: {list(self.pools)}")
        return [i for i, pool in enumerate(self.worker_pools) if pool in pools]

    def _live(self, pools) -> tuple[list[int], set[int]]:
        """``allowed(pools)`` less the dead workers, as a list and a set; cached per
        pools and dead count (a route is O(workers) only when it must pick one)."""
        key = (pools if not isinstance(pools, list) else tuple(pools), len(self.dead))
        hit = self._live_cache.get(key)
        if hit is None:
            live = [i for i in self.allowed(pools) if i not in self.dead]
            hit = self._live_cache[key] = (live, set(live))
        return hit

    def least_loaded(self, allowed: list[int]) -> int:
        """Fewest queued + in-flight tokens, then fewest calls; ties round robin."""
        least = min((self._tokens[i], self._in_flight[i]) for i in allowed)
        ties = [i for i in allowed if (self._tokens[i], self._in_flight[i]) == least]
        n = len(self.worker_pools)
        idx = min(ties, key=lambda i: (i - self._next) % n)
        self._next = (idx + 1) % n
        return idx

    def route(self, traj_id: str | None, task: str | None = None, pools=None,
              tokens: int = 0) -> int:
        """Index of the worker for a request of ``traj_id`` (of ``task``, limited to
        ``pools``) and count ``tokens`` of load on it; pair with ``done(idx, tokens)``.

        Sticky (when on) to the worker that served the trajectory before, else the least
        loaded allowed one. ``traj_id=None`` never sticks (a decode phase)."""
        if task is not None:
            pools = self.pools_for(task, pools)
        allowed, allowed_set = self._live(pools)
        if not allowed:
            raise WorkerLostError(f"every inference worker of pools {pools or self.pools} "
                                  "was lost; the driver re-creates them when their workers "
                                  "come back")
        with self.guard():
            idx = self._sticky.get(traj_id) if (self.sticky and traj_id is not None) else None
            if idx is None or idx not in allowed_set:
                idx = self.least_loaded(allowed)
                if traj_id is not None:
                    if self._sticky.get(traj_id) != idx:
                        self._context.pop(traj_id, None)  # its prefix is not cached there
                    self._sticky[traj_id] = idx
            self._routed[idx] += 1
            self._in_flight[idx] += 1
            self._tokens[idx] += int(tokens)
        return idx

    def done(self, idx: int, tokens: int = 0) -> None:
        """The request routed to ``idx`` with ``tokens`` of load finished."""
        with self.guard():
            self._in_flight[idx] -= 1
            self._tokens[idx] -= int(tokens)

    def release(self, traj_id: str) -> None:
        """Forget ``traj_id`` (its trajectory is finished)."""
        with self.guard():
            self._sticky.pop(traj_id, None)
            self._context.pop(traj_id, None)

    def lost(self, idx: int, traj_id: str | None = None) -> None:
        """Worker ``idx`` was lost: never route to it again; ``traj_id`` re-routes."""
        with self.guard():
            self.dead.add(idx)
            if traj_id is not None:
                self._sticky.pop(traj_id, None)
                self._context.pop(traj_id, None)

    def disaggregated(self, task: str | None) -> Affinity | None:
        """The task's affinity when its prefill and decode run on two pools (PD)."""
        aff = self.routes.get(task) if task is not None else None
        return aff if aff is not None and aff.disaggregated else None

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

    # -- what the caller reports --------------------------------------------------------
    def new_tokens(self, traj_id: str, prompt_tokens: int) -> int:
        """Prompt tokens not cached on the trajectory's sticky worker (at least 1)."""
        cached = self._context.get(traj_id, 0) if self.sticky else 0
        return max(int(prompt_tokens) - cached, 1)

    def served(self, traj_id: str, context_tokens: int) -> None:
        """The trajectory's sticky worker now caches ``context_tokens`` of its context."""
        self._context[traj_id] = int(context_tokens)

    def count_reuse(self, traj_id: str, idx: int, prompt_tokens: int, new: int) -> None:
        with self.guard():
            r = self._reuse
            r["turns"] += 1
            r["prompt_tokens"] += int(prompt_tokens)
            if traj_id in self._context and self._sticky.get(traj_id) == idx:
                r["sticky_turns"] += 1
                r["cached_tokens"] += int(prompt_tokens) - new

    def observe(self, task: str | None, prompt_tokens: int, response_tokens: int) -> None:
        """One turn of ``task`` had these sizes (the ``auto`` classification's input)."""
        if task is None:
            return
        with self.guard():
            t = self._task_tokens.setdefault(task, [0, 0, 0])
            t[0] += int(prompt_tokens)
            t[1] += int(response_tokens)
            t[2] += 1

    def stats(self) -> dict:
        """Per-worker routed / in-flight / tokens, reuse and per-task observations."""
        with self.guard():
            r = self._reuse
            return {"workers": [{"pool": pool, "routed": self._routed[i],
                                 "in_flight": self._in_flight[i], "tokens": self._tokens[i]}
                                for i, pool in enumerate(self.worker_pools)],
                    "trajectories": len(self._sticky), "sticky_turns": r["sticky_turns"],
                    "turns": r["turns"],
                    "expected_reuse": r["cached_tokens"] / max(r["prompt_tokens"], 1),
                    "dead": len(self.dead),
                    "tasks": {t: {"prompt_tokens": v[0], "response_tokens": v[1],
                                  "turns": v[2], "class": self.classification(t)}
                              for t, v in self._task_tokens.items()}}
