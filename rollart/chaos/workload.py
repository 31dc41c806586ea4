"""Envs that cost what real sandboxes cost, on any built-in or user task.

``with_workload(task, Workload())`` is a copy of ``task`` whose envs behave like agentic
RL sandboxes (SWE containers, browsers, game servers), in the shape of the RollArt
paper's §3 characterisation, scaled down by **one factor** (``Workload.scale``: every
duration below is in paper-scale seconds and runs here as ``seconds × scale``):

* **a step** burns real CPU (``step_cpu``: SHA-256 over a fixed number of 64 KiB blocks,
  a fixed amount of work that takes a core — hashlib releases the GIL, so it contends
  for the machine's cores as a sandbox process would, and runs longer when they are
  busy) and then waits a heavy-tailed time for I/O (``step_wait``, lognormal);
* **a reset** of a warm sandbox costs ``reset_cpu`` + ``reuse_reset``; a sandbox made
  from scratch costs ``create_cpu`` + ``create`` (container start-up, lognormal); each
  reset attempt fails with probability ``reset_fail_prob`` and then costs
  ``fail_wait`` (a sandbox that never comes up is noticed late) before it is retried on
  another sandbox, as env pools do, up to ``max_reset_attempts`` (then it raises
  ``SandboxError`` and the trajectory fails). So resets dominate env time when envs
  fail; with the defaults (``reset_fail_prob=0.3``: 0.43 failed attempts per episode)
  a failure comes about once per 10 env steps on episodes of ~4 steps. The step and
  start-up shapes are those of ``rollart.sim.costs.ENV_PROFILES["sandbox"]`` (median
  2 s steps, σ 1.2; 30 s start-up, σ 0.8);
* **sandboxes are pooled**: the env manager makes an env per trajectory and closes it at
  the end; here the env it makes is a ``PooledEnv`` handle that takes a warm sandbox
  from its process's pool at reset (or creates one) and gives it back on close, so a
  reused sandbox pays ``reuse_reset`` instead of ``create``. A failed sandbox is
  discarded. ``pool_stats()`` / ``drain_pools()`` read and empty the pools of a process
  (run them on workers with ``client.run``).

Waits use ``asyncio.sleep`` in ``areset``/``astep`` (the env manager prefers them: a
remote sandbox's I/O holds no thread of the manager) and ``time.sleep`` in the sync
``reset``/``step``; the CPU part runs on ``Workload.cpu_threads`` threads per process
(the env pool's cores). Every draw comes from ``random.Random`` keyed by
``(seed, episode seed, handle instance, turn or attempt)``, so runs are reproducible
whatever the timing. Consumed by ``benchmarks/pipeline.py``; a user may wrap their own
task to see how a graph copes with sandbox-like envs.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rollart.chaos.faults import Latency
from rollart.env.tasks import Task, get_task

BLOCK = bytes(64 * 1024)  # one unit of CPU work: SHA-256 of 64 KiB
# blocks one idle core of the 2-core reference machine hashes per second (~1.3 GB/s):
# a constant, so a step is a fixed amount of work (it takes longer on a busy machine)
BLOCKS_PER_SECOND = 20_000
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()
_POOLS: dict = {}  # (env factory, Workload) -> list of idle warm sandboxes
_STATS = {"created": 0, "reused": 0, "resets": 0, "reset_failures": 0, "steps": 0,
          "cpu_blocks": 0, "discarded": 0}
_EXECUTORS: dict[int, ThreadPoolExecutor] = {}


class SandboxError(RuntimeError):
    """A sandbox that failed every reset attempt (``Workload.max_reset_attempts``)."""


@dataclass(frozen=True)
class Workload:
    """Sandbox-like env costs in paper-scale seconds; they run as ``seconds × scale``.

    CPU figures are work (seconds of one idle core), waits are wall time.
    """

    scale: float = 0.01
    step_cpu: float = 0.2
    step_wait: Latency = field(default_factory=lambda: Latency("lognormal", 1.8, sigma=1.2,
                                                               cap=300.0))
    reset_cpu: float = 0.2
    reuse_reset: Latency = field(default_factory=lambda: Latency("lognormal", 2.0, sigma=0.5,
                                                                 cap=60.0))
    create_cpu: float = 1.0
    create: Latency = field(default_factory=lambda: Latency("lognormal", 30.0, sigma=0.8,
                                                            cap=600.0))
    reset_fail_prob: float = 0.3
    fail_wait: Latency = field(default_factory=lambda: Latency("lognormal", 10.0, sigma=1.0,
                                                               cap=300.0))
    max_reset_attempts: int = 5
    pool_size: int = 1024  # idle warm sandboxes kept per process (more are discarded)
    cpu_threads: int = 2  # threads per process that run the CPU part (the pool's cores)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("scale", "step_cpu", "reset_cpu", "create_cpu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"Workload.{name} must be a number >= 0, got {v!r}")
        if self.scale <= 0:
            raise ValueError(f"Workload.scale must be > 0 (e.g. 0.01), got {self.scale}")
        if not 0 <= self.reset_fail_prob < 1:
            raise ValueError(f"Workload.reset_fail_prob must be in [0, 1), got "
                             f"{self.reset_fail_prob!r}")
        for name in ("max_reset_attempts", "cpu_threads", "pool_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "pool_size"
                                                                     else 1):
                raise ValueError(f"Workload.{name} must be an int >= 1 (pool_size >= 0), "
                                 f"got {v!r}")
        for name in ("step_wait", "reuse_reset", "create", "fail_wait"):
            if not isinstance(getattr(self, name), Latency):
                raise ValueError(f"Workload.{name} must be a rollart.chaos.faults.Latency")

    def blocks(self, cpu_seconds: float) -> int:
        """Hash blocks for ``cpu_seconds`` of paper-scale CPU work."""
        return max(0, round(cpu_seconds * self.scale * BLOCKS_PER_SECOND))

    def wait(self, latency: Latency, rng: random.Random) -> float:
        return latency.sample(rng) * self.scale


def burn(blocks: int) -> int:
    """Do ``blocks`` units of real CPU work (SHA-256 of 64 KiB each); returns ``blocks``."""
    h = hashlib.sha256()
    for _ in range(blocks):
        h.update(BLOCK)
    with _LOCK:
        _STATS["cpu_blocks"] += blocks
    return blocks


def _executor(threads: int) -> ThreadPoolExecutor:
    with _LOCK:
        if threads not in _EXECUTORS:
            _EXECUTORS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="rollart-sandbox")
        return _EXECUTORS[threads]


class _Sandbox:
    """One warm env instance (the inner env) and whether it came up."""

    def __init__(self, env: Any):
        self.env, self.warm = env, False


@dataclass(frozen=True)
class SandboxPoolFactory:
    """Picklable env factory: each call is a ``PooledEnv`` over this process's pool."""

    env_factory: Callable[[], Any]
    workload: Workload

    def __post_init__(self) -> None:
        if not callable(self.env_factory):
            raise TypeError(f"SandboxPoolFactory.env_factory must be callable, got "
                            f"{type(self.env_factory).__name__}; pass the env class")

    def __call__(self) -> "PooledEnv":
        return PooledEnv(self, next(_HANDLES))

    def take(self) -> _Sandbox | None:
        with _LOCK:
            pool = _POOLS.get(self)
            return pool.pop() if pool else None

    def give_back(self, box: _Sandbox) -> None:
        with _LOCK:
            pool = _POOLS.setdefault(self, [])
            if box.warm and len(pool) < self.workload.pool_size:
                pool.append(box)
                return
            _STATS["discarded"] += 1
        _close(box.env)


