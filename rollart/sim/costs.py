"""Cost models of the cluster simulator: how long each stage takes, as plain data.

Consumes nothing from Dask or torch; produces frozen dataclasses that the simulator
(``rollart.sim.cluster``) asks for durations: ``GenCost`` (prefill and decode step of a
model on a GPU type, from a roofline), ``EnvCost`` (reset/step latency draws, failures,
CPU share), ``RewardCost`` (per call; dedicated vs elastic with cold starts),
``TrainCost`` (a trainer step from 6·params·tokens FLOPs), ``WeightSync`` (push/pull over
TCP or RDMA), ``ControlPlane`` (Dask per-message costs) and ``Costs``, the bundle. The
``cpu`` GPU entry, the laptop's ``GenCost``/``TrainCost`` and the control-plane figures
come from ``rollart.sim.measure`` (measured on this machine); ``rollart.sim.paper``
builds the paper's experiments from the rest.

Assumptions (every figure here is either a public datasheet number or stated as ours):

* GPUs: dense BF16 tensor-core FLOP/s and HBM bandwidth from NVIDIA's datasheets.
  H100 SXM5: 989 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3, 80 GB
  (NVIDIA H100 datasheet). H800 SXM: the export variant of H100 SXM with the same
  compute and HBM (NVLink cut to 400 GB/s): 989 TFLOP/s, 3.35 TB/s, 80 GB. H20: 148
  TFLOP/s dense BF16, 4.0 TB/s HBM3, 96 GB (NVIDIA H20 product brief).
* Roofline efficiencies are ours: prefill runs at MFU 0.5 of peak (large-batch GEMMs in
  vLLM/SGLang reach 40–60%); decode at MBU 0.7 of HBM bandwidth (paged-attention
  decode kernels reach 60–80%); training at MFU 0.4 (Megatron on H800 reaches 35–45%
  for 8–32B dense models). Tensor parallelism divides work over ``tp`` GPUs at an
  efficiency of 0.9 per doubling (all-reduce cost).
* Env shapes follow the paper's §3 characterisation: heavy-tailed (lognormal,
  Pareto) step latency, container start-up (``env.reset``) of tens of seconds that
  dominates when envs fail (a failed step costs a fresh reset), about one failure per
  ten steps in the sandbox profiles. Medians and tails are ours (the paper shows
  shapes, not tables).
* Weight sync: the paper's Table 3 rates were not available here; we assume Mooncake
  over RDMA at 12.5 GB/s per pulling node (one 100 Gb/s effective path) and plain TCP
  at 1.25 GB/s, plus a fixed per-transfer latency. The paper's exposed pull for
  Qwen3-8B / 14B / 32B is 1.4 / 5.1 / 9.6 s; ``rollart.sim.paper`` prints ours beside.
  That rate is one path per GPU, each way (``WeightSync.pull_s`` has a TP-``t`` worker
  pull ``1/t`` per GPU in parallel): HGX/DGX H100-class nodes carry one ConnectX-7
  400 Gb/s NIC per GPU for the compute fabric (NVIDIA DGX H100 user guide), of which
  we assume a quarter effective (ours). A trainer rank (one GPU) has one path; the
  ``store`` path's store node has ``store_paths`` = 1 (one 100 Gb/s effective node,
  the 55-min-a-version figure of docs/benchmarks/cluster-sim.md); buckets are
  ``rollart.trainer.gang.TrainerGang``'s default 256 MiB. ``rollart.sim.fanout`` turns
  these into each version's distribution.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Mapping

from rollart.chaos.faults import Latency, straggler_profile
from rollart.sim.hardware import GPUS, MODELS, GPUSpec, ModelSpec, _fraction, _positive

__all__ = [
    "Costs", "ControlPlane", "EnvCost", "GPUS", "GPUSpec", "GenCost", "MODELS",
    "ModelSpec", "RewardCost", "TrainCost", "WeightSync", "ENV_PROFILES",
    "laptop_env",
]

TP_EFFICIENCY = 0.9  # per doubling of tensor parallelism (ours)


# -- generation ------------------------------------------------------------------------
@dataclass(frozen=True)
class GenCost:
    """Prefill and decode time of ``model`` on ``gpu`` with tensor parallelism ``tp``.

    Prefill is compute-bound: ``(2·params·new + 4·layers·attn_width·new·(cached +
    new/2)) / (tp_flops·mfu)``, never under one read of the weights; a prefix-cache hit
    removes the cached tokens' share (they are read as KV, not recomputed). Decode is
    memory-bound at small batch: one step reads the weights once for the whole batch
    plus every row's KV, ``(weight_bytes + kv_bytes·context) / (tp_hbm·mbu)``, and turns
    compute-bound when ``2·params·batch / (tp_flops·mfu)`` is larger. ``step_overhead_s``
    and ``row_overhead_s`` (0 for GPUs; measured for the CPU engine, whose tiny model is
    bound by Python, not arithmetic) add a fixed and a per-row cost per forward;
    ``request_overhead_s`` (0 for GPUs; measured in situ for the CPU engine by
    ``rollart.sim.calibrate.in_situ_engine``) a fixed cost per request the worker admits
    (its serving loop: queueing, sampling set-up, stop checks, the result's hand-off).
    """

    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    mfu: float = 0.5
    mbu: float = 0.7
    step_overhead_s: float = 0.0
    row_overhead_s: float = 0.0
    prefill_token_overhead_s: float = 0.0
    request_overhead_s: float = 0.0

    def __post_init__(self):
        if self.request_overhead_s < 0:
            raise ValueError(f"GenCost.request_overhead_s must be ≥ 0, got "
                             f"{self.request_overhead_s!r}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"GenCost.tp must be an int >= 1, got {self.tp!r}")
        _fraction(self, "mfu", "mbu")
        _positive(self, "mfu", "mbu")

    @property
    def _scale(self) -> float:
        """Effective number of GPUs: tp at TP_EFFICIENCY per doubling."""
        return self.tp * TP_EFFICIENCY ** math.log2(self.tp)

    @property
    def flops_s(self) -> float:
        return self.gpu.flops * self.mfu * self._scale

    @property
    def bytes_s(self) -> float:
        return self.gpu.hbm_bytes_s * self.mbu * self._scale

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0, rows: int = 1) -> float:
        """Seconds to prefill one sequence's ``new_tokens`` after ``cached_tokens`` of
        context already in the prefix cache (``rows`` only counts the per-row overhead;
        a batch of requests: ``prefill_batch_s``, of which this is the one-row case)."""
        if new_tokens <= 0:
            return 0.0
        return self.prefill_batch_s([(new_tokens, cached_tokens)]) + \
            (rows - 1) * self.row_overhead_s

    def prefill_batch_s(self, rows) -> float:
        """Seconds to prefill ``rows`` (``(new_tokens, cached_tokens)`` per request) in one
        batched forward: each row's attention over its own context (``new · (cached +
        new/2)``), not over the batch's tokens as one sequence; one read of the weights
        and of every row's KV; the fixed, per-row and per-token overheads once each."""
        rows = [(int(n), int(c)) for n, c in rows if n > 0]
        if not rows:
            return 0.0
        m = self.model
        new = sum(n for n, _ in rows)
        flops = 2 * m.params * new + \
            4 * m.layers * m.attn_width * sum(n * (c + n / 2) for n, c in rows)
        kv = m.kv_bytes_per_token * sum(n + c for n, c in rows)
        return max(flops / self.flops_s, (m.weight_bytes + kv) / self.bytes_s) + \
            self.step_overhead_s + len(rows) * self.row_overhead_s + \
            new * self.prefill_token_overhead_s

    def decode_step_s(self, batch: int, context_tokens: int = 0) -> float:
        """Seconds for one decode step of ``batch`` rows whose KV caches hold
        ``context_tokens`` tokens in total (summed over the rows)."""
        if batch <= 0:
            return 0.0
        m = self.model
        memory = (m.weight_bytes + m.kv_bytes_per_token * context_tokens) / self.bytes_s
        compute = (2 * m.params * batch + 4 * m.layers * m.attn_width * context_tokens) \
            / self.flops_s
        return max(memory, compute) + self.step_overhead_s + batch * self.row_overhead_s


