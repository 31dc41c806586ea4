"""Graph definitions: what to train (task mix, policy, algorithm, bounds) as plain Python.

A graph module in ``graphs/`` defines ``graph() -> Graph``; variants are functions that
call another graph function and ``dataclasses.replace`` what differs. ``load_graph``
resolves a CLI argument (a path, a bare name in ``graphs/``, or ``module:function``) to a
validated ``Graph``. The control loop reads it; nothing here touches Dask or torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from rollart.policy.admission import in_flight_for, stale_members_for
from rollart.policy.affinity import inference_tags
from rollart.policy.affinity import needs as affinity_needs
from rollart.env.rescore import stale_members_problem
from rollart.env.tasks import get_task
from rollart.runtime.resources import find_file, load_module
from rollart.types import (CPU_ENV, DEFAULT_OFF_POLICY, INFERENCE_TAGS, OFF_POLICY, REWARD,
                           SCALE_REWARDS, STALE_GROUPS, TRAIN)
from rollart.config.checks import GraphError  # noqa: F401 (re-exported: graph errors' home)
from rollart.config.checks import check as _check
from rollart.config.checks import check_numbers as _numbers
from rollart.config.policy import TRAINER_BACKENDS, Policy  # noqa: F401 (re-exported)
from rollart.config.training import LoRA, TrainerParallel  # noqa: F401 (re-exported)

DEFAULT_GRAPH = "multitask"
MODES = ("async", "areal", "one-off", "sync+", "sync")  # see rollart.control.modes
# the staleness bound of each mode when GRPO.alpha is left unset (None); the fixed
# baselines imply theirs (sync and sync+ are on-policy, one-off one step behind), so
# setting another is an error; async and areal take any bound
MODE_ALPHA = {"async": 1, "areal": 1, "one-off": 1, "sync+": 0, "sync": 0}
FREE_ALPHA = ("async", "areal")  # modes whose staleness bound is a setting
LOCKSTEP_MODES = ("one-off", "sync")  # a turn barrier across each batch


@dataclass(frozen=True)
class GRPO:
    """Group-relative policy optimisation settings.

    ``min_group_size``: a group whose members failed for infrastructure (env crashed or
    hung, reward failed, worker lost) past their re-runs keeps only its finished members;
    with fewer than this many it is not trained and is counted
    (``rollout/groups_too_small``; ``rollart.buffer.infra``). A failed member is never
    scored as a zero reward among its group's advantages."""

    group_size: int = 8  # trajectories per group (same task and seed)
    min_group_size: int = 2  # trainable members a group needs (docstring), ≤ group_size
    groups_per_step: int = 12  # groups per trainer step; batch = group_size * this
    lr: float = 5e-4  # AdamW learning rate
    clip_eps: float = 0.2  # PPO clip range: the ratio is clipped at 1 ± clip_eps
    kl_coef: float = 0.0  # > 0 adds a k3 KL penalty against the initial policy
    max_grad_norm: float = 1.0  # gradient clipping by global norm
    weight_decay: float = 0.0  # AdamW weight decay
    # staleness bound: train on trajectories ≤ alpha versions old. None: the mode's
    # (MODE_ALPHA: async 1, areal 1, one-off 1, sync+ 0, sync 0), resolved by resolve_alpha
    alpha: int | None = None
    off_policy: str = DEFAULT_OFF_POLICY  # staleness correction, one of OFF_POLICY
    is_cap: float = 2.0  # truncation of the behaviour importance weight
    # the trainer cuts a batch, sorted by length, into micro-batches of at most this many
    # padded tokens (gradients accumulate; the loss is the same token mean): less
    # padding and bounded memory. 0: the whole batch at once
    micro_batch_tokens: int = 4096
    # how a group's centred rewards are scaled into advantages: "group" (its std: GRPO),
    # "batch" (the std of the whole batch's rewards), "none" (Dr. GRPO); with "group" a
    # group whose rewards differ only by a small penalty weighs as much as one with a
    # success (rollart.trainer.advantages)
    scale_rewards: str = "group"
    # async: a complete group that fell below the staleness bound while it waited for its
    # take is "drop"ped (and run again), or "rescore"d: kept, and the trainer re-scores
    # its tokens older than the bound under the weights it trains (their behaviour
    # log-probs become its own: rollart.trainer.losses.rescore_stale), or kept and
    # trained as it is ("clip": its behaviour log-probs under the loss's clip, as areal
    # trains a group however stale; trainer/staleness_max may then exceed alpha)
    stale_groups: str = "drop"

    def __post_init__(self):
        for name in ("group_size", "groups_per_step", "min_group_size"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                   f"GRPO.{name} must be an int ≥ 1, got {v!r}")
        _numbers(self, "micro_batch_tokens", integer=True)
        _numbers(self, "alpha", integer=True, optional=True)
        _check(self.micro_batch_tokens >= 0, f"GRPO.micro_batch_tokens must be ≥ 0 (0: "
               f"no micro-batches), got {self.micro_batch_tokens!r}")
        _numbers(self, "lr", "clip_eps", "kl_coef", "max_grad_norm", "weight_decay", "is_cap")
        _check(self.group_size >= 2, f"GRPO.group_size must be ≥ 2 (group-normalised "
               f"advantages need a group), got {self.group_size}")
        _check(self.min_group_size <= self.group_size,
               f"GRPO.min_group_size must be ≤ group_size={self.group_size} (a group "
               f"never has more members), got {self.min_group_size}")
        _check(self.alpha is None or self.alpha >= 0,
               f"GRPO.alpha (staleness bound) must be an int ≥ 0 or None (the mode's), "
               f"got {self.alpha!r}")
        # readers get an int: the async bound until a Graph resolves it for its mode
        object.__setattr__(self, "alpha_given", self.alpha is not None)
        object.__setattr__(self, "alpha", resolve_alpha(self))
        _check(self.lr > 0, f"GRPO.lr must be > 0, got {self.lr!r}")
        _check(0 < self.clip_eps < 1, f"GRPO.clip_eps must be in (0, 1), got {self.clip_eps}")
        _check(self.kl_coef >= 0, f"GRPO.kl_coef must be ≥ 0, got {self.kl_coef!r}")
        _check(self.max_grad_norm > 0, "GRPO.max_grad_norm must be > 0")
        _check(self.scale_rewards in SCALE_REWARDS, f"GRPO.scale_rewards must be one of "
               f"{SCALE_REWARDS}, got {self.scale_rewards!r}")
        _check(self.off_policy in OFF_POLICY, f"GRPO.off_policy must be one of "
               f"{OFF_POLICY}, got {self.off_policy!r}")
        _check(self.is_cap >= 1, f"GRPO.is_cap must be ≥ 1, got {self.is_cap!r}")
        _check(self.stale_groups in STALE_GROUPS, f"GRPO.stale_groups must be one of "
               f"{STALE_GROUPS}, got {self.stale_groups!r}: 'drop' runs a complete group "
               f"that went too stale again, 'rescore' keeps it and the trainer re-scores "
               f"its old tokens, 'clip' keeps it and trains them as they are (e.g. --set "
               f"algo.stale_groups=rescore)")

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step


