"""The RollArt paper's experiments as simulator configurations, each beside the paper's figure.

Consumes ``rollart.sim.config`` (``SimConfig``/``ClusterSpec``), the cost models of
``rollart.sim.costs`` and rollart's own ``Graph``/``Task``/``Affinity``; produces
``Experiment`` records (configs + how to turn their ``SimResult`` s into the figure the
paper prints) and ``run``/``run_all``, which simulate them through
``rollart.sim.simulate``. Called by ``benchmarks/cluster_sim.py`` and tests.

What the paper states is used as stated (cluster sizes, GPU types, models, modes, α,
PD splits, the figures); what it does not state is assumed here and said so in each
``Experiment.assumed``. The shared assumptions:

* **Task mix** (four tasks, as the paper's agentic mix of coding, web and game tasks):
  ``swe`` (sandboxed coding: 3k-token prompt, 1.5k-token observations, 300 tokens per
  turn, 10 turns, the ``sandbox`` env profile with ~1 failure per 10 steps), ``web``
  (web shopping/search: 1.5k prompt, 800-token pages, 200 tokens, 8 turns, ``web``),
  ``reason`` (tool-using reasoning: 400 prompt, 200-token tool results, 3k tokens of
  thinking per turn with exponential spread, 2 turns, ``game``-light env) and ``game``
  (Sokoban/FrozenLake-like: 300 prompt, 100 obs, 600 tokens, 6 turns, ``game``).
  ``swe``/``web`` are prefill-heavy (long contexts re-read each turn), ``reason``/``game``
  decode-heavy; with hardware affinity the first go to H800, the others to H20.
* **Parallelism**: TP 1 / 2 / 4 for Qwen3-8B / 14B / 32B on every GPU type.
* **Batch**: GRPO groups of 8, 256 groups per step (2,048 trajectories: async keeps
  ``max(α, 1)`` steps' worth of groups in flight, ~23 per inference worker for 8B on
  88 GPUs), α = 1 unless the experiment varies it.
* **Reward**: rule-based (lognormal, median 50 ms) on 16 dedicated CPU workers, except
  in the serverless experiment (an LLM judge).
* **Trainer**: 32 H800 (the paper's 96 H800 + 32 H20 cluster minus the 64 H800 + 24
  H20 rollout pools, 8 H20 left out), MFU 0.4.

Figures are throughput ratios (trained trajectories per simulated second) unless said.
The workloads were fixed before any run; a figure that misses the paper's range is
reported as it is, with the reason we see (docs/benchmarks/cluster-sim.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

from rollart.policy.affinity import Affinity
from rollart.env.tasks import get_task
from rollart.sim.config import ClusterSpec, EnvPool, GPUPool, RewardPool, SimConfig, TaskShape
from rollart.sim.costs import GPUS, MODELS, Costs, RewardCost, WeightSync
from rollart.chaos.faults import Latency

__all__ = ["Experiment", "MOONCAKE_PAPER", "TASKS", "experiments", "mooncake_pull",
           "run", "run_all", "scale_config", "table"]

MODEL_TP = {"Qwen3-8B": 1, "Qwen3-14B": 2, "Qwen3-32B": 4}
MOONCAKE_PAPER = {"Qwen3-8B": 1.4, "Qwen3-14B": 5.1, "Qwen3-32B": 9.6}  # exposed pull, s
SHAPES = {
    "swe": TaskShape(turns=10, prompt_tokens=3000, obs_tokens=1500, response_tokens=300,
                     env="sandbox"),
    "web": TaskShape(turns=8, prompt_tokens=1500, obs_tokens=800, response_tokens=200,
                     env="web"),
    "reason": TaskShape(turns=2, prompt_tokens=400, obs_tokens=200, response_tokens=3000,
                        spread=1.0, env="game"),
    "game": TaskShape(turns=6, prompt_tokens=300, obs_tokens=100, response_tokens=600,
                      spread=1.0, env="game"),
}
TASKS = tuple(SHAPES)
PREFILL_HEAVY, DECODE_HEAVY = ("swe", "web"), ("reason", "game")


@dataclass(frozen=True)
class Experiment:
    """One of the paper's figures: ``configs`` (label → ``SimConfig``) and ``figure``,
    which maps their results to named values (e.g. one ratio per model); ``paper`` is
    the paper's figure as a (low, high) range (equal ends: one number)."""

    key: str
    title: str
    paper: tuple[float, float]
    configs: dict
    figure: Callable[[dict], dict]
    assumed: str = ""
    unit: str = "×"


