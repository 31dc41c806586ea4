"""The reward stage's side of serverless rewards: batch, send, time out, retry, give up.

``RewardDispatcher.score(episode)`` is awaited by a trajectory (``rollart.env.
trajectory.TrajectoryRunner``, on an env manager's event loop). Concurrent calls for
one reward are gathered into batches (up to ``max_batch``, waiting at most
``batch_wait``; while ``max_in_flight`` batches are out, requests wait here and leave
in bigger batches as batches come back), and each batch goes to the reward's backend:

* ``pool``: one Dask task (``score_batch``) restricted to the elastic pool's tag;
* ``http``: one ``POST`` of JSON to the function endpoint.

Every attempt has a time-out; items that time out or raise are retried with
exponential back-off; after the last retry the failure policy decides: raise
``RewardFailed`` (the trajectory becomes ``failed``) or use the fallback value
(counted in ``fallbacks``). A trajectory that is cancelled while it waits only drops
its own wait: the batch, and the Dask gather other trajectories ride on, go on.
``Dispatchers`` holds one dispatcher per reward for a runner and sums their figures.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque

from rollart.reward.offload import (
    RewardFailed,
    ServerlessReward,
    decode_response,
    encode_request,
    score_batch,
)
from rollart.runtime.waits import wait_result


class RewardDispatcher:
    """Batches and sends one serverless reward's requests; keeps its figures."""

    def __init__(self, reward: ServerlessReward):
        self.reward, self.config = reward, reward.config
        self._queue: list[tuple[object, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()
        self.latency: deque = deque(maxlen=2000)
        self.counts = {"requests": 0, "batches": 0, "attempts": 0, "retries": 0,
                       "timeouts": 0, "errors": 0, "item_errors": 0, "failed": 0,
                       "fallbacks": 0, "done": 0}
        self.in_flight = 0
        self.last_error = ""

    async def score(self, episode) -> float:
        """The reward of ``episode``; raises ``RewardFailed`` when it fails for good."""
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((episode, fut))
        self.counts["requests"] += 1
        if len(self._queue) >= self.config.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.config.batch_wait,
                                                                self._flush)
        try:
            return await fut
        finally:
            self.latency.append(time.perf_counter() - t0)

    def _flush(self) -> None:
        """Send what is queued, as batches, while fewer than ``max_in_flight`` batches are
        out; the rest waits here and goes, in bigger batches, as batches come back."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue and len(self._sending) < self.config.in_flight_limit:
            batch = self._queue[:self.config.max_batch]
            del self._queue[:self.config.max_batch]
            task = asyncio.ensure_future(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._sending.discard(task)
        if self._queue and self._timer is None:
            self._flush()

    async def _send(self, batch: list) -> None:
        """Attempt, retry the items still missing, then apply the failure policy."""
        self.counts["batches"] += 1
        n = len(batch)
        self.in_flight += n
        errors = {}
        try:
            for attempt in range(self.config.retries + 1):
                batch = [(x, f) for x, f in batch if not f.done()]  # drop cancelled waits
                if not batch:
                    return
                if attempt:
                    self.counts["retries"] += 1
                    await asyncio.sleep(self.config.delay(attempt))
                outputs, errs = await self._attempt([x for x, _ in batch])
                left = []
                for (x, f), out, err in zip(batch, outputs, errs):
                    if err is None:
                        _resolve(f, out)
                        self.counts["done"] += 1
                    else:
                        left.append((x, f))
                        errors[id(f)] = self.last_error = err
                        self.counts["item_errors"] += 1
                batch = left
            for x, f in batch:
                self._give_up(f, errors.get(id(f), "unknown error"))
        finally:
            self.in_flight -= n

    async def _attempt(self, items: list) -> tuple[list, list]:
        """One try of the whole batch; a time-out or transport error fails every item."""
        self.counts["attempts"] += 1
        send = self._pool if self.config.backend == "pool" else self._http
        try:
            return await send(items)
        except asyncio.TimeoutError:
            self.counts["timeouts"] += 1
            err = (f"TimeoutError: {self.reward.name} took longer than timeout="
                   f"{self.config.timeout}s")
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:2000]
        self.counts["errors"] += 1
        self.last_error = err
        return [None] * len(items), [err] * len(items)

    def _give_up(self, fut: asyncio.Future, error: str) -> None:
        policy = self.config.on_failure
        attempts = self.config.retries + 1
        if policy == "fail":
            self.counts["failed"] += 1
            if not fut.done():
                fut.set_exception(RewardFailed(
                    f"serverless reward {self.reward.name} failed after {attempts} "
                    f"attempt(s): {error}"))
        else:
            self.counts["fallbacks"] += 1
            _resolve(fut, float(policy))

    # -- backends -----------------------------------------------------------------------
    async def _pool(self, items: list) -> tuple[list, list]:
        """One Dask task on the elastic pool. The wait is shielded: the Dask client
        batches concurrent gathers, so a time-out here must not cancel a shared gather;
        a task that has not finished is cancelled on the scheduler instead."""
        from distributed import get_client

        client = get_client()
        key = f"serverless-{self.reward.name}-{uuid.uuid4().hex[:12]}"
        fut = client.submit(score_batch, self.reward, items, pure=False, key=key,
                            resources={self.config.pool: 1})
        try:
            return await wait_result(fut, client, self.config.timeout)
        except asyncio.TimeoutError:
            if fut.status == "pending":  # not in a gather yet: safe to cancel
                fut.cancel()
            raise

    async def _http(self, items: list) -> tuple[list, list]:
        """One POST of JSON to the endpoint (tornado's client: no thread per request)."""
        from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

        t = self.config.timeout
        req = HTTPRequest(self.config.url, method="POST", body=encode_request(items),
                          headers={"Content-Type": "application/json"},
                          connect_timeout=t, request_timeout=t)
        try:  # raise_error=False still raises on time-outs and connection errors (599)
            resp = await asyncio.wait_for(
                AsyncHTTPClient().fetch(req, raise_error=False), t + 1.0)
        except HTTPClientError as e:
            if e.code == 599 and "timeout" in str(e).lower():
                raise asyncio.TimeoutError() from None
            raise
        if resp.code != 200:
            detail = resp.body[:300].decode(errors="replace") if resp.body else resp.error
            raise ConnectionError(f"{self.config.url} answered {resp.code}: {detail}")
        return decode_response(resp.body, len(items))

    def stats(self) -> dict:
        return {**self.counts, "queued": len(self._queue), "in_flight": self.in_flight,
                "latency": list(self.latency)}


class Dispatchers:
    """One ``RewardDispatcher`` per serverless reward, for one runner."""

    def __init__(self):
        self._by_key: dict[tuple, RewardDispatcher] = {}

    def get(self, reward: ServerlessReward) -> RewardDispatcher:
        key = (reward.name, getattr(reward.fn, "__module__", None), reward.config)
        if key not in self._by_key:
            self._by_key[key] = RewardDispatcher(reward)
        return self._by_key[key]

    def stats(self) -> dict:
        """Summed figures, namespaced ``reward/…`` (latency in seconds, end to end)."""
        out: dict[str, float] = {}
        lat: list[float] = []
        for d in self._by_key.values():
            s = d.stats()
            lat += s.pop("latency")
            for k, v in s.items():
                out[f"reward/{k}"] = out.get(f"reward/{k}", 0) + v
        lat.sort()
        out["reward/latency_p50"] = lat[len(lat) // 2] if lat else 0.0
        out["reward/latency_p95"] = lat[int(len(lat) * 0.95)] if lat else 0.0
        return out


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