# -- environments ----------------------------------------------------------------------
@dataclass(frozen=True)
class EnvCost:
    """An env pool's latencies: ``reset`` (container start-up) per episode, ``step`` per
    turn, a step fails with ``fail_prob`` (the env must then be reset and the episode
    retried from its start: reset dominates when envs fail), ``cpu_share`` of a step's
    latency holds a CPU slot (the rest is waiting on I/O: tool calls, remote sandboxes).
    """

    name: str
    reset: Latency
    step: Latency
    fail_prob: float = 0.0
    cpu_share: float = 0.2

    def __post_init__(self):
        _fraction(self, "fail_prob", "cpu_share")

    def sample_reset(self, rng: random.Random) -> float:
        return self.reset.sample(rng)

    def sample_step(self, rng: random.Random) -> tuple[float, bool]:
        """(latency seconds, failed) of one step."""
        failed = rng.random() < self.fail_prob
        return self.step.sample(rng), failed

    def release(self) -> None:
        """A trajectory that reset ended (an env pool that keeps state, such as
        ``rollart.sim.sandbox.SandboxPoolCost``, takes its env back; here nothing)."""


# the paper's §3 shapes (medians and tails ours): sandboxed coding/terminal tasks with
# container start-up and ~1 failure in 10 steps; web/search tasks waiting on remote
# services; light game envs
ENV_PROFILES: dict[str, EnvCost] = {
    "sandbox": EnvCost(
        "sandbox", reset=Latency("lognormal", seconds=30.0, sigma=0.8, cap=600.0),
        step=Latency("lognormal", seconds=2.0, sigma=1.2, cap=300.0),
        fail_prob=0.1, cpu_share=0.3),
    "web": EnvCost(
        "web", reset=Latency("lognormal", seconds=5.0, sigma=0.7, cap=120.0),
        step=Latency("pareto", seconds=1.0, shape=1.5, cap=120.0),
        fail_prob=0.05, cpu_share=0.05),
    "game": EnvCost(
        "game", reset=Latency("lognormal", seconds=0.5, sigma=0.5, cap=10.0),
        step=Latency("lognormal", seconds=0.1, sigma=0.8, cap=10.0),
        fail_prob=0.01, cpu_share=0.8),
}


