"""What the cluster simulator consumes and produces: ``SimConfig`` in, ``SimResult`` out.

A ``SimConfig`` is plain data: a cluster (``ClusterSpec``: inference GPU pools by tag
with GPU type, count and tensor parallelism; CPU env pools with slots; a dedicated or
elastic reward pool; the trainer's GPUs), a rollart ``Graph`` (tasks with their
affinities, mode, alpha, groups_per_step, group_size, redundancy, backup_after), the
shape of each task's trajectories (``TaskShape``: turns and tokens, which the runtime
learns by running the env), the cost bundle (``rollart.sim.costs.Costs``, S2's), a seed
and the number of trainer steps. ``rollart.sim.cluster.simulate`` turns it into a
``SimResult``. ``ClusterSpec.from_resources`` reads a rollart ``Resources``
(``rollart.load_resources``) where it has the counts; ``ClusterSpec.from_dict`` an
explicit description.

Nothing here runs anything; ``benchmarks/cluster_sim.py``, ``rollart.sim.paper`` and the
tests build these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollart.types import CPU_ENV, REWARD

RESULT_FIELDS = ("sim_time_s", "steps", "trained", "throughput", "utilisation",
                 "staleness", "aborts", "control", "sim_wall_s")


class SimConfigError(ValueError):
    """A simulator configuration that cannot run; the message says what to change."""


@dataclass(frozen=True)
class GPUPool:
    """``count`` GPUs of type ``gpu`` (a key of ``rollart.sim.costs.GPUS``) carrying the
    inference tag ``tag``; one simulated inference worker per ``tp`` GPUs, each batching
    up to ``max_batch`` requests continuously."""

    tag: str
    gpu: str
    count: int
    tp: int = 1
    max_batch: int = 256

    def __post_init__(self):
        if self.count < 0 or self.tp < 1 or self.max_batch < 1:
            raise SimConfigError(f"GPUPool {self.tag!r}: count must be ≥ 0, tp and "
                                 f"max_batch ≥ 1 (got {self.count}, {self.tp}, "
                                 f"{self.max_batch})")
        if self.count % self.tp:
            raise SimConfigError(f"GPUPool {self.tag!r}: count {self.count} is not a "
                                 f"multiple of tp {self.tp}; make it one")

    @property
    def workers(self) -> int:
        return self.count // self.tp


@dataclass(frozen=True)
class EnvPool:
    """A CPU env pool: at most ``slots`` environments (trajectories) live at once, as an
    ``EnvManager``'s ``max_concurrency`` bounds them, over ``managers`` env managers
    (each with its own copy of the router, as each runtime manager has its own
    ``LLMProxy``; ``None``: ``ceil(slots / Rollout.env_concurrency)``, one manager per
    ``env_concurrency`` slots as the runtime places them)."""

    tag: str = CPU_ENV
    slots: int = 256
    managers: int | None = None


@dataclass(frozen=True)
class RewardPool:
    """Where rewards run. ``dedicated``: ``workers`` always held (e.g. reward GPUs);
    ``elastic``: scales between 0 and ``max_workers`` by ``rollart.policy.scaling``,
    each new worker a cold start (``RewardCost``), retired after ``idle_timeout`` s."""

    kind: str = "dedicated"
    workers: int = 1
    max_workers: int = 64
    threads: int = 1
    idle_timeout: float = 10.0
    tag: str = REWARD

    def __post_init__(self):
        if self.kind not in ("dedicated", "elastic"):
            raise SimConfigError(f"RewardPool.kind must be 'dedicated' or 'elastic', got "
                                 f"{self.kind!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """The simulated hardware: inference pools, env pools, reward pool, trainer."""

    inference: tuple[GPUPool, ...]
    env: tuple[EnvPool, ...] = (EnvPool(),)
    reward: RewardPool = field(default_factory=RewardPool)
    trainer_gpus: int = 8
    trainer_gpu: str = "H800"

    def __post_init__(self):
        if not any(p.workers for p in self.inference):
            raise SimConfigError("ClusterSpec needs at least one inference GPUPool with "
                                 "count ≥ tp")
        tags = [p.tag for p in self.inference]
        if len(set(tags)) != len(tags):
            raise SimConfigError(f"ClusterSpec: inference pool tags repeat: {tags}")

    @property
    def gpus(self) -> int:
        """Every GPU: inference + trainer (+ a dedicated reward pool's workers)."""
        reward = self.reward.workers if self.reward.kind == "dedicated" else 0
        return sum(p.count for p in self.inference) + self.trainer_gpus + reward

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterSpec":
        """``{"inference": {tag: {"gpu", "count", "tp"?, "max_batch"?}}, "env": {tag:
        slots}, "reward": {...RewardPool}, "trainer_gpus": n, "trainer_gpu": name}``."""
        inf = tuple(GPUPool(tag, **spec) for tag, spec in d["inference"].items())
        env = tuple(EnvPool(tag, int(s)) for tag, s in d.get("env", {CPU_ENV: 256}).items())
        return cls(inf, env, RewardPool(**d.get("reward", {})),
                   int(d.get("trainer_gpus", 8)), d.get("trainer_gpu", "H800"))

    @classmethod
    def from_resources(cls, resources, gpus: dict[str, str] | None = None,
                       env_slots: int | None = None, **overrides) -> "ClusterSpec":
        """From a rollart ``Resources``: each GPU pool's tag and worker count (a worker =
        one GPU; ``gpus`` maps a tag to its GPU type, default the tag's own name), env
        pools' workers × slots × ``env_slots`` (default each worker's threads × 32),
        the reward pool's workers, the trainer pool's GPUs (``Pool.gpus`` per worker)."""
        gpus = dict(gpus or {})
        inf, env, reward, trainer = [], [], RewardPool(), 0
        for pool in resources.pools:
            if pool.kind in ("compute_gpu", "bandwidth_gpu"):
                inf.append(GPUPool(pool.tag, gpus.get(pool.tag, pool.tag), pool.workers))
            elif pool.kind == "cpu_env":
                per = env_slots if env_slots is not None else pool.threads * 32
                env.append(EnvPool(pool.tag, pool.workers * per))
                for tag in pool.extra_tags:  # a laptop: inference tags on the env worker
                    if tag in gpus and all(p.tag != tag for p in inf):
                        inf.append(GPUPool(tag, gpus[tag], pool.workers))
            elif pool.kind == "reward":
                reward = RewardPool("dedicated", pool.workers * pool.threads)
            elif pool.kind == "trainer":  # a worker per rank: its GPUs (one if undeclared)
                trainer += pool.workers * max(pool.gpus, 1)
        if not inf:
            raise SimConfigError(f"{resources.source} declares no GPU pool (kind "
                                 "compute_gpu/bandwidth_gpu); pass gpus={tag: type} for "
                                 "inference tags carried as extra tags, or use from_dict")
        return cls(tuple(inf), tuple(env) or (EnvPool(),), reward, max(trainer, 1),
                   **overrides)


@dataclass(frozen=True)
class TaskShape:
    """How one task's trajectories look to the cluster (the env decides this at run
    time): ``turns`` per trajectory, the first prompt's tokens, each later observation's
    tokens, tokens generated per turn (mean; exponential spread when ``spread`` > 0),
    and the env cost profile (a key of the bundle's env profiles, or ``None`` for the
    bundle's default). ``episodes``: measured ``(turns, tokens generated per turn)`` of
    real trajectories (``rollart.sim.measure.measure_shapes``); when given, each member
    draws one of them (its length and its generations' mean) in place of ``turns`` and
    ``response_tokens``, so episode lengths vary as the env and policy made them."""

    turns: int = 5
    prompt_tokens: int = 512
    obs_tokens: int = 128
    response_tokens: int = 256
    spread: float = 0.0
    env: str | None = None
    episodes: tuple = ()

    def draw(self, rng) -> tuple[int, float]:
        """One member's ``(turns, mean tokens generated per turn)``."""
        if self.episodes:
            turns, out = self.episodes[rng.randrange(len(self.episodes))]
            return max(1, int(turns)), float(out)
        return self.turns, float(self.response_tokens)


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. ``mode`` overrides ``graph.mode`` (the graph validates only
    the modes its runtime knows); ``shapes`` maps task names to ``TaskShape`` (missing:
    ``TaskShape()``); ``costs`` is a ``rollart.sim.costs.Costs`` (default: its
    defaults for the Qwen3-8B model); ``record`` keeps per-request routing decisions
    in the result (tests)."""

    cluster: ClusterSpec
    graph: Any  # rollart.Graph
    costs: Any = None  # rollart.sim.costs.Costs
    shapes: dict = field(default_factory=dict)
    seed: int = 0
    steps: int = 3
    mode: str | None = None
    timeline_dt: float | None = None  # utilisation sample period (None: sim time / 200)
    record: bool = False
    # async: groups in flight or buffered (None: the runtime's rollart.policy.admission.slot_capacity)
    slot_capacity: int | None = None
    max_sim_s: float = 1e7  # stop if simulated time passes this (a stalled config)

    @property
    def run_mode(self) -> str:
        return self.mode or self.graph.mode

    def shape(self, task: str) -> TaskShape:
        return self.shapes.get(task, TaskShape())


@dataclass
class SimResult:
    """What a simulated run measured.

    ``throughput``: ``{"trajectories_s", "tokens_s", "steps_s"}`` over the simulated
    time; ``utilisation``: busy fraction per pool (inference tags, ``reward``,
    ``trainer``, env tags: live envs / slots); ``timeline``: ``{pool: [(t, busy)]}``;
    ``staleness``: ``{trainer version - oldest token version: trajectories trained}``;
    ``aborts``: aborted / cancelled / failed / dropped members; ``control``: Dask
    control-plane messages and the scheduler's / driver's busy fraction
    (``ControlPlane`` costs) and the cluster size where one scheduler saturates;
    ``decisions``: ``[(task, pool tag, phase)]`` per routed request when ``record``.
    """

    mode: str
    sim_time_s: float
    steps: int
    trained: int
    throughput: dict
    utilisation: dict
    timeline: dict
    staleness: dict
    aborts: dict
    control: dict
    sim_wall_s: float
    step_times: list = field(default_factory=list)
    gpus: int = 0
    decisions: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def summary(self) -> str:
        util = " ".join(f"{k}={v:.2f}" for k, v in sorted(self.utilisation.items()))
        return (f"mode={self.mode} steps={self.steps} sim_time={self.sim_time_s:.1f}s "
                f"traj/s={self.throughput['trajectories_s']:.2f} util[{util}] "
                f"aborts={self.aborts.get('aborted', 0)} wall={self.sim_wall_s:.1f}s")