# -- building blocks ---------------------------------------------------------------------
def _task(name: str, affinity: Affinity | None):
    """A named task for the simulator: only its name and affinity matter here (the
    simulator never runs an env; lengths and latencies come from ``TaskShape`` and
    ``EnvCost``), so it carries a built-in env it will not call."""
    return replace(get_task("gridnav"), name=name, affinity=affinity)


def _graph(tasks, pools, *, groups: int = 256, group_size: int = 8, alpha: int = 1,
           redundancy: float = 1.0, env_slots: int = 4096, name: str = "paper"):
    from rollart import GRPO, Graph
    from rollart.config.graph import Rollout

    return Graph(name=name, tasks=tuple(tasks),
                 algo=GRPO(group_size=group_size, groups_per_step=groups, alpha=alpha),
                 rollout=Rollout(inference_pools=tuple(pools), env_concurrency=env_slots,
                                 redundancy=redundancy),
                 mode="async")


RULE_REWARD = RewardCost(call=Latency("lognormal", seconds=0.05, sigma=0.5), workers=16)


def _costs(model: str, **changes) -> Costs:
    return Costs(model=MODELS[model], **{"reward": RULE_REWARD, **changes})


def _cluster(pools: dict, *, trainer_gpus: int = 32, env_slots: int = 4096,
             reward: RewardPool | None = None, model: str = "Qwen3-8B") -> ClusterSpec:
    """``pools``: ``{tag: (gpu type, count)}``, TP by the model."""
    tp = MODEL_TP[model]
    inf = tuple(GPUPool(tag, gpu, count, tp=tp) for tag, (gpu, count) in pools.items())
    return ClusterSpec(inf, (EnvPool("CPU_ENV", env_slots),),
                       reward or RewardPool("dedicated", workers=16),
                       trainer_gpus=trainer_gpus, trainer_gpu="H800")


def _config(cluster, graph, model: str, *, steps: int, mode: str | None = None,
            shapes: dict | None = None, seed: int = 0, **cost_changes) -> SimConfig:
    return SimConfig(cluster, graph, costs=_costs(model, **cost_changes),
                     shapes=dict(shapes or SHAPES), seed=seed, steps=steps, mode=mode)


def _tput(result) -> float:
    return result.throughput["trajectories_s"]


@dataclass(frozen=True)
class _Ratio:
    num: str
    den: str

    def __call__(self, results: dict) -> dict:
        out = {}
        for label, r in results.items():
            prefix, _, kind = label.rpartition("/")
            if kind == self.num and f"{prefix}/{self.den}" in results:
                out[prefix] = _tput(r) / _tput(results[f"{prefix}/{self.den}"])
        return out


def _groups(quick: bool) -> int:
    """Groups per step: 256 (2,048 trajectories), 64 in quick runs (2 cores, minutes)."""
    return 64 if quick else 256


def _models(quick: bool) -> tuple[str, ...]:
    return ("Qwen3-8B", "Qwen3-32B") if quick else tuple(MODEL_TP)


# -- the experiments ------------------------------------------------------------------------
def affinity(quick: bool = True, steps: int = 2) -> list[Experiment]:
    """Hardware affinity: 64 H800 + 24 H20 (prefill-heavy tasks on H800, decode-heavy on
    H20) vs 208 H20 and vs 72 H800 running everything (paper: 1.30–1.68× and
    1.12–1.37×)."""
    configs, g = {}, _groups(quick)
    for m in _models(quick):
        routed = [_task(t, Affinity(pools=("H800",))) for t in PREFILL_HEAVY] + \
                 [_task(t, Affinity(pools=("H20",))) for t in DECODE_HEAVY]
        hetero = _cluster({"H800": ("H800", 64), "H20": ("H20", 24)}, model=m)
        configs[f"{m}/hetero"] = _config(hetero, _graph(routed, ("H800", "H20"), groups=g), m,
                                         steps=steps)
        for gpu, n in (("H20", 208), ("H800", 72)):
            plain = [_task(t, None) for t in TASKS]
            configs[f"{m}/{gpu}"] = _config(_cluster({gpu: (gpu, n)}, model=m),
                                            _graph(plain, (gpu,), groups=g), m, steps=steps)
    note = ("cost-equal clusters as the paper pairs them; tasks routed by their measured "
            "shape (prefill-heavy → H800); async, α = 1")
    return [Experiment("affinity_vs_h20", "affinity: 64 H800 + 24 H20 vs 208 H20",
                       (1.30, 1.68), configs, _Ratio("hetero", "H20"), note),
            Experiment("affinity_vs_h800", "affinity: 64 H800 + 24 H20 vs 72 H800",
                       (1.12, 1.37), configs, _Ratio("hetero", "H800"), note)]