def laptop_env(seed: int = 0) -> EnvCost:
    """The pipeline benchmark's env profile (``rollart.chaos.faults.straggler_profile``):
    Pareto start-up at an env instance's first reset (every trajectory makes its own
    instance, ``rollart.env.trajectory``, so every trajectory pays it), lognormal step
    latency, no failures; the latency is ``asyncio.sleep`` (no CPU held)."""
    f = straggler_profile(seed=seed)
    return EnvCost("laptop", reset=f.startup, step=f.step, fail_prob=f.fail_prob,
                   cpu_share=0.0)


# -- reward, trainer, weights, control plane --------------------------------------------
@dataclass(frozen=True)
class RewardCost:
    """A reward call: ``call`` seconds on a warm worker. ``elastic``: the serverless
    pool (``rollart.reward.elastic``) starts workers on demand, each start costing
    ``cold_start_s``, and retires one idle for ``idle_timeout_s``, up to
    ``max_workers``; dedicated: ``workers`` always on (and paid for)."""

    call: Latency = Latency("lognormal", seconds=0.5, sigma=0.5)
    elastic: bool = False
    workers: int = 1
    max_workers: int = 64
    cold_start_s: float = 5.0
    idle_timeout_s: float = 30.0

    def sample_call(self, rng: random.Random) -> float:
        return self.call.sample(rng)


@dataclass(frozen=True)
class TrainCost:
    """A trainer step: ``6·params·tokens`` FLOPs (forward + backward) over ``gpus`` GPUs
    at ``mfu``, plus ``overhead_s`` (optimizer step, data loading) per step."""

    model: ModelSpec
    gpu: GPUSpec
    gpus: int = 8
    mfu: float = 0.4
    overhead_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"TrainCost.gpus must be an int >= 1, got {self.gpus!r}")
        _fraction(self, "mfu")
        _positive(self, "mfu")

    def step_s(self, tokens: int) -> float:
        return 6 * self.model.params * tokens / (self.gpu.flops * self.mfu * self.gpus) \
            + self.overhead_s