def resolve_alpha(algo: GRPO, mode: str = "async", graph: str | None = None) -> int:
    """The staleness bound of ``algo`` under ``mode``: the one place it is decided.

    ``GRPO.alpha`` left unset (``alpha_given`` false) takes the mode's ``MODE_ALPHA``; a
    set one is kept, and one that contradicts a baseline's bound is a ``GraphError``.

    >>> resolve_alpha(GRPO(), "sync"), resolve_alpha(GRPO(alpha=3), "async")
    (0, 3)
    """
    if not getattr(algo, "alpha_given", algo.alpha is not None):
        return MODE_ALPHA[mode]
    if mode not in FREE_ALPHA and algo.alpha != MODE_ALPHA[mode]:
        where = f"graph {graph!r}: " if graph else ""
        raise GraphError(
            f"{where}GRPO.alpha={algo.alpha} contradicts mode={mode!r}, whose staleness "
            f"bound is {MODE_ALPHA[mode]} ({mode} is defined by it). Leave GRPO.alpha "
            f"unset (or set it to {MODE_ALPHA[mode]}), drop --alpha, or use "
            f"mode='async' (--mode async) or 'areal' for a bound of {algo.alpha}")
    return algo.alpha


@dataclass(frozen=True)
class Rollout:
    """Where and how trajectories run."""

    inference_pools: tuple[str, ...] = INFERENCE_TAGS  # resource tags of the pools that generate
    env_concurrency: int = 256  # trajectories one EnvManager runs at once
    redundancy: float = 1.0  # async mode: launch this many × group_size members per group
    # when the extra members start: None = with the group; a fraction f in (0, 1] = as
    # backups, once f × group_size members are delivered (for the ones still running)
    backup_after: float | None = None
    env_step_timeout: float = 30.0  # seconds; a slower env step fails its trajectory
    reward_timeout: float = 30.0  # seconds; a slower reward fails its trajectory
    # a plain reward whose pool includes the env manager's own worker runs there, on a
    # thread (as many at once as that worker has slots of the tag), instead of as a
    # Dask task through the scheduler (~7 messages a trajectory); False: always a task
    local_reward: bool = True
    trajectory_timeout: float | None = None  # seconds for a whole trajectory (None: none)
    # stop the run (FailureStormError) after this many failed trajectories in a row with
    # none reaching the buffer; None: 4 × the trajectories of one trainer step; 0: never
    failure_streak_limit: int | None = None
    # stop the run (StallError) when trajectories are in flight but none has settled
    # (delivered, failed, cancelled, ...) for this many seconds; None: twice the longest a
    # trajectory may legitimately take (trajectory_timeout, or env_step_timeout × the
    # longest task's turns + reward_timeout), at least 300 s; 0: never
    stall_timeout: float | None = None
    # name a task on the console and the dashboard once it has produced no trainable
    # group, or (its env declaring tools) no tool call, for this many trainer steps in a
    # row, and again once it recovers (rollart.observe.silent); 0: never
    silent_task_steps: int = 10
    # stop launching a task once every trajectory of it that arrived failed with an error
    # for this many trainer steps in a row (rollart.policy.quarantine): one console line
    # names it, rollout/tasks_stopped counts it; every task stopped ends the run
    # (TasksStoppedError); 0: never
    failing_task_steps: int = 3
    # async and areal: groups in flight or buffered at once, in trainer steps' worth of
    # groups (GRPO.groups_per_step each), apart from the staleness bound alpha; "auto":
    # re-decided each trainer step from the trainer's wait, the engines' batches and
    # queues and the groups lost to staleness, between one and alpha + 1 steps' worth
    # (rollart.policy.inflight), with take_window one step's worth unless set; None:
    # the mode's own (Graph.max_in_flight): "auto" in async, AReaL's start bound alone
    # in areal; a number fixes it (the earlier async default was max(alpha, 1))
    max_in_flight: float | str | None = None
    # async and areal: the trainer takes complete groups in the order they started, each
    # only once fewer than this many trainer steps' worth of groups (at least one step's)
    # started before it are still running or waiting, so a long episode is overtaken by
    # at most that many and the batch is not biased toward short ones
    # (rollart.policy.admission.Slots.take_limit); math.inf: the first groups to complete
    # are taken first (completion order); None: the mode's own (one step's worth under
    # max_in_flight "auto", else completion order)
    take_window: float | None = None
    # async: a running member whose oldest token fell below the staleness bound is
    # "abort"ed and run again from the start, or "rescore"d: its old tokens re-scored
    # under the new weights at its next turn boundary, and it goes on
    # (rollart.env.rescore; torch engine only); None: the graph's own
    # (Graph.stale_members): "rescore" in async on the torch engine, else "abort"
    stale_members: str | None = None

    def __post_init__(self):
        _check(isinstance(self.inference_pools, tuple) and len(self.inference_pools) > 0,
               f"Rollout.inference_pools must be a non-empty tuple of resource tags, "
               f"got {self.inference_pools!r}")
        _numbers(self, "env_concurrency", integer=True)
        _numbers(self, "env_step_timeout", "reward_timeout", "redundancy")
        _numbers(self, "trajectory_timeout", optional=True)
        _numbers(self, "failure_streak_limit", integer=True, optional=True)
        _check(self.failure_streak_limit is None or self.failure_streak_limit >= 0,
               f"Rollout.failure_streak_limit must be ≥ 0 (0: never stop) or None, got "
               f"{self.failure_streak_limit!r}")
        _numbers(self, "stall_timeout", optional=True)
        _numbers(self, "silent_task_steps", "failing_task_steps", integer=True)
        _check(self.failing_task_steps >= 0,
               f"Rollout.failing_task_steps must be an int ≥ 0 (trainer steps; 0: never "
               f"stop a task), got {self.failing_task_steps!r}")
        _check(self.silent_task_steps >= 0,
               f"Rollout.silent_task_steps must be an int ≥ 0 (trainer steps; 0: never "
               f"warn), got {self.silent_task_steps!r}")
        _check(self.stall_timeout is None or self.stall_timeout >= 0,
               f"Rollout.stall_timeout must be ≥ 0 seconds (0: never stop) or None, got "
               f"{self.stall_timeout!r}")
        _check(isinstance(self.local_reward, bool),
               f"Rollout.local_reward must be True or False, got {self.local_reward!r}")
        _check(self.env_concurrency >= 1, "Rollout.env_concurrency must be ≥ 1")
        _check(self.env_step_timeout > 0, "Rollout.env_step_timeout must be > 0 seconds")
        _check(self.reward_timeout > 0, "Rollout.reward_timeout must be > 0 seconds")
        _check(self.trajectory_timeout is None or self.trajectory_timeout > 0,
               f"Rollout.trajectory_timeout must be > 0 seconds or None (no limit), got "
               f"{self.trajectory_timeout!r}")
        _check(isinstance(self.redundancy, (int, float)) and 1 <= self.redundancy <= 8,
               f"Rollout.redundancy must be a factor in [1, 8], got {self.redundancy!r}")
        _check(not isinstance(self.max_in_flight, str) or self.max_in_flight == "auto",
               f"Rollout.max_in_flight must be a number > 0 (trainer steps' worth of "
               f"groups), \"auto\" (adapted each step) or None (max(alpha, 1) steps' "
               f"worth), got {self.max_in_flight!r}")
        if self.max_in_flight != "auto":
            _numbers(self, "max_in_flight", optional=True)
        _check(self.max_in_flight in (None, "auto") or self.max_in_flight > 0,
               f"Rollout.max_in_flight must be > 0 (trainer steps' worth of groups), "
               f"\"auto\" or None (max(alpha, 1) steps' worth), got {self.max_in_flight!r}")
        _numbers(self, "take_window", optional=True)
        _check(self.take_window is None or self.take_window >= 1,
               f"Rollout.take_window must be ≥ 1 (trainer steps' worth of groups: fewer "
               f"could never fill a batch), math.inf (completion order) or None (the "
               f"mode's own), got "
               f"{self.take_window!r}")
        problem = None if self.stale_members is None else \
            stale_members_problem(self.stale_members)
        _check(problem is None, problem)
        _numbers(self, "backup_after", optional=True)
        _check(self.backup_after is None or 0 < self.backup_after <= 1,
               f"Rollout.backup_after must be a fraction in (0, 1] of the group (extra "
               f"members start once that share is delivered) or None (they start with "
               f"the group), got {self.backup_after!r}")


