"""Straggler and failure injection for any env: slow start-up, heavy-tailed step latency,
crashes and hangs, declared as data and reproducible from seeds.

Consumes an env factory (or a ``rollart.env.tasks.Task`` / task name) and a ``Faults``
record; produces ``FaultyEnv`` instances (through the picklable ``FaultyEnvFactory``)
and ``with_faults(task, faults)``, a copy of a task whose envs misbehave like real
sandboxes. Used by tests and benchmarks of the rollout stage (the env manager sees a
``FaultyEnv`` as an ordinary env; it prefers its ``areset``/``astep``, which sleep with
``asyncio.sleep`` and never hold a thread).

Every decision (latency samples, fail, hang) comes from
``random.Random(f"{faults.seed}/{episode_seed}/{instance}/{turn}")``, so the same (seed,
episode seed, env instance, turn) always behaves the same, whatever the timing. The
instance number (0 for a ``FaultyEnv`` made directly; 0, 1, 2, … per process for those a
``FaultyEnvFactory`` makes) lets the members of one GRPO group — same episode seed —
straggle differently, as separate sandboxes do. ``fail_seeds`` / ``hang_seeds`` name
episodes that fail / hang on their first step in every instance (a bad task, a sandbox
image that never answers): a whole group, replacements included, then meets the fault
whatever the timing and the instance numbering.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from rollart.env.tasks import Task, get_task

LATENCY_KINDS = ("fixed", "lognormal", "pareto")
_INSTANCES = itertools.count(1)  # FaultyEnv instances made by factories in this process


class InjectedFault(RuntimeError):
    """A failure (or the end of a hang) injected by ``FaultyEnv``, not a real env bug."""


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Latency:
    """A delay distribution in seconds.

    * ``fixed``: always ``seconds``.
    * ``lognormal``: median ``seconds``, log-space standard deviation ``sigma``.
    * ``pareto``: minimum (scale) ``seconds``, tail index ``shape`` (smaller = heavier).

    ``cap`` (optional) bounds every sample from above.
    """

    kind: str
    seconds: float = 0.0
    sigma: float = 1.0
    shape: float = 1.5
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in LATENCY_KINDS:
            raise ValueError(
                f"Latency kind {self.kind!r} is unknown; use one of {', '.join(LATENCY_KINDS)}"
            )
        if _real(self.seconds, "Latency.seconds") < 0:
            raise ValueError(
                f"Latency.seconds is {self.seconds}; use a value >= 0 (the fixed delay, the "
                "lognormal median or the pareto minimum)"
            )
        if _real(self.sigma, "Latency.sigma") <= 0:
            raise ValueError(f"Latency.sigma is {self.sigma}; use a value > 0 (e.g. 1.0)")
        if _real(self.shape, "Latency.shape") <= 0:
            raise ValueError(
                f"Latency.shape is {self.shape}; use a value > 0 (e.g. 1.5; smaller means "
                "a heavier tail)"
            )
        if self.cap is not None and _real(self.cap, "Latency.cap") < 0:
            raise ValueError(f"Latency.cap is {self.cap}; use a value >= 0 or None (no cap)")

    def sample(self, rng: random.Random) -> float:
        """One delay in seconds drawn with ``rng``."""
        if self.kind == "fixed" or self.seconds == 0:
            value = self.seconds
        elif self.kind == "lognormal":
            value = rng.lognormvariate(math.log(self.seconds), self.sigma)
        else:  # pareto: paretovariate is >= 1 with P(X > x) = x ** -shape
            value = self.seconds * rng.paretovariate(self.shape)
        return min(value, self.cap) if self.cap is not None else value


def _as_latency(value: Latency | float | None, name: str) -> Latency | None:
    if value is None or isinstance(value, Latency):
        return value
    seconds = _real(value, f"Faults.{name}")
    if seconds < 0:
        raise ValueError(f"Faults.{name} is {seconds}; use a delay >= 0 seconds")
    return Latency("fixed", seconds=seconds)


@dataclass(frozen=True)
class Faults:
    """What to inject. Floats are shorthand for ``Latency("fixed", seconds=x)``.

    ``startup`` delays the first reset of each env instance (a container pull);
    ``step`` is added to every step; a step raises ``InjectedFault`` with probability
    ``fail_prob`` and hangs for ``hang_seconds`` with probability ``hang_prob``. The first
    step of an episode whose seed is in ``fail_seeds`` / ``hang_seeds`` fails / hangs in
    every instance.
    """

    startup: Latency | float = 0.0
    step: Latency | float | None = None
    fail_prob: float = 0.0
    hang_prob: float = 0.0
    hang_seconds: float = 3600.0
    seed: int = 0
    fail_seeds: tuple[int, ...] = ()
    hang_seeds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        startup = _as_latency(self.startup, "startup") or Latency("fixed")
        object.__setattr__(self, "startup", startup)
        object.__setattr__(self, "step", _as_latency(self.step, "step"))
        for name in ("fail_prob", "hang_prob"):
            p = _real(getattr(self, name), f"Faults.{name}")
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"Faults.{name} is {p}; use a probability in [0, 1]")
        if self.fail_prob + self.hang_prob > 1.0:
            raise ValueError(
                f"Faults.fail_prob + hang_prob is {self.fail_prob + self.hang_prob}; "
                "lower them so their sum is <= 1"
            )
        if _real(self.hang_seconds, "Faults.hang_seconds") < 0:
            raise ValueError(f"Faults.hang_seconds is {self.hang_seconds}; use a value >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"Faults.seed must be an int, got {self.seed!r}")
        for name in ("fail_seeds", "hang_seeds"):
            seeds = getattr(self, name)
            if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__iter__") or any(
                    isinstance(x, bool) or not isinstance(x, int) for x in seeds):
                raise ValueError(f"Faults.{name} must be episode seeds (ints), got {seeds!r}")
            object.__setattr__(self, name, tuple(seeds))
        both = sorted(set(self.fail_seeds) & set(self.hang_seeds))
        if both:
            raise ValueError(f"Faults.fail_seeds and hang_seeds share {both[:5]}; an "
                             "episode's first step either fails or hangs")


def none() -> Faults:
    """No faults at all: a ``FaultyEnv`` with this behaves exactly like its inner env."""
    return Faults()


def straggler_profile(seed: int = 0, fail_prob: float = 0.0, hang_prob: float = 0.0,
                      hang_seconds: float = 3600.0) -> Faults:
    """Sandbox-like stragglers: lognormal step latency (median 20 ms, sigma 1) and a
    Pareto-tailed start-up (min 50 ms, shape 1.2, capped at 2 s)."""
    return Faults(
        startup=Latency("pareto", seconds=0.05, shape=1.2, cap=2.0),
        step=Latency("lognormal", seconds=0.02, sigma=1.0),
        fail_prob=fail_prob, hang_prob=hang_prob, hang_seconds=hang_seconds, seed=seed,
    )


@dataclass(frozen=True)
class StepPlan:
    """What ``FaultyEnv`` does on one step: sleep ``latency`` s, then fail, hang or step."""

    latency: float
    fail: bool
    hang: bool


def plan_step(faults: Faults, episode_seed: Any, turn: int, instance: int = 0) -> StepPlan:
    """The reproducible decision for step ``turn`` (1-based) of episode ``episode_seed``."""
    key = f"{faults.seed}/{episode_seed}/{turn}" if not instance else \
        f"{faults.seed}/{episode_seed}/{instance}/{turn}"
    rng = random.Random(key)
    u = rng.random()
    latency = faults.step.sample(rng) if faults.step is not None else 0.0
    fail = u < faults.fail_prob
    hang = not fail and u < faults.fail_prob + faults.hang_prob
    if turn == 1 and episode_seed in faults.fail_seeds:
        fail, hang = True, False
    elif turn == 1 and episode_seed in faults.hang_seeds:
        fail, hang = False, True
    return StepPlan(latency, fail, hang)


def plan_startup(faults: Faults, episode_seed: Any, instance: int = 0) -> float:
    """The reproducible start-up delay of an instance whose first reset uses ``episode_seed``."""
    suffix = "startup" if not instance else f"{instance}/startup"
    return faults.startup.sample(random.Random(f"{faults.seed}/{episode_seed}/{suffix}"))


class FaultyEnv:
    """Wraps an env instance and injects ``faults`` into its reset/step.

    Sync ``reset/step`` sleep with ``time.sleep``; a sync hang waits on an event that
    ``close()`` sets (the step then raises ``InjectedFault("hang released by close")``).
    Async ``areset/astep`` sleep with ``asyncio.sleep`` and hang on a future that
    ``close()`` resolves from any thread. ``astep``/``areset`` use the inner env's async
    methods when it has them, else call its sync ones inline. Counters:
    ``injected_failures``, ``injected_hangs``, ``latency_seconds`` (all injected sleep,
    start-up included, hangs excluded).
    """

    def __init__(self, env: Any, faults: Faults, instance: int = 0) -> None:
        if not isinstance(faults, Faults):
            raise TypeError(
                f"FaultyEnv needs a rollart.chaos.faults.Faults, got {type(faults).__name__}"
            )
        self.inner, self.faults, self.instance = env, faults, instance
        self.injected_failures = 0
        self.injected_hangs = 0
        self.latency_seconds = 0.0
        self._started = False
        self._episode_seed: Any = None
        self._turn = 0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()

    def __repr__(self) -> str:
        return f"FaultyEnv({self.inner!r}, {self.faults!r})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "inner":  # no recursion while unpickling
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- decisions ----------------------------------------------------------------------
    def _begin_reset(self, seed: Any) -> float:
        """Record the new episode; return the start-up delay (first reset only)."""
        self._episode_seed, self._turn = seed, 0
        with self._lock:
            first, self._started = not self._started, True
        delay = plan_startup(self.faults, seed, self.instance) if first else 0.0
        self.latency_seconds += delay
        return delay

    def _begin_step(self) -> StepPlan:
        self._turn += 1
        plan = plan_step(self.faults, self._episode_seed, self._turn, self.instance)
        self.latency_seconds += plan.latency
        self.injected_failures += plan.fail
        self.injected_hangs += plan.hang
        return plan

    def _fail_message(self) -> str:
        return (f"injected failure at turn {self._turn} of episode seed {self._episode_seed} "
                f"(fail_prob={self.faults.fail_prob})")

    # -- sync ---------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        delay = self._begin_reset(seed)
        if delay > 0:
            time.sleep(delay)
        return self.inner.reset(seed)

    def step(self, action: str):
        plan = self._begin_step()
        if plan.latency > 0:
            time.sleep(plan.latency)
        if plan.fail:
            raise InjectedFault(self._fail_message())
        if plan.hang:
            if self._closed.wait(self.faults.hang_seconds):
                raise InjectedFault("hang released by close")
            raise InjectedFault(
                f"injected hang of {self.faults.hang_seconds}s at turn {self._turn}")
        return self.inner.step(action)

    # -- async --------------------------------------------------------------------------
    async def areset(self, seed: int) -> str:
        delay = self._begin_reset(seed)
        if delay > 0:
            await asyncio.sleep(delay)
        if hasattr(self.inner, "areset"):
            return await self.inner.areset(seed)
        return self.inner.reset(seed)

    async def astep(self, action: str):
        plan = self._begin_step()
        if plan.latency > 0:
            await asyncio.sleep(plan.latency)
        if plan.fail:
            raise InjectedFault(self._fail_message())
        if plan.hang:
            await self._ahang()
        if hasattr(self.inner, "astep"):
            return await self.inner.astep(action)
        return self.inner.step(action)

    async def _ahang(self) -> None:
        """Wait ``hang_seconds`` without holding a thread; ``close()`` cuts it short."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        entry = (loop, waiter)
        with self._lock:
            if self._closed.is_set():
                raise InjectedFault("hang released by close")
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(waiter, self.faults.hang_seconds)
        except asyncio.TimeoutError:
            raise InjectedFault(
                f"injected hang of {self.faults.hang_seconds}s at turn {self._turn}") from None
        finally:
            with self._lock:
                self._waiters.discard(entry)
        raise InjectedFault("hang released by close")

    # -- close --------------------------------------------------------------------------
    def close(self) -> None:
        """Release every hung step (sync or async, from any thread), then close the env."""
        with self._lock:
            self._closed.set()
            waiters, self._waiters = list(self._waiters), set()
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # that loop is already closed
                pass
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True)
class FaultyEnvFactory:
    """Picklable env factory: ``FaultyEnvFactory(env_factory, faults)()`` is
    ``FaultyEnv(env_factory(), faults)``. ``env_factory`` must pickle too (a class or a
    module-level function)."""

    env_factory: Callable[[], Any]
    faults: Faults

    def __post_init__(self) -> None:
        if not callable(self.env_factory):
            raise TypeError(
                f"FaultyEnvFactory.env_factory must be callable, got "
                f"{type(self.env_factory).__name__}; pass the env class, not an instance"
            )
        if not isinstance(self.faults, Faults):
            raise TypeError(
                f"FaultyEnvFactory.faults must be a Faults, got {type(self.faults).__name__}"
            )

    def __call__(self) -> FaultyEnv:
        return FaultyEnv(self.env_factory(), self.faults, next(_INSTANCES))


def with_faults(task: Task | str, faults: Faults) -> Task:
    """A copy of ``task`` (a ``Task`` or a built-in task name) whose envs inject ``faults``.

    The name and everything else stay the same; only ``env_factory`` is wrapped.
    """
    base = get_task(task)
    if not isinstance(faults, Faults):
        raise TypeError(
            f"with_faults needs a rollart.chaos.faults.Faults, got {type(faults).__name__}; "
            "e.g. Faults(step=0.01) or straggler_profile()"
        )
    return replace(base, env_factory=FaultyEnvFactory(base.env_factory, faults))


def without_faults(task: Task | str) -> Task:
    """``task`` with its plain env factory (undoes ``with_faults``; others unchanged).

    The format warm-up and held-out evaluation use it: injected latency and failures say
    nothing about the policy.
    """
    base = get_task(task)
    factory = base.env_factory
    while isinstance(factory, FaultyEnvFactory):
        factory = factory.env_factory
    return base if factory is base.env_factory else replace(base, env_factory=factory)