@dataclass(frozen=True)
class WeightSync:
    """Weights from the trainer to the inference workers through the versioned store.

    ``push_s``: the trainer writes one copy; ``pull_s``: one inference instance alone
    reads its shard (``tp`` GPUs pull ``1/tp`` each, in parallel), over ``transport``.
    ``prefetch``: pulls overlap generation (rollart's workers watch the store), so only
    ``exposed_pull_s`` (pull minus the overlap available) stalls decoding; the in-engine
    load (``load_s``, an HBM copy; the engine loads bucket by bucket, each bucket's
    ``1/tp`` per GPU, ``load_s`` in all) is always exposed: the pull is prefetched in
    the background, the load happens at the suspend point.

    ``path`` says how a version reaches many workers at once (``rollart.sim.fanout``):
    ``relay`` (default: the trainer gang's ranks each serve their ``bucket_bytes``
    buckets, pullers relay buckets to each other; ``publish_s``: each rank writes its
    share) or ``store`` (one store node with ``store_paths`` links serves every worker a
    whole copy: pulls share its links; ``publish_s`` = ``push_s``). Every link, a GPU's
    or the store node's, carries ``bytes_s`` each way.
    """

    transport: str = "rdma"
    rdma_bytes_s: float = 12.5e9  # ours: one 100 Gb/s effective path per node (GPU)
    tcp_bytes_s: float = 1.25e9  # ours: 10 Gb/s effective
    latency_s: float = 0.05
    prefetch: bool = True
    path: str = "relay"
    bucket_bytes: float = 256 * 2 ** 20  # rollart.trainer.gang.TrainerGang's default
    store_paths: int = 1  # the store node: one 100 Gb/s effective path, as a puller's

    def __post_init__(self):
        if self.transport not in ("rdma", "tcp"):
            raise ValueError(f"WeightSync.transport must be 'rdma' or 'tcp', got "
                             f"{self.transport!r}")
        if self.path not in ("relay", "store"):
            raise ValueError(f"WeightSync.path must be 'relay' (the trainer gang's buckets, "
                             f"relayed among pullers) or 'store' (one store node), got "
                             f"{self.path!r}")
        if not isinstance(self.store_paths, int) or self.store_paths < 1:
            raise ValueError(f"WeightSync.store_paths must be an int ≥ 1, got "
                             f"{self.store_paths!r}")
        _positive(self, "rdma_bytes_s", "tcp_bytes_s", "bucket_bytes")

    @property
    def bytes_s(self) -> float:
        return self.rdma_bytes_s if self.transport == "rdma" else self.tcp_bytes_s

    def push_s(self, model: ModelSpec) -> float:
        return self.latency_s + model.weight_bytes / self.bytes_s

    def pull_s(self, model: ModelSpec, tp: int = 1) -> float:
        return self.latency_s + model.weight_bytes / tp / self.bytes_s

    def publish_s(self, model: ModelSpec, ranks: int = 1) -> float:
        """The trainer's side of a version: ``store``: one copy written to the store
        (``push_s``); ``relay``: each of ``ranks`` ranks writes its buckets (bucket ``k``
        by rank ``k mod ranks``) at its link's rate, in parallel."""
        if self.path == "store":
            return self.push_s(model)
        from rollart.sim.fanout import bucket_count

        buckets = bucket_count(model.weight_bytes, self.bucket_bytes)
        per_rank = math.ceil(buckets / min(max(int(ranks), 1), buckets))
        return self.latency_s + per_rank * model.weight_bytes / buckets / self.bytes_s

    def load_s(self, model: ModelSpec, gpu: GPUSpec, tp: int = 1) -> float:
        return model.weight_bytes / tp / gpu.hbm_bytes_s

    def exposed_pull_s(self, model: ModelSpec, gpu: GPUSpec, tp: int = 1,
                       overlap_s: float = 0.0) -> float:
        hidden = overlap_s if self.prefetch else 0.0
        return max(0.0, self.pull_s(model, tp) - hidden) + self.load_s(model, gpu, tp)


