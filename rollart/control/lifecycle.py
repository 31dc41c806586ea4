"""A run's start and end: the actors placed, a checkpoint restored or the model warmed
up, the first weights on every inference worker, the serverless reward pools started and
the tasks' modules imported on every worker; at the end, every actor closed and the
buffer flushed.

Consumes a run's ``Stages`` (``rollart.control.stages``); produces its ``Fleet``
(``rollart.control.fleet``), the warm-up model folder (``RUN/warmup_model``) and
``placement.json``. Called by the control loop (``rollart.control.loop.run_loop``) and by
tests that place a graph's actors without running it.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from rollart.config.graph import Graph
from rollart.control.door import Door
from rollart.control.fleet import Fleet
from rollart.control.stages import Actors, Stages
from rollart.env.tasks import warmup_tasks
from rollart.observe.metrics import stop_requested
from rollart.runtime.resources import CONFIG_MODULE_PREFIX
from rollart.runtime.waits import Bounded

logger = logging.getLogger(__name__)


def start_actors(client, graph: Graph, model_path: str, run_dir: Path,
                 store_url: str | None = None) -> Actors:
    """Place every role of ``graph`` (``rollart.control.stages``) and return the ``Actors``."""
    return Stages(client, graph, model_path, run_dir, store_url=store_url).start()


def task_modules(graph: Graph) -> list[str]:
    """``rollart`` and the modules defining each task's env and reward function, less
    ``__main__`` and a graph file loaded from its path (``CONFIG_MODULE_PREFIX``): no
    worker can import those by name, and what they define travels pickled by value."""
    mods = {"rollart"}
    for t in graph.tasks:
        for obj in (t.env_factory, t.reward_fn, getattr(t.reward_fn, "fn", None)):
            mod = getattr(obj, "__module__", None)
            if isinstance(mod, str) and mod != "__main__" and not mod.startswith(
                    CONFIG_MODULE_PREFIX):
                mods.add(mod)
    return sorted(mods)


def _import_modules(modules: list[str]) -> list[str]:
    import importlib

    failed = []
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - a worker that can't: its tasks will say why
            failed.append(f"{m}: {type(e).__name__}: {e}")
    return failed


def preload(client, graph: Graph) -> None:
    """Import ``task_modules`` on every worker before the run's clock starts.

    ``import rollart`` takes seconds in a fresh worker process (torch, transformers);
    without this the first reward task on the reward pool paid it inside step 1, and
    so did whichever mode ran first on a new cluster in a side-by-side benchmark. An
    import that fails is logged here and left to the tasks that need it to report."""
    out = client.run(_import_modules, task_modules(graph), on_error="return")
    for addr, failed in out.items():
        if isinstance(failed, BaseException):
            logger.warning("preload on %s failed: %r", addr, failed)
        elif failed:
            logger.warning("preload on %s: %s", addr, "; ".join(failed))


def start(stages: Stages, ckpt, warm: bool, checkpoint_url: str | None,
          resources_source: str, progress: bool, clock) -> tuple[Fleet, str | None, list]:
    """Place the actors (``placement.json``), restore a checkpoint or warm up, load the
    first weights everywhere, start the serverless reward pools and import the tasks'
    modules on every worker; returns the run's ``Fleet``, the warm-up model folder and
    the reward pools. ``clock`` times the warm-up (``warmup_s``)."""
    from rollart.control import checkpoint
    from rollart.observe.progress import phase
    from rollart.reward.elastic import start_pools

    run_dir = stages.run_dir
    with phase("starting the actors (trainer, sample buffer, inference workers, env "
               "managers)", progress):
        fleet = Fleet(stages.start(), stages, checkpoint_url=checkpoint_url)
    actors = fleet.actors
    warmup_dir = None
    if ckpt is not None:  # continue: trainer and buffer state; no warm-up
        checkpoint.restore(ckpt, actors)
        if (run_dir / "warmup_model").is_dir():
            warmup_dir = str(run_dir / "warmup_model")
    elif warm:
        with clock.timing("warmup_s"):
            warmup_dir = warm_up(fleet, stages, run_dir, progress)
    with phase("loading the first weights on the inference workers", progress):
        v0 = fleet.call(actors.trainer, "publish", timeout=stages.waits.call, stuck=f"the "
                        f"trainer on {actors.trainer._address} did not publish its first weights")
        fleet.catch_up(v0)
    # a gang formed as it published: every rank's worker is known now
    actors.set_ranks(fleet.call(actors.trainer, "stats", timeout=stages.waits.call
                                ).get("ranks", [])[1:])
    (run_dir / "placement.json").write_text(json.dumps(
        {"resources": resources_source, **actors.placement}, indent=2))
    graph = stages.graph
    pools = start_pools(stages.client, [t.reward_fn for t in graph.tasks])
    preload(stages.client, graph)
    return fleet, warmup_dir, pools


def warm_up(fleet: Fleet, stages: Stages, run_dir: Path, progress: bool) -> str:
    """The built-in model's format warm-up (or a pretrained model's demonstrations,
    ``Policy.warmup_pretrained``) on the trainer (``Trainer.warmup``, bounded by
    ``Waits.warmup``; ended early by ``Run.stop``), saved to ``RUN/warmup_model``;
    returns that folder."""
    from rollart.observe.progress import warmup_bar

    graph, p, trainer = stages.graph, stages.graph.policy, fleet.actors.trainer
    total = p.warmup_total_steps
    waits, on = stages.waits, f"on {trainer._address}"
    tasks = [t for t in warmup_tasks(graph.tasks)
             if not p.warmup_tasks or t.name in p.warmup_tasks]
    info = warmup_bar(trainer, Bounded(fleet.submit(
        trainer, "warmup", tasks, p.warmup_steps, p.warmup_batch, p.warmup_lr, seed=graph.seed,
        threads=p.warmup_threads, bare_tool_steps=p.warmup_bare_tool_steps,
        episode_threads=p.warmup_episode_threads,
        obs_weight=0.0 if p.warmup_pretrained else 1.0,  # a pretrained model: its turns
        **p.conversation_options()), waits.warmup(total),
        f"the trainer's warm-up ({total} steps) {on} did not finish",
        "warmup-step"), total, progress, stop=functools.partial(stop_requested, run_dir.name))
    warmup_dir = fleet.call(trainer, "save", str(run_dir / "warmup_model"), timeout=waits.call,
                            stuck=f"the trainer {on} did not save the warm-up model")
    bare = (f" ({p.warmup_bare_tool_steps} of them on the tool tasks, tools undeclared)"
            if p.warmup_bare_tool_steps else "")
    done = info["warmup/steps"]  # fewer once the run was asked to stop
    kind = "demonstration" if p.warmup_pretrained else "format"
    print(f"warm-up: {done if done == total else f'stopped after {done} of {total}'} "
          f"{kind} steps{bare}, loss {info['warmup/loss_first']:.3f}"
          f" -> {info['warmup/loss_last']:.3f}")
    return warmup_dir


def shutdown(actors: Actors, pools: list = (), door: Door | None = None) -> dict:
    """Cancel what is still running and flush the buffer to Parquet, stop the reward
    ``pools``; return the ledger's final counts. Once the live managers have settled their members, what is
    still in flight ran on a lost worker: it becomes ``failed`` (``orphaned``).

    A manager or worker that cannot be closed (its worker died) is reported and skipped
    so the samples still get flushed. Every call goes through ``door`` (the run's
    ``Fleet``; by default a ``Door`` without a view).
    """
    door = door or Door()
    for actor in actors.managers:
        _close(door, actor, "env manager")
    try:
        door.call(actors.buffer, "orphan_all_in_flight", timeout=60)  # ran on lost managers
        counts = door.call(actors.buffer, "counts", timeout=60)
    except Exception as e:  # the buffer's worker (or the scheduler) is gone
        logger.warning("could not read the final counts: %s: %s", type(e).__name__, e)
        counts = {}
    _close(door, actors.buffer, "sample buffer", timeout=600)
    for w, tag, addr in actors.workers:
        _close(door, w, f"inference worker {tag} at {addr}")
    for pool in pools:
        pool.stop()
    return counts


def _close(door: Door, actor, what: str, timeout: float = 30) -> None:
    try:
        door.call(actor, "close", timeout=timeout)
    except Exception as e:
        logger.warning("could not close %s: %s: %s", what, type(e).__name__, e)