class PooledEnv:
    """The env the manager sees: a handle on a pooled sandbox for one episode."""

    def __init__(self, factory: SandboxPoolFactory, instance: int):
        self.factory, self.w, self.instance = factory, factory.workload, instance
        self.box: _Sandbox | None = None
        self._episode, self._turn = None, 0

    def __getattr__(self, name: str) -> Any:  # tools etc. of the inner env
        if name.startswith("_") or name in ("box", "factory", "w"):
            raise AttributeError(name)
        box = self.box
        if box is None:
            raise AttributeError(name)
        return getattr(box.env, name)

    def _rng(self, what: Any) -> random.Random:
        return random.Random(f"{self.w.seed}/{self._episode}/{self.instance}/{what}")

    def _plan_reset(self, attempt: int) -> tuple[int, float, bool, bool]:
        """(cpu blocks, wait s, fails, cold) of reset attempt ``attempt``; takes or makes
        the sandbox it will use."""
        rng = self._rng(f"reset{attempt}")
        cold = self.box is None
        if cold:
            box = self.factory.take()
            cold = box is None
            self.box = box or _Sandbox(self.factory.env_factory())
        with _LOCK:
            _STATS["resets"] += 1
            _STATS["created" if cold else "reused"] += 1
        lat, cpu = (self.w.create, self.w.create_cpu) if cold else \
            (self.w.reuse_reset, self.w.reset_cpu)
        fails = rng.random() < self.w.reset_fail_prob
        wait = self.w.wait(self.w.fail_wait if fails else lat, rng)
        return self.w.blocks(cpu), wait, fails, cold

    def _failed(self, attempt: int) -> None:
        """A reset attempt failed: discard its sandbox; raise after the last attempt."""
        box, self.box = self.box, None
        with _LOCK:
            _STATS["reset_failures"] += 1
            _STATS["discarded"] += 1
        _close(box.env)
        if attempt + 1 >= self.w.max_reset_attempts:
            raise SandboxError(f"sandbox reset failed {attempt + 1} times for episode seed "
                               f"{self._episode} (Workload.max_reset_attempts)")

    def _plan_step(self) -> tuple[int, float]:
        self._turn += 1
        with _LOCK:
            _STATS["steps"] += 1
        return self.w.blocks(self.w.step_cpu), self.w.wait(self.w.step_wait,
                                                          self._rng(self._turn))

    async def _cpu(self, blocks: int) -> None:
        if blocks:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(_executor(self.w.cpu_threads), burn, blocks)

    # -- async (preferred by the env manager) ------------------------------------------
    async def areset(self, seed: int) -> str:
        self._episode, self._turn = seed, 0
        for attempt in range(self.w.max_reset_attempts):
            blocks, wait, fails, _ = self._plan_reset(attempt)
            await self._cpu(blocks)
            await asyncio.sleep(wait)
            if not fails:
                self.box.warm = True
                return self.box.env.reset(seed)
            self._failed(attempt)
        raise AssertionError("unreachable")  # _failed raised on the last attempt

    async def astep(self, action: Any):
        blocks, wait = self._plan_step()
        await self._cpu(blocks)
        await asyncio.sleep(wait)
        return self.box.env.step(action)

    # -- sync ---------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        self._episode, self._turn = seed, 0
        for attempt in range(self.w.max_reset_attempts):
            blocks, wait, fails, _ = self._plan_reset(attempt)
            burn(blocks)
            time.sleep(wait)
            if not fails:
                self.box.warm = True
                return self.box.env.reset(seed)
            self._failed(attempt)
        raise AssertionError("unreachable")

    def step(self, action: Any):
        blocks, wait = self._plan_step()
        burn(blocks)
        time.sleep(wait)
        return self.box.env.step(action)

    def close(self) -> None:
        """Give the sandbox back to the pool (discarded if it never came up)."""
        box, self.box = self.box, None
        if box is not None:
            self.factory.give_back(box)


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - a sandbox torn down is gone either way
            pass


def with_workload(task: Task | str, workload: Workload) -> Task:
    """A copy of ``task`` (a ``Task`` or a built-in name) whose envs cost ``workload``."""
    if not isinstance(workload, Workload):
        raise TypeError(f"with_workload needs a rollart.chaos.workload.Workload, got "
                        f"{type(workload).__name__}; e.g. Workload(scale=0.01)")
    base = get_task(task)
    return replace(base, env_factory=SandboxPoolFactory(base.env_factory, workload))


def pool_stats() -> dict:
    """This process's counters and idle sandboxes (``client.run(pool_stats)``)."""
    with _LOCK:
        return {**_STATS, "idle": sum(len(p) for p in _POOLS.values())}


def drain_pools() -> dict:
    """Close every idle sandbox of this process and zero its counters; returns the
    counters before (run between benchmark runs so no run inherits warm sandboxes)."""
    with _LOCK:
        before = {**_STATS, "idle": sum(len(p) for p in _POOLS.values())}
        boxes = [b for p in _POOLS.values() for b in p]
        _POOLS.clear()
        for k in _STATS:
            _STATS[k] = 0
    for box in boxes:
        _close(box.env)
    return before
