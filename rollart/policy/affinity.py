"""Hardware affinity: which pool (Dask resource tag) each task, env, reward and phase uses.

Declared with decorators next to the code they place, read by the control loop and the
``LLMProxy``, checked before anything is submitted::

    @task_affinity(prefill=H800, decode=H20)   # prefill on compute GPUs, decode on bandwidth
    def long_context_task() -> Task: ...

    @env_affinity("CPU_BIG")                   # this env's managers run on CPU_BIG workers
    class MyEnv: ...

    @reward_affinity("REWARD_GPU")             # this reward runs as a task on REWARD_GPU
    def judge(episode): ...

``task_affinity(H20)`` pins whole requests of a task to a pool, ``task_affinity(auto=True)``
lets the proxy classify the task as prefill- or decode-heavy from what it observes.
``check_declared`` (against a resources file, before a cluster starts) and
``check_cluster`` (against the workers a scheduler reports) turn a misdeclared tag into an
``AffinityError`` that names the task, the tag and the file to change; a Dask task
restricted to a missing tag would otherwise wait forever.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from rollart.runtime.resources import ResourceTagError, check_tags
from rollart.types import CPU_ENV, H20, H800, REWARD

if TYPE_CHECKING:  # pragma: no cover
    from rollart.env.tasks import Task

__all__ = [
    "Affinity", "AffinityError", "BANDWIDTH_TAGS", "COMPUTE_TAGS", "affinity_of",
    "check_cluster", "check_declared", "classify", "env_affinity", "env_pools", "env_tag",
    "inference_tags", "needs", "reward_affinity", "reward_tag", "task_affinity",
    "task_routes",
]

ATTR = "__rollart_affinity__"
COMPUTE_TAGS = (H800,)  #: default pools for prefill-heavy work (auto mode)
BANDWIDTH_TAGS = (H20,)  #: default pools for decode-heavy work (auto mode)


class AffinityError(ResourceTagError):
    """An affinity that cannot be honoured; the message says what to change."""


@dataclass(frozen=True)
class Affinity:
    """Where a stage runs. ``pools``: any of these tags; ``prefill``/``decode``: the two
    generation phases of a task on two pools (PD disaggregation); ``auto``: the proxy
    picks a compute or bandwidth pool from the task's observed prompt/response ratio."""

    pools: tuple[str, ...] = ()
    prefill: str | None = None
    decode: str | None = None
    auto: bool = False

    def __post_init__(self):
        pools = (self.pools,) if isinstance(self.pools, str) else tuple(self.pools)
        object.__setattr__(self, "pools", pools)
        for tag in (*pools, self.prefill, self.decode):
            if tag is not None and (not isinstance(tag, str) or not tag):
                raise AffinityError(f"affinity tags must be non-empty strings (e.g. "
                                    f"{H800!r}), got {tag!r}")
        if (self.prefill is None) != (self.decode is None):
            raise AffinityError("give both prefill= and decode= (the pools of the two "
                                f"generation phases), got prefill={self.prefill!r}, "
                                f"decode={self.decode!r}")
        modes = sum([bool(pools), self.prefill is not None, bool(self.auto)])
        if modes != 1:
            raise AffinityError("declare exactly one of: pools (task_affinity(H20)), "
                                "prefill=/decode= (PD disaggregation), or auto=True")

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def tags(self) -> tuple[str, ...]:
        """The tags this affinity names (none for ``auto``)."""
        if self.disaggregated:
            return (self.prefill, self.decode)
        return self.pools


def _affinity(pools, prefill, decode, auto) -> Affinity:
    return Affinity(pools=tuple(pools), prefill=prefill, decode=decode, auto=auto)


def task_affinity(*pools: str, prefill: str | None = None, decode: str | None = None,
                  auto: bool = False):
    """Decorate a ``Task`` (or a function returning one) with where it generates.

    >>> from rollart.env.tasks import get_task
    >>> task_affinity(prefill="H800", decode="H20")(get_task("guess")).affinity.decode
    'H20'
    """
    aff = _affinity(pools, prefill, decode, auto)

    def apply(obj):
        if _is_task(obj):
            return replace(obj, affinity=aff)
        if callable(obj):
            return _TaskFactory(obj, aff)
        raise TypeError(f"task_affinity decorates a Task or a function returning one, "
                        f"got {type(obj).__name__}")

    return apply


def _is_task(obj) -> bool:
    """A ``rollart.env.tasks.Task`` instance, told by its fields: this module sits below
    the env stage (``rollart.policy``) and does not import it."""
    import dataclasses

    return dataclasses.is_dataclass(obj) and not isinstance(obj, type) and \
        {"env_factory", "reward_fn", "max_turns", "affinity"} <= \
        {f.name for f in dataclasses.fields(obj)}


class _TaskFactory:
    """A task function whose result carries an affinity (picklable if ``fn`` is)."""

    def __init__(self, fn: Callable[[], "Task"], aff: Affinity):
        self.fn, self.affinity = fn, aff
        self.__name__ = getattr(fn, "__name__", "task")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        task = self.fn(*args, **kwargs)
        if not _is_task(task):
            raise TypeError(f"{self.__name__}() decorated with task_affinity returned "
                            f"{type(task).__name__}; return a rollart.Task")
        return replace(task, affinity=self.affinity)