def modes(quick: bool = True, steps: int = 3) -> list[Experiment]:
    """rollart's async vs Sync (2.65–4.58×) and Sync+ vs Sync (1.40–2.40×) on the
    paper's 96 H800 + 32 H20 cluster (64 H800 + 24 H20 rollout, 32 H800 trainer)."""
    configs, g = {}, _groups(quick)
    for m in _models(quick):
        routed = [_task(t, Affinity(pools=("H800",))) for t in PREFILL_HEAVY] + \
                 [_task(t, Affinity(pools=("H20",))) for t in DECODE_HEAVY]
        cluster = _cluster({"H800": ("H800", 64), "H20": ("H20", 24)}, model=m)
        for mode in ("sync", "sync+", "async"):
            configs[f"{m}/{mode}"] = _config(cluster, _graph(routed, ("H800", "H20"), groups=g), m,
                                             steps=steps, mode=mode)
    note = ("Sync: a barrier at every turn and training after rollout; Sync+: "
            "trajectory-level env interaction, rollout paused while training and "
            "syncing; async: α = 1. Same cluster, tasks, affinity")
    return [Experiment("async_vs_sync", "async vs Sync", (2.65, 4.58), configs,
                       _Ratio("async", "sync"), note),
            Experiment("syncplus_vs_sync", "Sync+ vs Sync", (1.40, 2.40), configs,
                       _Ratio("sync+", "sync"), note)]


def env_interaction(quick: bool = True, steps: int = 2) -> list[Experiment]:
    """Trajectory-level vs batched env interaction under injected env latency (paper:
    1.23–2.27×): ``sync+`` (each trajectory steps its env on its own) vs ``sync`` (a
    barrier per turn), both training after rollout, with lognormal step latency of
    median 1 / 4 / 16 s (σ = 1) injected into the ``game`` task mix."""
    from rollart.sim.costs import EnvCost

    configs, g = {}, _groups(quick)
    medians = (1.0, 4.0) if quick else (1.0, 4.0, 16.0)
    shapes = {t: replace(SHAPES[t], env="injected") for t in TASKS}
    for med in medians:
        env = EnvCost("injected", reset=Latency("fixed", seconds=1.0),
                      step=Latency("lognormal", seconds=med, sigma=1.0, cap=60 * med),
                      cpu_share=0.05)
        for mode in ("sync", "sync+"):
            tasks = [_task(t, None) for t in TASKS]
            configs[f"{med:g}s/{mode}"] = _config(
                _cluster({"H20": ("H20", 64)}), _graph(tasks, ("H20",), groups=g), "Qwen3-8B",
                steps=steps, mode=mode, shapes=shapes, env={"*": env, "injected": env})
    return [Experiment("traj_vs_batched", "trajectory-level vs batched env interaction",
                       (1.23, 2.27), configs, _Ratio("sync+", "sync"),
                       "64 H20, Qwen3-8B, all four tasks on one pool; injected step "
                       "latency medians are ours")]


def redundancy(quick: bool = True, steps: int = 3) -> list[Experiment]:
    """Redundant environments (paper: up to 1.62×): async with 1.25× / 1.5× / 2× members
    per group (the fastest ``group_size`` kept) vs none, on the sandbox-heavy mix."""
    configs, g = {}, _groups(quick)
    factors = (1.0, 1.5) if quick else (1.0, 1.25, 1.5, 2.0)
    tasks = [_task(t, None) for t in TASKS]
    for f in factors:
        configs[f"x/r{f:g}"] = _config(_cluster({"H20": ("H20", 64)}),
                                       _graph(tasks, ("H20",), redundancy=f, groups=g), "Qwen3-8B",
                                       steps=steps)
    figure = _Best([f"r{f:g}" for f in factors[1:]], "r1")
    return [Experiment("redundancy_gain", "redundant envs vs none", (1.0, 1.62), configs,
                       figure, "64 H20, Qwen3-8B; the best factor's gain is reported")]


@dataclass(frozen=True)
class _Best:
    """The largest ratio of any ``nums`` over ``den`` (per prefix), and each one."""

    nums: list
    den: str

    def __call__(self, results: dict) -> dict:
        out = {}
        for num in self.nums:
            for prefix, v in _Ratio(num, self.den)(results).items():
                out[f"{prefix}/{num}"] = v
        return out