@dataclass(frozen=True)
class Graph:
    """A training run's definition. ``tasks`` are names of built-in tasks or ``Task`` s."""

    name: str  # the run's name (the run directory is runs/NAME-TIME)
    tasks: tuple = ("gridnav", "guess", "boxpush")  # task names (rollart.env.tasks) or Task objects
    task_weights: tuple[float, ...] | None = None  # the task mix, one weight per task (None: equal)
    policy: Policy = field(default_factory=Policy)  # the model and how it samples
    algo: GRPO = field(default_factory=GRPO)  # the optimisation settings
    rollout: Rollout = field(default_factory=Rollout)  # where and how trajectories run
    steps: int = 120  # trainer steps (--steps)
    seed: int = 0  # seeds the group sequence, the model and sampling (--seed)
    mode: str = "async"  # async | areal | one-off | sync+ | sync (--mode)
    checkpoint_every: int = 0  # a checkpoint every N steps, and at the end (0: none)

    def __post_init__(self):
        _check(isinstance(self.name, str) and self.name, "Graph.name must be a non-empty str")
        _check(isinstance(self.tasks, (tuple, list)) and len(self.tasks) > 0,
               f"Graph {self.name!r}: tasks must be a non-empty tuple of task names or "
               f"Task objects, got {self.tasks!r}")
        resolved = tuple(get_task(t) for t in self.tasks)  # raises UnknownTaskError
        object.__setattr__(self, "tasks", resolved)
        names = [t.name for t in resolved]
        _check(len(set(names)) == len(names), f"Graph {self.name!r}: tasks repeat: {names}")
        if self.task_weights is not None:
            _check(isinstance(self.task_weights, (tuple, list)) and all(
                isinstance(w, (int, float)) and not isinstance(w, bool)
                for w in self.task_weights),
                f"Graph {self.name!r}: task_weights must be a tuple of numbers, one per "
                f"task, got {self.task_weights!r}")
            _check(len(self.task_weights) == len(resolved) and
                   all(w >= 0 for w in self.task_weights) and sum(self.task_weights) > 0,
                   f"Graph {self.name!r}: task_weights must have one weight ≥ 0 per task "
                   f"({len(resolved)}), not all zero; got {self.task_weights!r}")
        for attr, cls in (("policy", Policy), ("algo", GRPO), ("rollout", Rollout)):
            _check(isinstance(getattr(self, attr), cls),
                   f"Graph.{attr} must be a rollart.{cls.__name__}, "
                   f"got {type(getattr(self, attr)).__name__}")
        unknown = [t for t in self.policy.warmup_tasks if t not in names]
        _check(not unknown, f"Graph {self.name!r}: Policy.warmup_tasks names {unknown}, "
               f"not among the graph's tasks {names}")
        _check(self.rollout.stale_members != "rescore" or self.policy.engine == "torch",
               f"Graph {self.name!r}: Rollout.stale_members='rescore' needs "
               f"Policy.engine='torch' (the vLLM engine cannot re-score tokens yet); set "
               f"Rollout.stale_members='abort' or Policy.engine='torch'")
        # only async aborts members for staleness: areal keeps them, lockstep is on-policy
        _check(self.rollout.stale_members != "rescore" or self.mode == "async",
               f"Graph {self.name!r}: Rollout.stale_members='rescore' applies to "
               f"mode='async' only (areal keeps its members, the lockstep modes abort none), "
               f"got mode={self.mode!r}; set Rollout.stale_members='abort' or mode='async'")
        # only async drops complete groups for staleness: areal keeps them
        _check(self.algo.stale_groups == "drop" or self.mode == "async",
               f"Graph {self.name!r}: GRPO.stale_groups={self.algo.stale_groups!r} applies "
               f"to mode='async' "
               f"only (areal keeps its groups, the lockstep modes drop none), got "
               f"mode={self.mode!r}; set GRPO.stale_groups='drop' or mode='async'")
        _numbers(self, "steps", "seed", "checkpoint_every", integer=True)
        _check(self.checkpoint_every >= 0, f"Graph.checkpoint_every must be ≥ 0 (0 = never), "
               f"got {self.checkpoint_every}")
        _check(isinstance(self.steps, int) and self.steps >= 1,
               f"Graph.steps must be an int ≥ 1, got {self.steps!r}")
        _check(self.mode in MODES, f"Graph.mode {self.mode!r} is not one of {MODES}")
        alpha = resolve_alpha(self.algo, self.mode, self.name)
        if alpha != self.algo.alpha:  # unset: this mode's bound (and still unset)
            algo = replace(self.algo, alpha=alpha)
            object.__setattr__(algo, "alpha_given", False)
            object.__setattr__(self, "algo", algo)

    @property
    def max_in_flight(self) -> float | str | None:
        """``Rollout.max_in_flight`` in effect under this graph's mode: a set one is
        kept; unset, ``"auto"`` in async (the limit adapted each step, under AReaL's
        start bound: ``rollart.policy.admission.auto_admission``) and None elsewhere
        (areal: its start bound alone).

        >>> Graph("g").max_in_flight, Graph("g", mode="areal").max_in_flight
        ('auto', None)
        >>> Graph("g", rollout=Rollout(max_in_flight=1)).max_in_flight
        1
        """
        return in_flight_for(self.rollout, self.mode)

    @property
    def stale_members(self) -> str:
        """``Rollout.stale_members`` in effect: a set one is kept; unset, ``"rescore"``
        in async on the torch engine (a member that crossed the bound keeps its tokens,
        re-scored: ``rollart.env.rescore``) and ``"abort"`` otherwise (areal keeps its
        members, the lockstep modes abort none, the vLLM engine cannot re-score).

        >>> Graph("g").stale_members, Graph("g", mode="sync+").stale_members
        ('rescore', 'abort')
        """
        return stale_members_for(self.rollout, self.mode, self.policy.engine)

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def needs(self) -> dict[str, float]:
        """Resource tags this graph's actors and tasks ask for (one unit each)."""
        tags = {t: 1 for t in self.rollout.inference_pools}
        tags.update({CPU_ENV: 1, REWARD: 1, TRAIN: 1})
        tags.update({t: 1 for t in inference_tags(self)})  # + declared affinities
        tags.update({t: 1 for t in affinity_needs(self)})
        return tags

    def to_dict(self) -> dict:
        """A JSON-friendly description (tasks by name), saved in the run directory."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "tasks":
                v = [t.name for t in v]
            elif hasattr(v, "__dataclass_fields__"):
                v = {g.name: _plain(getattr(v, g.name)) for g in fields(v)}
            out[f.name] = v
        return out


def _plain(value):
    """A nested settings dataclass (``Policy.lora``) as a dict, for ``graph.json``."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    return value