def _tag_object(kind: str, pools: tuple[str, ...]):
    if not pools:
        raise AffinityError(f"{kind}_affinity needs at least one pool tag, e.g. "
                            f"{kind}_affinity({(CPU_ENV if kind == 'env' else REWARD)!r})")
    aff = Affinity(pools=tuple(pools))

    def apply(obj):
        target = obj if isinstance(obj, type) or callable(obj) else None
        if target is None:
            raise TypeError(f"{kind}_affinity decorates a class or function, "
                            f"got {type(obj).__name__}")
        setattr(obj, ATTR, aff)
        return obj

    return apply


def env_affinity(*pools: str):
    """Class decorator: this env's ``EnvManager`` runs on workers with one of ``pools``."""
    return _tag_object("env", pools)


def reward_affinity(*pools: str):
    """Decorator for a reward function (or callable class): it runs on one of ``pools``."""
    return _tag_object("reward", pools)


def affinity_of(obj: Any) -> Affinity | None:
    """The affinity declared on ``obj`` (a Task, env class, reward), or ``None``."""
    aff = getattr(obj, "affinity", None)
    if isinstance(aff, Affinity):
        return aff
    aff = getattr(obj, ATTR, None)
    if aff is None and not isinstance(obj, type):
        aff = getattr(type(obj), ATTR, None)
    return aff if isinstance(aff, Affinity) else None


def env_tag(task) -> str:
    """The tag of the workers whose ``EnvManager`` runs ``task``'s envs."""
    aff = affinity_of(task.env_factory)
    return aff.pools[0] if aff else CPU_ENV


def reward_tag(task) -> str:
    """The tag of the pool that runs ``task``'s reward function."""
    aff = affinity_of(task.reward_fn)
    return aff.pools[0] if aff else REWARD


def task_routes(tasks) -> dict[str, Affinity]:
    """``{task name: Affinity}`` for the tasks that declare one (the proxy's table)."""
    return {t.name: t.affinity for t in tasks if isinstance(getattr(t, "affinity", None),
                                                            Affinity)}


def inference_tags(graph) -> tuple[str, ...]:
    """Every tag an ``InferenceWorker`` is needed on: the graph's pools + task affinities."""
    tags = list(graph.rollout.inference_pools)
    for aff in task_routes(graph.tasks).values():
        tags += [t for t in aff.tags() if t not in tags]
    return tuple(tags)


def needs(graph) -> dict[str, str]:
    """``{tag: what needs it}`` for every tag the graph's affinities name."""
    out: dict[str, str] = {}
    for task in graph.tasks:
        aff = getattr(task, "affinity", None)
        if isinstance(aff, Affinity):
            if aff.disaggregated:
                out.setdefault(aff.prefill, f"task {task.name!r} (prefill phase)")
                out.setdefault(aff.decode, f"task {task.name!r} (decode phase)")
            for tag in aff.pools:
                out.setdefault(tag, f"task {task.name!r} (generation)")
        out.setdefault(env_tag(task), f"task {task.name!r} (env)")
        out.setdefault(reward_tag(task), f"task {task.name!r} (reward)")
    return out


def check_declared(graph, resources) -> None:
    """Before a cluster starts: every tag the graph names is on a declared pool with
    workers. ``resources`` with only an ``address`` is checked later (``check_cluster``)."""
    if not resources.pools:
        return
    declared = resources.tags()
    pools = {p.tag: p for p in resources.pools}
    for tag, who in needs(graph).items():
        if tag not in declared and not any(tag in p.extra_tags for p in resources.pools):
            have = sorted(declared)
            raise AffinityError(
                f"{who} of graph {graph.name!r} asks for pool tag {tag!r}, which no pool in "
                f"{resources.source} declares (declared tags: {have}). Add a "
                f"Pool(..., tag={tag!r}) there or change the affinity")
        if declared.get(tag, 0) <= 0:
            name = pools[tag].name if tag in pools else "?"
            raise AffinityError(
                f"{who} of graph {graph.name!r} needs tag {tag!r}, but pool {name!r} in "
                f"{resources.source} declares no workers (workers=0): set workers >= 1")


def check_cluster(client, graph, source: str) -> None:
    """On a running cluster: every tag the graph needs is carried by some worker."""
    for tag, who in needs(graph).items():
        try:
            check_tags(client, {tag: 1}, source, needed_by=f"{who} of graph {graph.name!r}")
        except ResourceTagError as e:
            raise AffinityError(str(e)) from None


def classify(prompt_tokens: int, response_tokens: int, ratio: float = 2.0) -> str:
    """``"prefill"`` if prompts outweigh responses by ``ratio`` or more, else ``"decode"``.

    >>> classify(400, 8), classify(20, 200)
    ('prefill', 'decode')
    """
    return "prefill" if prompt_tokens >= ratio * max(response_tokens, 1) else "decode"


def env_pools(graph) -> tuple[str, ...]:
    """The tags EnvManagers are needed on: ``CPU_ENV`` + every task's env affinity."""
    tags = [CPU_ENV]
    for task in graph.tasks:
        if env_tag(task) not in tags:
            tags.append(env_tag(task))
    return tuple(tags)
