"""Checks a run's input before anything expensive starts (cluster, model, actors).

Consumes a validated ``Graph`` and ``Resources`` (their own ``__post_init__`` already
checked each field); produces nothing, or a ``GraphError`` / ``ResourceTagError`` whose
message says what to change. ``rollart.control.train`` calls ``preflight`` right after
loading the graph and resources, and ``check_lockstep`` again once it knows how many
env workers a cluster it connected to has. What is checked here is what only shows up
when the pieces meet:

* every resource tag the graph needs is carried by a declared pool with ≥ 1 worker (a
  Dask task restricted to a missing tag would wait forever);
* every task's env factory and reward function pickle (they travel to Dask workers);
* a lockstep batch (``sync`` / ``one-off``) fits the env managers' concurrency (else
  the turn barrier waits for members that can never start).
"""

from __future__ import annotations

import math

from rollart.graph import Graph, GraphError
from rollart.resources import Resources, ResourceTagError
from rollart.types import ALL_TAGS, CPU_ENV


def preflight(graph: Graph, resources: Resources | None) -> None:
    """All checks that need no cluster; raises on the first problem found."""
    check_picklable(graph)
    if resources is not None and resources.pools:
        check_pools(graph, resources)
        env_workers = sum(p.workers for p in resources.pools if _carries(p, CPU_ENV))
        check_lockstep(graph, env_workers, resources.source)


def _carries(pool, tag: str) -> bool:
    return pool.tag == tag or pool.extra_tags.get(tag, 0) > 0


def check_pools(graph: Graph, resources: Resources) -> None:
    """Every tag the graph needs is on a declared pool with at least one worker."""
    src = resources.source
    for tag in graph.needs():
        pools = [p for p in resources.pools if _carries(p, tag)]
        if not pools:
            declared = sorted({p.tag for p in resources.pools})
            hint = "" if tag in ALL_TAGS else (
                f"; {tag!r} is not one of rollart's tags {list(ALL_TAGS)}: check the "
                f"spelling in Rollout.inference_pools of graph {graph.name!r}")
            raise ResourceTagError(
                f"graph {graph.name!r} needs resource tag {tag!r} but no pool in {src} "
                f"carries it (declared tags: {declared}){hint}. Add "
                f"Pool(name=..., tag={tag!r}, kind=..., workers=1) to {src}")
        if sum(p.workers for p in pools) < 1:
            names = [p.name for p in pools]
            raise ResourceTagError(
                f"graph {graph.name!r} needs resource tag {tag!r}, but its pool(s) {names} "
                f"in {src} have workers=0; set workers ≥ 1 (a required pool cannot be empty)")


def check_picklable(graph: Graph) -> None:
    """Each task's ``env_factory`` and ``reward_fn`` survive Dask's serialisation."""
    import cloudpickle

    for task in graph.tasks:
        for field in ("env_factory", "reward_fn"):
            fn = getattr(task, field)
            try:
                cloudpickle.dumps(fn)
            except Exception as e:
                raise GraphError(
                    f"task {task.name!r}: {field} {fn!r:.80} cannot be pickled "
                    f"({type(e).__name__}: {e}); it runs on other Dask workers, so make it "
                    "a module-level function or a class whose attributes pickle (open "
                    "files, locks, sockets and clients do not: create them lazily inside "
                    "the call)") from None


def check_lockstep(graph: Graph, env_workers: int, source: str = "the cluster") -> None:
    """In ``sync``/``one-off`` a batch moves turn by turn, so all its members on one env
    manager must run at once: at most ``Rollout.env_concurrency`` of them."""
    if graph.mode == "async" or env_workers < 1:
        return
    algo = graph.algo
    per_manager = math.ceil(algo.groups_per_step / env_workers) * algo.group_size
    limit = graph.rollout.env_concurrency
    if per_manager > limit:
        raise GraphError(
            f"graph {graph.name!r} ({graph.mode} mode) runs a batch of {algo.groups_per_step}"
            f" groups × group_size {algo.group_size} in lockstep over {env_workers} env "
            f"worker(s) in {source}: {per_manager} members per env manager, more than "
            f"Rollout.env_concurrency={limit}. Lower GRPO.group_size or groups_per_step, "
            f"raise env_concurrency to ≥ {per_manager}, or add CPU_ENV workers")
