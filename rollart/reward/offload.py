"""``@serverless``: mark a reward (or any stateless step) to run off the rollout workers
(offloaded: the decorator, its ``ServerlessConfig``, and the JSON wire format).

A serverless reward is still a plain reward function (calling it runs the function
here), plus a ``ServerlessConfig`` saying where the reward stage should run it:

* ``backend="pool"``: as Dask tasks on an elastic worker pool (resource tag ``pool``,
  default ``SERVERLESS``) that grows with demand up to ``max_workers`` and shrinks to
  zero when idle (``rollart.reward.elastic.ElasticPool``);
* ``backend="http"``: ``POST`` to a function endpoint ``url`` — JSON in, JSON out,
  never pickle (``rollart.reward.server`` hosts functions that way).

Both backends batch concurrent requests (``max_batch``, ``batch_wait``), time out each
attempt (``timeout``), retry with exponential back-off (``retries``, ``backoff``) and
then apply the failure policy: ``on_failure="fail"`` (the default) makes that
trajectory ``failed`` — counted in the ledger, never a silent zero — while a number
uses that value as the reward and counts it as a fallback. The dispatching side is
``rollart.reward.dispatch`` (called by ``rollart.env.trajectory``).

>>> @serverless(max_workers=2)
... def short_answer(ep):
...     return 1.0 if len(ep.actions) <= 3 else 0.0
>>> from rollart.types import Episode
>>> short_answer(Episode("t", 0, ["o"], ["a"], [0.0], {}))     # still a plain function
1.0
>>> short_answer.config.backend, short_answer.config.max_workers
('pool', 2)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import numbers
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

from rollart.reward.functions import check_reward
from rollart.types import Episode

SERVERLESS = "SERVERLESS"  #: resource tag of the default elastic reward pool
BACKENDS = ("pool", "http")
EPISODE_KIND = "episode"  # request "kind" telling the function server to build Episodes


class RewardFailed(RuntimeError):
    """A serverless reward failed for good (every attempt timed out or raised)."""


@dataclass(frozen=True)
class ServerlessConfig:
    """Where and how a serverless step runs; validated with messages saying what to fix."""

    backend: str = "pool"  # "pool" (elastic Dask pool) | "http" (function endpoint)
    url: str | None = None  # http backend: the endpoint, e.g. http://127.0.0.1:8900/score
    pool: str = SERVERLESS  # pool backend: the resource tag of the elastic pool
    max_workers: int = 2  # pool backend: the elastic pool's maximum size
    threads: int = 1  # pool backend: threads (task slots) per elastic worker
    # pool backend: seconds idle before a worker is retired (0: as soon as the pool sees
    # it idle, worth it when workers start fast, e.g. in-process ones)
    idle_timeout: float = 0.5
    timeout: float = 30.0  # seconds per attempt (includes a pool cold start)
    retries: int = 2  # further attempts after the first
    backoff: float = 0.2  # seconds before the first retry; doubles each time
    max_backoff: float = 5.0
    on_failure: str | float = "fail"  # "fail" | a fallback reward value (counted)
    max_batch: int = 8  # requests sent together in one task / HTTP call
    batch_wait: float = 0.005  # seconds to wait for more requests before sending
    max_in_flight: int | None = None  # batches out at once (None: 2 per pool slot)

    def __post_init__(self):
        def check(ok, msg):
            if not ok:
                raise ValueError(f"serverless: {msg}")

        check(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, "
              f"got {self.backend!r}")
        if self.backend == "http":
            check(isinstance(self.url, str) and self.url.startswith(("http://", "https://")),
                  f"backend='http' needs url='http://host:port/name', got {self.url!r}")
        check(isinstance(self.pool, str) and self.pool, "pool must be a resource tag")
        for name in ("max_workers", "threads", "max_batch"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                  f"{name} must be an int >= 1, got {v!r}")
        check(self.max_in_flight is None or (isinstance(self.max_in_flight, int)
                                             and self.max_in_flight >= 1),
              f"max_in_flight must be None or an int >= 1, got {self.max_in_flight!r}")
        check(isinstance(self.retries, int) and self.retries >= 0,
              f"retries must be an int >= 0, got {self.retries!r}")
        for name in ("timeout", "max_backoff"):
            check(getattr(self, name) > 0, f"{name} must be > 0 seconds")
        for name in ("backoff", "batch_wait", "idle_timeout"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0 seconds")
        if isinstance(self.on_failure, str):
            check(self.on_failure == "fail", "on_failure must be 'fail' or a fallback "
                  f"reward value, got {self.on_failure!r}")
        else:
            check(isinstance(self.on_failure, numbers.Real)
                  and math.isfinite(self.on_failure),
                  f"on_failure fallback must be a finite number, got {self.on_failure!r}")

    @property
    def in_flight_limit(self) -> int:
        """Batches out at once: by default two per slot of the pool at its largest, so
        the next batch already waits on a worker while one computes."""
        return self.max_in_flight or 2 * self.max_workers * self.threads

    def delay(self, attempt: int) -> float:
        """Back-off before retry number ``attempt`` (1-based).

        >>> ServerlessConfig(backoff=0.1).delay(3)
        0.4
        """
        return min(self.backoff * 2 ** (attempt - 1), self.max_backoff)


class ServerlessReward:
    """A reward function plus its ``ServerlessConfig``. Made by ``serverless``.

    Calling it runs the step here (``fn`` locally, or one blocking HTTP request when
    it only has a URL); the reward stage sends it to its backend instead. Pickles by
    reference when it is a module attribute (what ``@serverless`` at module level
    gives), otherwise as ``fn`` + config.
    """

    def __init__(self, fn: Callable | None, config: ServerlessConfig, name: str | None = None):
        if fn is None and config.backend != "http":
            raise ValueError("serverless: a reward without a function needs backend='http'")
        if fn is not None and not callable(fn):
            raise TypeError(f"serverless: expected a function, got {type(fn).__name__}")
        self.fn, self.config = fn, config
        self.__name__ = name or (_url_name(config.url) if fn is None else
                                 getattr(fn, "__name__", None) or type(fn).__name__)
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())
            self.__name__ = name or self.__name__

    @property
    def name(self) -> str:
        return self.__name__

    def __call__(self, episode):
        return self.batch([episode])[0]

    def batch(self, items: list) -> list:
        """Values for ``items`` computed here (one call to ``fn.batch`` when it has one)."""
        if self.fn is None:
            outputs, errors = http_call(self.config.url, items, self.config.timeout)
            for e in errors:
                if e:
                    raise RewardFailed(f"{self.name} at {self.config.url}: {e}")
            return outputs
        if hasattr(self.fn, "batch"):
            return list(self.fn.batch(list(items)))
        return [self.fn(x) for x in items]

    def __repr__(self) -> str:
        where = self.config.url if self.config.backend == "http" else self.config.pool
        return f"serverless({self.name}, {self.config.backend}:{where})"

    def __reduce__(self):
        module = getattr(self, "__module__", None)
        qualname = getattr(self, "__qualname__", None)
        if module and qualname and _lookup(module, qualname) is self:
            return _lookup, (module, qualname)
        return ServerlessReward, (self.fn, self.config, self.__name__)


def serverless(fn: Callable | None = None, **config: Any):
    """Mark ``fn`` serverless; use bare (``@serverless``) or with ``ServerlessConfig``
    keywords (``@serverless(backend="http", url=..., timeout=5)``)."""
    cfg = ServerlessConfig(**config)
    if fn is None:
        return lambda f: ServerlessReward(f, cfg)
    return ServerlessReward(fn, cfg)


def http_reward(url: str, name: str | None = None, **config: Any) -> ServerlessReward:
    """A reward that lives only behind ``url`` (nothing to run locally).

    >>> http_reward("http://127.0.0.1:8900/score").name
    'score'
    """
    return ServerlessReward(None, ServerlessConfig(backend="http", url=url, **config), name)


def is_serverless(fn) -> bool:
    return isinstance(fn, ServerlessReward)


# -- running a batch (on a pool worker, or in the function server) ----------------------
def run_batch(fn: Callable, items: list) -> tuple[list, list]:
    """``(outputs, errors)``: per item a checked value and ``None``, or ``None`` and the
    error text. A batched function (``fn.batch``) that raises fails the whole batch."""
    batch = getattr(fn, "batch", None)
    if batch is not None:
        try:
            values = list(batch(list(items)))
            if len(values) != len(items):
                raise ValueError(f"returned {len(values)} values for {len(items)} inputs")
        except Exception as e:
            return [None] * len(items), [_error(e)] * len(items)
    else:
        values = []
        for x in items:
            try:
                values.append(fn(x))
            except Exception as e:
                values.append(e)
    outputs, errors = [], []
    for v in values:
        if isinstance(v, Exception):
            outputs.append(None)
            errors.append(_error(v))
        else:
            outputs.append(v)
            errors.append(None)
    return outputs, errors


def score_batch(reward: Callable, episodes: list[Episode]) -> tuple[list, list]:
    """``run_batch`` with every value checked as a reward (the pool backend's task)."""
    outputs, errors = run_batch(reward, episodes)
    name = getattr(reward, "__name__", repr(reward))
    for i, v in enumerate(outputs):
        if errors[i] is None:
            try:
                outputs[i] = check_reward(v, name)
            except Exception as e:
                outputs[i], errors[i] = None, _error(e)
    return outputs, errors


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


# -- JSON wire format ----------------------------------------------------------------
def encode_request(items: list) -> bytes:
    """The request body: episodes as JSON objects, tagged so the server rebuilds them."""
    if items and all(isinstance(x, Episode) for x in items):
        body = {"kind": EPISODE_KIND, "inputs": [dataclasses.asdict(x) for x in items]}
    else:
        body = {"inputs": list(items)}
    return json.dumps(body, default=_jsonable).encode()


def decode_inputs(body: dict) -> list:
    """Inputs of a request body (``Episode`` s when it says ``kind: episode``)."""
    inputs = body.get("inputs")
    if not isinstance(inputs, list):
        raise ValueError('the request body must be {"inputs": [...]}')
    if body.get("kind") == EPISODE_KIND:
        return [Episode(**x) for x in inputs]
    return inputs


def decode_response(raw: bytes, n: int) -> tuple[list, list]:
    body = json.loads(raw)
    outputs, errors = body.get("outputs"), body.get("errors") or [None] * n
    if not isinstance(outputs, list) or len(outputs) != n or len(errors) != n:
        raise ValueError(f"malformed response: expected {n} outputs, got {raw[:200]!r}")
    return outputs, errors


def http_call(url: str, items: list, timeout: float) -> tuple[list, list]:
    """One blocking request (the async one is in ``rollart.reward.dispatch``)."""
    req = urllib.request.Request(url, data=encode_request(items), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return decode_response(resp.read(), len(items))


def _jsonable(x):
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def _lookup(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _url_name(url: str | None) -> str:
    return (url or "reward").rstrip("/").rsplit("/", 1)[-1] or "reward"