@dataclass(frozen=True)
class ControlPlane:
    """Dask's per-message costs: an actor method round trip (worker to worker, no
    scheduler), a scheduler task round trip (submit → run → result), and the scheduler's
    capacity in tasks/s (one process, one event loop). Defaults: measured on this
    machine by ``rollart.sim.measure.measure_control_plane`` (2 loaded cores).

    The simulator charges each message's round trip as latency on the path that waits
    for it (``rollart.sim.cluster``): ``actor_call_s`` per generation request (PD: the
    prefill, the KV fetch and the decode call), per group's acquire, per trajectory's
    buffer put, per trainer get_table / mark_trained and per driver call the trainer or
    the weight wait sits on; ``task_s`` per reward run as a Dask task. ``near``: the env
    managers call the inference workers in their own process (``rollart.runtime.near``, as
    ``resources/laptop.py`` places them), so a generation request is a local call and
    costs no round trip, and a turn's Python on a manager's loop pauses those workers'
    engines as long (one process, one GIL: ``Costs.manager_turn_s``)."""

    actor_call_s: float = 1.1e-3
    task_s: float = 11e-3
    scheduler_tasks_s: float = 400.0
    msgs_per_task: int = 7
    near: bool = False

    def __post_init__(self):
        _positive(self, "actor_call_s", "task_s", "scheduler_tasks_s", "msgs_per_task")

    @property
    def generate_s(self) -> float:
        """A generation request's round trip (0 when the call is ``near``)."""
        return 0.0 if self.near else self.actor_call_s

    def scheduler_load(self, tasks_per_s: float) -> float:
        """Share of the scheduler's capacity that ``tasks_per_s`` uses (1 = saturated)."""
        return tasks_per_s / self.scheduler_tasks_s


@dataclass(frozen=True)
class Costs:
    """Everything the simulator asks for, with the model being trained.

    ``gen_for(gpu, tp, tag)``: the ``GenCost`` of an inference worker (an entry of
    ``gen`` keyed by pool tag or GPU name, with its ``tp`` replaced, else the roofline of
    ``model`` on ``gpus[gpu]`` at ``mfu``/``mbu``); ``env_for(profile)``: an entry of
    ``env`` (``None`` or unknown: the ``"*"`` default); ``train_for(gpu, gpus)``:
    ``train`` if set, else 6·params·tokens on those GPUs at ``train_mfu``. Task lengths
    are not costs: they live in ``rollart.sim.config.TaskShape``.
    """

    model: ModelSpec = MODELS["Qwen3-8B"]
    gpus: Mapping[str, GPUSpec] = field(default_factory=lambda: dict(GPUS))
    gen: Mapping[str, GenCost] = field(default_factory=dict)
    mfu: float = 0.5
    mbu: float = 0.7
    env: Mapping[str, EnvCost] = field(
        default_factory=lambda: {"*": ENV_PROFILES["sandbox"], **ENV_PROFILES})
    reward: RewardCost = field(default_factory=RewardCost)
    train: TrainCost | None = None
    train_mfu: float = 0.4
    weights: WeightSync = field(default_factory=WeightSync)
    control: ControlPlane = field(default_factory=ControlPlane)
    # CPU seconds each turn holds its env manager's event loop (one asyncio loop per
    # manager, shared by all its trajectories: prompt building, tokenising, bookkeeping);
    # measured on this laptop by rollart.sim.measure.measure_turn_overhead; 0: not charged
    manager_turn_s: float = 0.0

    def __post_init__(self):
        if self.manager_turn_s < 0:
            raise ValueError(f"Costs.manager_turn_s must be ≥ 0 (got {self.manager_turn_s})")

    def gen_for(self, gpu: str, tp: int = 1, tag: str | None = None) -> GenCost:
        for key in (tag, gpu):
            if key is not None and key in self.gen:
                g = self.gen[key]
                return g if g.tp == tp else replace(g, tp=tp)
        return GenCost(self.model, self._gpu(gpu), tp, mfu=self.mfu, mbu=self.mbu)

    def env_for(self, profile: str | None = None) -> EnvCost:
        if profile is not None and profile in self.env:
            return self.env[profile]
        if "*" in self.env:
            return self.env["*"]
        raise KeyError(f"Costs.env has no profile {profile!r} and no '*' default; add "
                       f"one (known: {sorted(self.env)})")

    def train_for(self, gpu: str = "H800", gpus: int = 8) -> TrainCost:
        if self.train is not None:
            return self.train
        return TrainCost(self.model, self._gpu(gpu), gpus, mfu=self.train_mfu)

    def _gpu(self, name: str) -> GPUSpec:
        if name not in self.gpus:
            raise KeyError(f"unknown GPU type {name!r}: use one of {sorted(self.gpus)} "
                           f"or add a GPUSpec to Costs.gpus")
        return self.gpus[name]

    def with_(self, **changes) -> "Costs":
        return replace(self, **changes)