def alpha(quick: bool = True, steps: int = 4) -> list[Experiment]:
    """The staleness bound α from 1 to 6 (paper: up to 1.22×): async throughput at each
    α over α = 1."""
    configs, g = {}, _groups(quick)
    alphas = (1, 2, 6) if quick else (1, 2, 3, 4, 5, 6)
    routed = [_task(t, Affinity(pools=("H800",))) for t in PREFILL_HEAVY] + \
             [_task(t, Affinity(pools=("H20",))) for t in DECODE_HEAVY]
    fixed = {}
    for a in alphas:
        configs[f"x/a{a}"] = _config(_cluster({"H800": ("H800", 64), "H20": ("H20", 24)}),
                                     _graph(routed, ("H800", "H20"), alpha=a, groups=g), "Qwen3-8B",
                                     steps=steps)
        # α as a staleness bound only: the groups in flight or buffered held at two
        # steps' worth for every α (what α = 1 needs to roll the next batch out while
        # the trainer steps), where rollart's slot rule grows them with α
        fixed[f"x/a{a}"] = replace(configs[f"x/a{a}"], slot_capacity=2 * g)
    best = _Best([f"a{a}" for a in alphas[1:]], "a1")
    return [Experiment("alpha_gain", "α = 6 vs α = 1", (1.0, 1.22), configs, best,
                       "the modes experiment's cluster, Qwen3-8B; rollart's slots: "
                       "max(α, 1) steps' worth of groups"),
            Experiment("alpha_gain_fixed_slots", "α = 6 vs α = 1, slots fixed", (1.0, 1.22),
                       fixed, best, "as above, slots fixed at 2 steps' worth of groups "
                       "for every α (α bounds staleness only)")]


def pd(quick: bool = True, steps: int = 2) -> list[Experiment]:
    """Prefill-decode disaggregation in units of 4 H800 (paper: 1.03–1.21×): 1P3D and
    2P2D (prefill on P, decode on D, KV moved) vs the same GPUs serving whole requests,
    on the prefill-heavy tasks (long multi-turn contexts)."""
    configs, g = {}, _groups(quick)
    units = 8  # 32 H800
    tasks = PREFILL_HEAVY + ("game",)
    shapes = {t: SHAPES[t] for t in tasks}
    for p, d in ((1, 3), (2, 2)):
        pd_tasks = [_task(t, Affinity(prefill="P", decode="D")) for t in tasks]
        cluster = _cluster({"P": ("H800", p * units), "D": ("H800", d * units)})
        configs[f"{p}P{d}D/pd"] = _config(cluster, _graph(pd_tasks, ("P", "D"), groups=g),
                                          "Qwen3-8B", steps=steps, shapes=shapes)
        plain = [_task(t, None) for t in tasks]
        configs[f"{p}P{d}D/colo"] = _config(
            _cluster({"H800": ("H800", (p + d) * units)}), _graph(plain, ("H800",), groups=g),
            "Qwen3-8B", steps=steps, shapes=shapes)
    return [Experiment("pd_gain", "PD 1P3D / 2P2D vs colocated", (1.03, 1.21), configs,
                       _Ratio("pd", "colo"), "32 H800, Qwen3-8B, swe + web + game")]


def serverless(quick: bool = True, steps: int = 3) -> list[Experiment]:
    """Reward utilisation (paper: 6% on dedicated reward GPUs → 88% serverless): an LLM
    judge reward (lognormal, median 2 s per call) on 8 dedicated workers vs the elastic
    pool (cold start 5 s, scale to zero)."""
    configs, g = {}, _groups(quick)
    tasks = [_task(t, None) for t in TASKS]
    judge = Latency("lognormal", seconds=2.0, sigma=0.5)
    for kind in ("dedicated", "elastic"):
        reward = RewardPool(kind, workers=8, max_workers=64, idle_timeout=10.0)
        cost = RewardCost(call=judge, elastic=kind == "elastic", workers=8)
        configs[f"x/{kind}"] = _config(
            _cluster({"H20": ("H20", 64)}, reward=reward), _graph(tasks, ("H20",), groups=g),
            "Qwen3-8B", steps=steps, reward=cost)
    return [Experiment("serverless_util", "reward pool utilisation: dedicated → elastic",
                       (0.06, 0.88), configs, _reward_util,
                       "judge latency and pool sizes are ours", unit="")]


def _reward_util(results: dict) -> dict:
    return {kind: results[f"x/{kind}"].utilisation.get("reward", float("nan"))
            for kind in ("dedicated", "elastic") if f"x/{kind}" in results}


