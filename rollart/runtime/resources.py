"""Hardware pools: declared as plain data, started as a Dask cluster, checked before use.

A resources file (``resources/*.py``) defines ``resources() -> Resources``: either a list
of ``Pool`` s (started here as a ``SpecCluster``, one worker spec per worker, each worker
carrying its pool's resource tag) or the ``address`` of a scheduler that already runs.
The control loop calls ``load_resources`` → ``connect`` → ``check_tags``; a tag the graph
needs but no worker carries is an error naming the tag and the file to change, because a
Dask task restricted to a missing resource would otherwise wait forever.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from rollart.types import ALL_TAGS

POOL_KINDS = ("compute_gpu", "bandwidth_gpu", "cpu_env", "reward", "trainer", "cpu")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESOURCES = "local"
#: glibc's mmap threshold in rollart's worker processes (``MALLOC_MMAP_THRESHOLD_``, bytes;
#: the most glibc takes). Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_``, which also freezes
#: glibc's mmap threshold at 128 KiB, so every tensor above it is mmapped and unmapped
#: again, page faults and all: measured on 2 cores, the chat toy's warm-up step (batch 32,
#: ~290 tokens) took 1.35 s under Dask's setting and 0.73 s with this one or none
#: (``worker_nanny``). A value in the environment or in Dask's config wins.
MMAP_THRESHOLD = 32 * 2**20
_ADDRESS = re.compile(r"^(tcp|tls|ucx|ucxx|inproc)://|^[\w.\-]+:\d+$")


class ResourcesError(ValueError):
    """A resources file or address that cannot be used; the message says what to change."""


class ResourceTagError(ResourcesError):
    """The graph needs a resource tag that no worker of the cluster carries."""


@dataclass(frozen=True)
class Pool:
    """``workers`` Dask workers, each carrying ``{tag: slots}`` and ``threads`` threads."""

    name: str  # the pool's name (its workers are NAME-0, NAME-1, ...)
    tag: str  # the resource tag its workers carry (rollart.types: H800, H20, CPU_ENV, ...)
    kind: str  # one of POOL_KINDS: compute_gpu, bandwidth_gpu, cpu_env, reward, trainer, cpu
    workers: int = 1  # Dask workers in the pool (a TRAIN pool of N is an N-rank gang)
    slots: float = 1  # how much of the tag each worker carries ({tag: slots})
    threads: int = 1  # threads of each worker
    memory_limit: str | None = None  # each worker's Dask memory limit, e.g. "4GB" (None: none)
    extra_tags: dict[str, float] = field(default_factory=dict)  # more resource tags of each worker
    gpus: int = 0  # GPUs of each worker (rollart.runtime.devices: CUDA_VISIBLE_DEVICES)
    # (min, max) workers: a running job resizes the pool between trainer steps by its
    # measured demand (rollart.control.scaling.Demand: requests queued per engine, env
    # calls waiting for a thread); inference and env pools of a cluster rollart makes
    adapt: tuple[int, int] | None = None

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ResourcesError(f"Pool name must be a non-empty string, got {self.name!r}")
        if self.kind not in POOL_KINDS:
            raise ResourcesError(
                f"Pool {self.name!r}: kind {self.kind!r} is unknown; use one of {POOL_KINDS}"
            )
        if not isinstance(self.tag, str) or not self.tag:
            raise ResourcesError(f"Pool {self.name!r}: tag must be a non-empty string")
        for attr in ("workers", "threads", "gpus"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (
                    attr == "threads" and value < 1):
                raise ResourcesError(f"Pool {self.name!r}: {attr} must be a whole number ≥ "
                                     f"{1 if attr == 'threads' else 0}, got {value!r}")
        if not isinstance(self.slots, (int, float)) or self.slots <= 0:
            raise ResourcesError(f"Pool {self.name!r}: slots must be > 0, got {self.slots!r}")
        if self.adapt is not None:
            self._check_adapt()

    def _check_adapt(self) -> None:
        lo_hi = tuple(self.adapt) if isinstance(self.adapt, (tuple, list)) else ()
        if len(lo_hi) != 2 or not all(isinstance(x, int) for x in lo_hi) or \
                not 1 <= lo_hi[0] <= self.workers <= lo_hi[1]:
            raise ResourcesError(f"Pool {self.name!r}: adapt must be (min, max) whole numbers "
                                 f"with 1 <= min <= workers ({self.workers}) <= max, got "
                                 f"{self.adapt!r}")
        if self.kind not in ("compute_gpu", "bandwidth_gpu", "cpu_env") or self.gpus:
            raise ResourcesError(f"Pool {self.name!r}: adapt resizes inference and env pools "
                                 f"of CPU workers, not a {self.kind} pool"
                                 f"{' with GPUs' if self.gpus else ''}")
        object.__setattr__(self, "adapt", lo_hi)  # a list (JSON, --set) kept as a tuple


@dataclass(frozen=True)
class Resources:
    """Pools to start locally, or the address of an existing scheduler."""

    pools: tuple[Pool, ...] = ()  # the pools to start here (a SpecCluster)
    address: str | None = None  # an existing scheduler to connect to instead
    processes: bool = True  # workers as processes (False: threads of this process)
    dashboard_address: str | None = ":8787"  # the Dask dashboard (None: none)
    source: str = "<python>"  # where it was declared, named in error messages
    host: str = "127.0.0.1"  # interface the scheduler, workers and dashboard listen on
    security: object = None  # a distributed.security.Security (TLS); None = plain tcp

    def __post_init__(self):
        if not self.pools and not self.address:
            raise ResourcesError(f"{self.source}: declare at least one Pool or an address")
        if not isinstance(self.pools, tuple) or not all(isinstance(p, Pool) for p in self.pools):
            raise ResourcesError(f"{self.source}: pools must be a tuple of rollart.Pool, got "
                                 f"{self.pools!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ResourcesError(f"{self.source}: host must be an interface address such as "
                                 f"'127.0.0.1' (the default) or '0.0.0.0', got {self.host!r}")
        _check_security(self.security, self.source)
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ResourcesError(f"{self.source}: pool names repeat: {names}")

    def tags(self) -> dict[str, float]:
        """Total amount of each resource tag over all declared workers."""
        total: dict[str, float] = defaultdict(float)
        for p in self.pools:
            total[p.tag] += p.slots * p.workers
            for t, n in p.extra_tags.items():
                total[t] += n * p.workers
        return dict(total)

    def worker_specs(self) -> dict[str, dict]:
        """The ``SpecCluster`` worker spec: one entry per worker, named ``{pool}-{i}``;
        a worker of a pool with ``gpus`` gets its own (``rollart.runtime.devices``)."""
        from distributed import Worker

        from rollart.runtime.devices import GPUAssignmentError, check_gpus, worker_env

        try:
            gpus = check_gpus(self.pools, self.processes, self.source)
        except GPUAssignmentError as e:
            raise ResourcesError(str(e)) from None
        specs = {}
        for p in self.pools:
            for i in range(p.workers):
                options = {
                    "nthreads": p.threads,
                    "resources": {p.tag: p.slots, **p.extra_tags},
                    "name": f"{p.name}-{i}",
                    "memory_limit": p.memory_limit or 0,
                    "host": self.host,
                }
                if self.security is not None:
                    options["security"] = self.security
                    options["protocol"] = "tls"
                if self.processes:
                    threads = str(p.threads)
                    options["env"] = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
                    if gpus is not None:
                        options["env"].update(worker_env(
                            gpus[f"{p.name}-{i}"], os.environ.get("CUDA_VISIBLE_DEVICES")))
                specs[f"{p.name}-{i}"] = {"cls": worker_nanny() if self.processes else Worker,
                                          "options": options}
        return specs

    def make_cluster(self, asynchronous: bool = False, dask_logs: str | None = None):
        """Start the declared pools as a ``SpecCluster`` (scheduler in this process).

        Dask's INFO logs are off (its loggers at WARNING, here and in the worker
        processes) unless asked for: ``dask_logs="info"`` or ``ROLLART_DASK_LOGS=info``
        (or a level in ``DASK_LOGGING__DISTRIBUTED``; ``rollart.runtime.logs``)."""
        from distributed import Scheduler

        from rollart.runtime.logs import set_dask_logs

        set_dask_logs(dask_logs)

        if self.address:
            raise ResourcesError(f"{self.source} points at {self.address}; connect instead")
        options = {"dashboard_address": _on_host(self.dashboard_address, self.host),
                   "host": self.host}
        if self.security is not None:
            options.update(security=self.security, protocol="tls")
        scheduler = {"cls": Scheduler, "options": options}
        cluster = _cluster_class()(workers=self.worker_specs(), scheduler=scheduler,
                                   asynchronous=asynchronous, name="rollart",
                                   security=self.security)
        cluster.pools = self.pools  # what rollart.control.scaling adapts (Pool.adapt)
        return cluster


#: s a closing cluster's worker processes get to exit on their own (``TaggedCluster``)
WORKER_EXIT_S = 60.0


def _cluster_class():
    """``TaggedCluster``: a ``SpecCluster`` whose end is a scale to zero in which every
    worker exits on its own. ``SpecCluster`` gives a worker process 4 s to exit once its
    worker closed (``Nanny.close``'s 5 s) and kills it past that, with a WARNING per
    worker; a process that imported torch and loaded a model takes longer than that on
    a busy 2-core machine, so every run ended with "Worker process still alive after
    4.0 seconds, killing" lines. Its workers get ``WORKER_EXIT_S`` here (defined in a
    function: ``distributed`` is imported only when a cluster is made)."""
    import asyncio

    from distributed import SpecCluster
    from distributed.core import Status

    class TaggedCluster(SpecCluster):
        def let_go(self, names) -> None:
            """Workers ``names`` were retired (``rollart.control.scaling``): their specs
            go, and their nannies close once each process exited on its own (not waited
            for here)."""
            for name in names:
                self.worker_spec.pop(name, None)
            gone = [self.workers.pop(n) for n in names if n in self.workers]
            self.loop.add_callback(_let_go, gone)

        async def _close(self):
            if self.status == Status.running:
                workers = [w for w in self.workers.values()
                           if w.status not in (Status.closing, Status.closed)]
                await asyncio.gather(*(w.close(timeout=WORKER_EXIT_S) for w in workers),
                                     return_exceptions=True)
            await super()._close()

    async def _let_go(workers):
        await asyncio.gather(*(w.close(timeout=WORKER_EXIT_S) for w in workers),
                             return_exceptions=True)

    return TaggedCluster


def _on_host(address: str | None, host: str) -> str | None:
    """``":8787"`` -> ``"127.0.0.1:8787"``: a bare port listens on ``host`` only."""
    if address is None or not address.startswith(":"):
        return address
    return f"{host}{address}"


def _check_security(security, source: str) -> None:
    if security is None:
        return
    from distributed.security import Security

    if not isinstance(security, Security):
        raise ResourcesError(
            f"{source}: security must be a distributed.security.Security (e.g. "
            f"Security(tls_ca_file=..., tls_client_cert=..., tls_client_key=..., "
            f"require_encryption=True)), got {type(security).__name__}")


def load_resources(spec: str | Resources | None = None) -> Resources:
    """A ``Resources`` from a file path, a name in ``resources/``, or a scheduler address.

    ``None`` is ``resources/local.py``; ``"gpu_cluster"`` is ``resources/gpu_cluster.py``;
    ``"tcp://10.0.0.1:8786"`` connects to that scheduler.
    """
    if isinstance(spec, Resources):
        return spec
    spec = DEFAULT_RESOURCES if spec is None else str(spec)
    if _ADDRESS.match(spec):
        return Resources(address=spec, source=f"--resources {spec}")
    path = find_file(spec, "resources", ResourcesError)
    module = load_module(path, ResourcesError)
    fn = getattr(module, "resources", None)
    if not callable(fn):
        raise ResourcesError(f"{path} defines no resources() function; add "
                             "`def resources() -> rollart.Resources: ...`")
    try:
        res = fn()
    except ResourcesError as e:
        raise ResourcesError(f"{path}: {e}") from None
    if not isinstance(res, Resources):
        raise ResourcesError(f"{path}: resources() returned {type(res).__name__}; "
                             "return a rollart.Resources")
    return res if res.source != "<python>" else replace(res, source=str(path))


def find_file(spec: str, folder: str, error: type[Exception]) -> Path:
    """Resolve a path or a bare name in ``folder/`` (cwd first, then the source tree)."""
    candidates = [Path(spec)]
    if not spec.endswith(".py"):
        candidates.append(Path(spec + ".py"))
    for base in (Path.cwd() / folder, REPO_ROOT / folder):
        candidates += [base / spec, base / f"{spec}.py"]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    known = sorted({p.stem for base in (Path.cwd() / folder, REPO_ROOT / folder)
                    if base.is_dir() for p in base.glob("[!_]*.py")})
    raise error(f"no {folder} file {spec!r}: give a path to a .py file or one of {known}")


#: the name prefix of a config file loaded as a module (``load_module``): not importable
#: by that name anywhere (not even here: it is not in ``sys.modules``), so what it
#: defines travels pickled by value
CONFIG_MODULE_PREFIX = "rollart_config_"


def load_module(path: Path, error: type[Exception]):
    """Execute a config file as a module; any failure becomes ``error`` naming the file."""
    spec = importlib.util.spec_from_file_location(f"{CONFIG_MODULE_PREFIX}{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise error(f"could not load {path}: {type(e).__name__}: {e}") from e
    return module


def cluster_tags(client) -> dict[str, dict[str, float]]:
    """``{worker address: {tag: amount}}`` as the scheduler sees it now."""
    if _accepts_n_workers(client) and not client.asynchronous:
        # ask the scheduler directly: scheduler_info() returns a cache that the client's
        # periodic refresh may overwrite (without per-worker entries) at any moment
        info = client.sync(client.scheduler.identity, n_workers=-1)
    else:
        info = client.scheduler_info()
    return {addr: dict(w.get("resources", {})) for addr, w in info["workers"].items()}


def _accepts_n_workers(client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


def workers_with(client, tag: str) -> list[str]:
    """Addresses of the workers that carry ``tag``, sorted."""
    return sorted(a for a, r in cluster_tags(client).items() if r.get(tag, 0) > 0)


def check_tags(client, needs: dict[str, float], source: str, needed_by: str = "the graph"):
    """Raise ``ResourceTagError`` unless every tag in ``needs`` is on some worker.

    ``needs`` maps a tag to the amount one task asks for; at least one worker must carry
    that much of it.
    """
    tags = cluster_tags(client)
    if not tags:
        raise ResourceTagError(f"the cluster has no workers; start some or declare pools "
                               f"in {source}")
    for tag, amount in needs.items():
        best = max((r.get(tag, 0) for r in tags.values()), default=0)
        if best <= 0:
            have = sorted({t for r in tags.values() for t in r})
            hint = "" if tag in ALL_TAGS else f" (rollart's own tags are {list(ALL_TAGS)})"
            raise ResourceTagError(
                f"no worker carries resource tag {tag!r}, which {needed_by} needs{hint}; "
                f"the cluster has tags {have}. Add a Pool with tag={tag!r} in {source} "
                f"(or start workers with --resources '{tag}=1')")
        if best < amount:
            raise ResourceTagError(
                f"{needed_by} asks for {amount} of {tag!r} per task but the largest worker "
                f"has {best}; raise that pool's slots in {source}")


_NANNY = None


def worker_nanny():
    """Dask's ``Nanny`` whose worker processes start with ``MALLOC_MMAP_THRESHOLD_`` set
    (``MMAP_THRESHOLD``, unless the environment or ``distributed.nanny.pre-spawn-environ``
    names one): glibc reads it only at process start, so it goes in the pre-spawn
    environment, as Dask's own ``MALLOC_TRIM_THRESHOLD_`` does."""
    global _NANNY
    if _NANNY is None:
        import dask
        from distributed import Nanny

        class WorkerNanny(Nanny):
            def __init__(self, *args, **kwargs):
                key = "distributed.nanny.pre-spawn-environ"
                env = dict(dask.config.get(key, default={}) or {})
                env.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
                with dask.config.set({key: env}):
                    super().__init__(*args, **kwargs)

        _NANNY = WorkerNanny
    return _NANNY


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where the
    platform has none)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def set_worker_threads(threads: int | None) -> None:
    """Limit torch/OMP threads in the current process (each actor calls this)."""
    if not threads:
        return
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(threads))