def load_graph(spec: str | Graph | None = None) -> tuple[Graph, str]:
    """Resolve ``spec`` to ``(graph, source)``.

    ``None`` → ``graphs/multitask.py``; ``"gridnav"`` → ``graphs/gridnav.py``;
    ``"path/to/file.py"``; ``"package.module:function"``.
    """
    if isinstance(spec, Graph):
        return spec, "<python>"
    spec = DEFAULT_GRAPH if spec is None else str(spec)
    fn_name = "graph"
    if ":" in spec and not Path(spec).exists():
        spec, fn_name = spec.rsplit(":", 1)
    if "/" not in spec and not spec.endswith(".py") and _importable(spec) and \
            not _in_graphs_dir(spec):
        module, source = importlib.import_module(spec), spec
    else:
        path = find_file(spec, "graphs", GraphError)
        module, source = load_module(path, GraphError), str(path)
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise GraphError(f"{source} defines no {fn_name}() function; add "
                         f"`def {fn_name}() -> rollart.Graph: ...`")
    graph = fn() if callable(fn) else fn
    if not isinstance(graph, Graph):
        raise GraphError(f"{source}: {fn_name}() returned {type(graph).__name__}; "
                         "return a rollart.Graph")
    return graph, source


def _in_graphs_dir(name: str) -> bool:
    from rollart.runtime.resources import REPO_ROOT

    return any((base / "graphs" / f"{name}.py").is_file() for base in (Path.cwd(), REPO_ROOT))


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