def mooncake_pull(transport: str = "rdma") -> dict:
    """Exposed weight pull per model (paper, Mooncake: 1.4 / 5.1 / 9.6 s for 8B / 14B /
    32B): one node pulls a whole copy (TP 1) with no decoding left to overlap it, plus
    the load into HBM; ``WeightSync``'s assumed rates, not the paper's Table 3."""
    ws = WeightSync(transport)
    return {m: ws.exposed_pull_s(MODELS[m], GPUS["H20"], tp=1) for m in MODEL_TP}


def experiments(quick: bool = True) -> list[Experiment]:
    """Every simulated experiment, in the order of the table in docs/benchmarks/cluster-sim.md."""
    out = []
    for build in (affinity, modes, env_interaction, redundancy, alpha, pd, serverless):
        out += build(quick)
    return out


def scale_config(quick: bool = True, steps: int = 1) -> SimConfig:
    """The paper's production shape: 3,000 GPUs, α = 1, train:gen = 1:5 (500 H800
    training, 2,500 rollout: 1,000 H800 + 1,500 H20), Qwen3-32B at TP 4, the four-task
    mix with affinity, 32,768 env slots and 1,024 groups of 16 per step (ours)."""
    routed = [_task(t, Affinity(pools=("H800",))) for t in PREFILL_HEAVY] + \
             [_task(t, Affinity(pools=("H20",))) for t in DECODE_HEAVY]
    groups = 256 if quick else 1024
    graph = _graph(routed, ("H800", "H20"), groups=groups, group_size=16, env_slots=32768)
    cluster = _cluster({"H800": ("H800", 1000), "H20": ("H20", 1500)}, trainer_gpus=500,
                       env_slots=32768, reward=RewardPool("elastic", max_workers=512),
                       model="Qwen3-32B")
    return _config(cluster, graph, "Qwen3-32B", steps=steps)


# -- running -------------------------------------------------------------------------------
def run(exp: Experiment, cache: dict | None = None) -> dict:
    """Simulate ``exp``'s configs (reusing ``cache`` label → result across experiments
    that share configs); return its values, their range and the paper's."""
    from rollart.sim import simulate

    cache = {} if cache is None else cache
    t0 = time.perf_counter()
    results = {}
    for label, cfg in exp.configs.items():
        key = (id(exp.configs), label)
        if key not in cache:
            cache[key] = simulate(cfg)
        results[label] = cache[key]
    values = exp.figure(results)
    finite = [v for v in values.values() if v == v]
    lo, hi = (min(finite), max(finite)) if finite else (float("nan"), float("nan"))
    return {"key": exp.key, "title": exp.title, "values": values, "sim": (lo, hi),
            "paper": exp.paper, "assumed": exp.assumed, "unit": exp.unit,
            "wall_s": time.perf_counter() - t0}


def run_all(quick: bool = True, log=print) -> dict:
    """Every experiment through the simulator, plus the Mooncake pull figures:
    ``{key: run(...)}``."""
    cache: dict = {}
    out = {}
    for exp in experiments(quick):
        out[exp.key] = run(exp, cache)
        r = out[exp.key]
        log(f"{exp.key}: sim {_span(r['sim'], r['unit'])} paper "
            f"{_span(r['paper'], r['unit'])} ({r['wall_s']:.1f}s) {r['values']}")
    pulls = mooncake_pull()
    out["mooncake_pull"] = {"key": "mooncake_pull", "title": "Mooncake exposed pull (s)",
                            "values": pulls, "sim": tuple(pulls.values()),
                            "paper": tuple(MOONCAKE_PAPER.values()), "unit": " s",
                            "assumed": "RDMA 12.5 GB/s per pulling node, TP 1"}
    return out


def _span(values, unit: str) -> str:
    """``(lo, hi)`` as a range (one number when equal); more values joined by ' / '."""
    if len(values) == 2:
        lo, hi = values
        return f"{lo:.3g}{unit}" if lo == hi else f"{lo:.3g}–{hi:.3g}{unit}"
    return " / ".join(f"{v:.3g}" for v in values) + unit


def table(results: dict) -> str:
    """The table of docs/benchmarks/cluster-sim.md: experiment, simulated, paper, what is
    assumed."""
    lines = ["| experiment | simulated | paper | assumed |", "|---|---|---|---|"]
    for r in results.values():
        lines.append(f"| {r['title']} | {_span(r['sim'], r['unit'])} | "
                     f"{_span(r['paper'], r['unit'])} | {r['assumed']} |")
    return "\n".join(lines)
