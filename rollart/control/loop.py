"""The control loop: start the actors a graph needs, keep rollout running, step the trainer.

::

    driver (this module)                         Dask cluster (tagged workers)
    ───────────────────                          ─────────────────────────────
    load_resources → cluster ─ check_tags ─────► H800 / H20: InferenceWorker (torch engine)
    load_graph → model folder (tiny + warm-up)   CPU_ENV:    EnvManager ×n
    Stages.start (rollart.control.stages) ─────────────► BUFFER:     SampleBuffer (off the env pool)
    (async) managers take groups ◄──────────── SampleBuffer.acquire: a slot frees → a group
                                               EnvManager: per trajectory, no barrier:
                                                   reset → LLMProxy.generate → step → …
                                                   → reward (REWARD) → buffer.put
    step loop ───── train_step(step) ──────────► TRAIN: Trainer pulls ≤alpha-stale groups
                                                   (taken), GRPO update, WeightStore.put(v+1),
                                                   buffer.mark_trained(step)
                    WeightStore ◄──────────────  inference workers watch the store: prefetch
                                                   v+1, swap at the next decode step,
                                                   recompute KV

How rollout and training interleave (async / one-off / sync) is ``rollart.control.modes``.
Backpressure (async) is the buffer's: ``max(alpha, 1) * groups_per_step`` slots
(``rollart.policy.admission``), so rollout leads the trainer by no more than the staleness
bound; the lockstep modes launch their batches from here. The driver only moves small
summaries; tokens, rewards and weights stay on the workers.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rollart.env.corpus import chat_corpus
from rollart.env.tasks import task_corpus
from rollart.config.graph import Graph, load_graph
from rollart.observe.monitor import Monitor
from rollart.model import build_tiny_model, check_model_folder
from rollart.control.modes import make_pipeline
from rollart.config.preflight import preflight
from rollart.control.supervisor import Supervisor
from rollart.runtime.resources import Resources, load_resources
from rollart.reward.offload import is_serverless
from rollart.control.stages import Actors, Stages
from rollart.runtime.waits import Bounded, bounded
from rollart.types import EVAL_SEED_BASE

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: str
    metrics: list[dict]
    model_dir: str
    warmup_model_dir: str | None
    evaluation: dict | None = None
    recovery: list = field(default_factory=list)  # lost actors replaced (rollart.control.supervisor)
    final_counts: dict = field(default_factory=dict)  # the ledger after shutdown
    #: where the run's wall time went, in seconds (``timings.json``): ``total_s``,
    #: ``warmup_s``, ``rl_s`` and ``rl_steps`` (this session's), ``evaluation_s``, and
    #: ``other_s`` (cluster and actor start-up, first weights, saving)
    timings: dict = field(default_factory=dict)


def new_run_dir(base: str | Path = "runs", name: str = "run") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(base) / f"{name}-{stamp}"
    i = 1
    while path.exists():
        path, i = Path(base) / f"{name}-{stamp}-{i}", i + 1
    return path


@contextmanager
def connect(resources: Resources | None, client=None, progress: bool = False):
    """Yield a client: the given one, a new cluster from pools, or a scheduler address.
    ``progress``: say so while the cluster starts (``rollart.observe.progress``)."""
    from distributed import Client

    from rollart.observe.progress import cluster_bar, phase

    if client is not None:
        yield client
        return
    if resources.address:
        with phase(f"connecting to {resources.address}", progress):
            c = Client(resources.address, security=resources.security)
        with c:
            yield c
        return
    n = sum(p.workers for p in resources.pools)
    tags = ", ".join(f"{p.tag}×{p.workers}" for p in resources.pools)
    with phase(f"starting a local Dask cluster ({n} workers: {tags})", progress):
        with cluster_bar(n, progress):
            cluster = resources.make_cluster()
    with cluster, Client(cluster) as c:
        yield c


def prepare_model(graph: Graph, run_dir: Path, model: str | None) -> tuple[str, bool]:
    """The model folder to train and whether it needs the format warm-up."""
    path = model or graph.policy.model
    if path:
        check_model_folder(path)
        return str(path), False
    # a chat graph gets the chat toy (byte-level BPE + ChatML template, trained on the
    # tasks' own text); otherwise the word-level toy built from the tasks' vocabularies
    chat = graph.policy.conversation == "chat"
    corpus = chat_corpus(graph.tasks) if chat else task_corpus(graph.tasks)
    out = build_tiny_model(str(run_dir / "init_model"), corpus, chat=chat, seed=graph.seed)
    return out, graph.policy.warmup_total_steps > 0


def start_actors(client, graph: Graph, model_path: str, run_dir: Path,
                 store_url: str | None = None) -> Actors:
    """Place every role of ``graph`` (``rollart.control.stages``) and return the ``Actors``."""
    return Stages(client, graph, model_path, run_dir, store_url=store_url).start()


def train(graph: Graph | str | None = None, resources: Resources | str | None = None, *,
          steps: int | None = None, model: str | None = None, seed: int | None = None,
          alpha: int | None = None, mode: str | None = None,
          run_dir: str | Path | None = None, client=None, progress: bool = True,
          eval_seeds: int = 64, resume: str | Path | None = None, weights: str | None = None,
          checkpoint_url: str | None = None, checkpoint_every: int | None = None,
          overwrite: bool = False, overrides: list[str] | None = None,
          report_to: str | list[str] | None = None) -> RunResult:
    """Run a graph end to end and return where its outputs went.

    ``resume=RUN`` continues the run directory ``RUN`` from its newest checkpoint
    (``steps`` is then the new total). A ``run_dir`` (or ``weights`` store) that already
    holds another run is refused (``RunDirError``) unless ``overwrite=True``, which
    deletes that run's outputs first. ``weights``: ``"fsspec"`` (default),
    ``"mooncake"`` (a local master) or a store URL. Checkpoints go to
    ``checkpoint_url`` (default ``RUN/checkpoints``) every ``checkpoint_every`` steps
    and at the end (see ``rollart.control.checkpoint``). ``overrides``: ``["algo.lr=1e-4", ...]``
    (``rollart.config.overrides``, what ``--set`` gives), applied to the graph before the flags;
    ``report_to``: ``"tensorboard,mlflow,wandb"`` or a list (``rollart.observe.trackers``).

    >>> # from rollart import train
    >>> # result = train("gridnav", steps=20)      # local tagged cluster, tiny model
    """
    from rollart.control import checkpoint
    from rollart.config.preflight import (RunDirError, check_checkpoints, check_cluster_tags,
                                   check_run_dir, check_weight_store)

    started = time.time()
    ckpt = None
    if resume is not None:
        if overwrite:
            raise RunDirError(f"resume={resume} continues that run, overwrite=True would "
                              "delete it: pass one of them")
        run_dir = Path(resume)
        ckpt = checkpoint.for_resume(run_dir, checkpoint_url)
        graph, graph_src = checkpoint.graph_from(ckpt, graph), ckpt.graph.get("source")
    else:
        graph, graph_src = load_graph(graph)
    from rollart.config.overrides import apply_overrides, check_flags
    from rollart.observe.trackers import make_trackers

    check_flags(overrides, steps=steps, seed=seed, alpha=alpha, mode=mode,
                checkpoint_every=checkpoint_every)
    graph = override(apply_overrides(graph, overrides), steps=steps, seed=seed,
                     alpha=alpha, mode=mode, checkpoint_every=checkpoint_every)
    trackers = make_trackers(report_to)  # a missing package fails here, before a cluster
    res = load_resources(resources) if client is None or resources is not None else None
    preflight(graph, res)  # bad input fails here, before a cluster or a model is made
    run_dir = Path(run_dir) if run_dir else new_run_dir(name=graph.name)
    if ckpt is None:  # another run's weights, samples and metrics would mix with ours
        check_run_dir(run_dir, overwrite)
        check_weight_store(weights, overwrite)
        check_checkpoints(checkpoint_url, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "graph.json").write_text(json.dumps(
        {"source": graph_src, **graph.to_dict()}, indent=2, default=str))
    if ckpt is not None:
        model_path, warm = ckpt.model_dir, False
    else:
        from rollart.observe.progress import phase

        with phase("preparing the model", progress and not (model or graph.policy.model)):
            model_path, warm = prepare_model(graph, run_dir, model)
    checkpoint_url = checkpoint_url or checkpoint.default_url(run_dir)
    checkpoint.record_url(run_dir, checkpoint_url)
    source = res.source if res else "the cluster you connected"
    from rollart.weights import store_url

    with connect(res, client, progress) as c, store_url(weights, run_dir) as weights_url:
        check_cluster_tags(c, graph, source)
        if progress and c.dashboard_link:
            print(f"Dask dashboard: {c.dashboard_link}")
        return run_loop(c, graph, run_dir, model_path, warm, progress=progress,
                        eval_seeds=eval_seeds, resources_source=source,
                        store_url=weights_url, ckpt=ckpt, checkpoint_url=checkpoint_url,
                        graph_source=graph_src, trackers=trackers, started=started)


def override(graph: Graph, **changes) -> Graph:
    """A copy of ``graph`` with CLI overrides (``None`` = keep). An unset ``GRPO.alpha``
    follows the (new) mode; a set one that contradicts it is a ``GraphError``
    (``rollart.config.graph.resolve_alpha``)."""
    from dataclasses import replace

    changes = {k: v for k, v in changes.items() if v is not None}
    algo = graph.algo
    if "alpha" in changes:
        algo = replace(algo, alpha=changes.pop("alpha"))
    return replace(graph, algo=algo, **changes)  # Graph re-validates and resolves alpha


def task_modules(graph: Graph) -> list[str]:
    """``rollart`` and the modules defining each task's env and reward function."""
    mods = {"rollart"}
    for t in graph.tasks:
        for obj in (t.env_factory, t.reward_fn, getattr(t.reward_fn, "fn", None)):
            mod = getattr(obj, "__module__", None)
            if isinstance(mod, str) and mod != "__main__":
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


def run_loop(client, graph: Graph, run_dir: Path, model_path: str, warm: bool, *,
             progress: bool, eval_seeds: int, resources_source: str,
             store_url: str | None = None, ckpt=None, checkpoint_url: str | None = None,
             graph_source: str | None = None, trackers=None,
             started: float | None = None) -> RunResult:
    """Start actors, warm up, then alternate: keep groups flowing, step the trainer.
    ``trackers`` (``rollart.observe.trackers.Trackers``) get every metrics row as it is logged;
    ``started`` (``time.time()``) is when the run began, for ``RunResult.timings``."""
    from rollart.control import checkpoint
    from rollart.observe.progress import phase
    from rollart.observe.samples import SampleFeed
    from rollart.observe.trackers import Trackers
    from rollart.observe.report import MetricsLog, plot_rewards
    from rollart.reward.elastic import start_pools

    trackers = trackers if trackers is not None else Trackers([])
    started = time.time() if started is None else started
    times = {"warmup_s": 0.0, "rl_s": 0.0, "rl_steps": 0, "evaluation_s": 0.0}
    stages = Stages(client, graph, model_path, run_dir, store_url=store_url)
    with phase("starting the actors (trainer, sample buffer, inference workers, env "
               "managers)", progress):
        actors = stages.start()
    (run_dir / "placement.json").write_text(json.dumps(
        {"resources": resources_source, **actors.placement}, indent=2))
    warmup_dir = None
    if ckpt is not None:  # continue: trainer and buffer state; no warm-up
        checkpoint.restore(ckpt, actors)
        if (run_dir / "warmup_model").is_dir():
            warmup_dir = str(run_dir / "warmup_model")
    elif warm:
        t_warm = time.time()
        warmup_dir = _warm_up(actors, stages, graph, run_dir, progress)
        times["warmup_s"] = time.time() - t_warm
    with phase("loading the first weights on the inference workers", progress):
        _first_weights(actors, stages)
    pipeline = make_pipeline(actors, graph)
    pipeline.supervisor = Supervisor(stages, actors, checkpoint_url=checkpoint_url)
    log = MetricsLog(run_dir / "metrics.jsonl")
    pools = start_pools(client, [t.reward_fn for t in graph.tasks])  # serverless rewards
    preload(client, graph)
    first, t_start = 1, time.time()
    if ckpt is not None:  # the curve continues: counters, group sequence, time axis
        pipeline.load_state(ckpt.state["pipeline"])
        log.rows = checkpoint.truncate_metrics(run_dir / "metrics.jsonl", ckpt.step)
        first, t_start = ckpt.step + 1, t_start - ckpt.state.get("elapsed", 0.0)
    monitor = Monitor(client, actors, graph, run_dir.name)  # live figures -> dashboard
    feed = SampleFeed(client, run_dir, model_path, graph)  # decoded trajectories -> page
    trackers.start(run_dir, run_dir.name, {
        "graph": {"source": graph_source, **graph.to_dict()},
        "resources": {"source": resources_source, **actors.placement}})
    running, t_rl = True, time.time()
    try:
        bar = _progress(graph.steps, progress)
        bar.update(first - 1)
        for step in range(first, graph.steps + 1):
            metrics = _step_metrics(client, pipeline, step, run_dir, pools, t_start)
            running = monitor.step(metrics)  # False once rollart.observe.metrics.request_stop(run)
            log.write(metrics)
            trackers.log_step(step, metrics)
            feed.maybe_publish()
            if step == graph.steps or (graph.checkpoint_every and
                                       step % graph.checkpoint_every == 0):
                checkpoint.save(checkpoint_url or checkpoint.default_url(run_dir), step,
                                actors, pipeline=pipeline,
                                graph={"source": graph_source, **graph.to_dict()},
                                resources={"source": resources_source, **actors.placement},
                                elapsed=metrics["time"])
            bar.update(1)
            times["rl_steps"] += 1
            bar.set_postfix_str(" ".join(f"{k[7:]}={v:.2f}" for k, v in metrics.items()
                                         if k.startswith("reward/") and k != "reward/mean"))
            if not running:
                break
        bar.close()
        times["rl_s"] = time.time() - t_rl
        model_dir = bounded(actors.trainer.save(str(run_dir / "model")), stages.waits.call,
                            f"the trainer on {actors.trainer._address} did not save the "
                            "model")
    except BaseException:
        trackers.finish(status="failed")
        raise
    finally:
        monitor.close()
        final_counts = _shutdown(actors)
        for pool in pools:
            pool.stop()
        events = pipeline.supervisor.events
        (run_dir / "recovery.json").write_text(json.dumps(events, indent=2))
    plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
    feed.maybe_publish(force=True)
    trackers.finish(str(run_dir / "reward.png"), "finished" if running else "stopped")
    result = RunResult(str(run_dir), log.rows, model_dir, warmup_dir, recovery=events,
                       final_counts=final_counts)
    if eval_seeds:
        t_eval = time.time()
        with phase(f"held-out evaluation ({eval_seeds} seeds per task)", progress):
            result.evaluation = _evaluate_run(graph, result, eval_seeds)
        (run_dir / "eval.json").write_text(json.dumps(result.evaluation, indent=2))
        times["evaluation_s"] = time.time() - t_eval
    times["total_s"] = time.time() - started
    times["other_s"] = times["total_s"] - times["warmup_s"] - times["rl_s"] - times[
        "evaluation_s"]
    result.timings = {k: round(v, 2) for k, v in times.items()}
    (run_dir / "timings.json").write_text(json.dumps(result.timings, indent=2))
    return result


def _warm_up(actors: Actors, stages: Stages, graph: Graph, run_dir: Path,
             progress: bool) -> str:
    """The built-in model's format warm-up on the trainer (``Trainer.warmup``, bounded by
    ``Waits.warmup``), saved to ``RUN/warmup_model``; returns that folder."""
    from rollart.observe.progress import warmup_bar

    p = graph.policy
    total = p.warmup_total_steps
    waits, on = stages.waits, f"on {actors.trainer._address}"
    info = warmup_bar(actors.trainer, Bounded(actors.trainer.warmup(
        graph.tasks, p.warmup_steps, p.warmup_batch, p.warmup_lr, seed=graph.seed,
        threads=p.warmup_threads, bare_tool_steps=p.warmup_bare_tool_steps,
        episode_threads=p.warmup_episode_threads,
        **p.conversation_options()), waits.warmup(total),
        f"the trainer's warm-up ({total} steps) {on} did not finish",
        "warmup-step"), total, progress)
    warmup_dir = bounded(actors.trainer.save(str(run_dir / "warmup_model")),
                         waits.call, f"the trainer {on} did not save the warm-up model")
    bare = (f" ({p.warmup_bare_tool_steps} of them on the tool tasks, tools undeclared)"
            if p.warmup_bare_tool_steps else "")
    print(f"warm-up: {total} format steps{bare}, loss {info['warmup/loss_first']:.3f}"
          f" -> {info['warmup/loss_last']:.3f}")
    return warmup_dir


def _first_weights(actors: Actors, stages: Stages) -> None:
    """The trainer publishes its weights; every inference worker loads them."""
    v0 = bounded(actors.trainer.publish(), stages.waits.call, f"the trainer on "
                 f"{actors.trainer._address} did not publish its first weights")
    for call in ("update_weights", "wait_version"):
        for w, tag, addr in actors.workers:
            bounded(getattr(w, call)(v0), stages.waits.call, f"the InferenceWorker "
                    f"on {addr} ({tag}) did not load weights v{v0} ({call})")


def _step_metrics(client, pipeline, step: int, run_dir: Path, pools: list,
                  t_start: float) -> dict:
    """One pipeline step (``_step``) and its metrics row: the ledger's counts, rollout
    figures, serverless reward pools, recovery counters and ``time`` since ``t_start``."""
    from rollart.reward.elastic import reward_metrics

    graph, actors = pipeline.graph, pipeline.actors
    metrics = _step(client, pipeline, step, run_dir)
    metrics.update(pipeline.counts())
    metrics.update(pipeline.rollout_stats())
    if pools or any(is_serverless(t.reward_fn) for t in graph.tasks):
        metrics.update(reward_metrics(client, pools, actors.managers))
    metrics["recovery/actors_replaced"] = len(pipeline.supervisor.events)
    metrics["recovery/groups_restarted"] = pipeline.restarted_groups
    metrics["rollout/groups_refilled"] = pipeline.refilled_groups
    metrics["time"] = time.time() - t_start
    return metrics


def _step(client, pipeline, step: int, run_dir: Path) -> dict:
    """One pipeline step; losing the scheduler ends the run with how to resume it."""
    from rollart.control.supervisor import RunLostError

    try:
        return pipeline.step(step)
    except (OSError, RuntimeError) as e:
        if client.status in ("running", "connecting") and not isinstance(e, OSError):
            raise
        if client.status in ("running", "connecting") and _scheduler_alive(client):
            raise
        raise RunLostError(
            f"lost the Dask scheduler during step {step} ({type(e).__name__}: {e}); the run "
            f"cannot continue on this cluster. Restart the scheduler and resume with "
            f"`rollart train --resume {run_dir}` (from its last checkpoint)") from e


def _scheduler_alive(client) -> bool:
    try:
        client.sync(client.scheduler.identity, n_workers=0, callback_timeout=10)
        return True
    except Exception:
        return False


def _shutdown(actors: Actors) -> dict:
    """Cancel what is still running and flush the buffer to Parquet; return the
    ledger's final counts. Once the live managers have settled their members, what is
    still in flight ran on a lost worker: it becomes ``failed`` (``orphaned``).

    A manager or worker that cannot be closed (its worker died) is reported and skipped
    so the samples still get flushed.
    """
    for actor in actors.managers:
        _close(actor, "env manager")
    try:
        actors.buffer.orphan_all_in_flight().result(timeout=60)  # ran on lost managers
        counts = actors.buffer.counts().result(timeout=60)
    except Exception as e:  # the buffer's worker (or the scheduler) is gone
        logger.warning("could not read the final counts: %s: %s", type(e).__name__, e)
        counts = {}
    _close(actors.buffer, "sample buffer", timeout=600)
    for w, tag, addr in actors.workers:
        _close(w, f"inference worker {tag} at {addr}")
    return counts


def _close(actor, what: str, timeout: float = 30) -> None:
    try:
        actor.close().result(timeout=timeout)
    except Exception as e:
        logger.warning("could not close %s: %s: %s", what, type(e).__name__, e)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollart", unit="step", disable=not enabled)


def _evaluate_run(graph: Graph, result: RunResult, n_seeds: int) -> dict:
    """Success rate per task of the warm-up policy and the trained one, held-out seeds."""
    from rollart.observe.evaluate import evaluate

    seeds = range(EVAL_SEED_BASE, EVAL_SEED_BASE + n_seeds)
    opts = graph.policy.conversation_options()
    out = {"seeds": n_seeds, "trained": evaluate(result.model_dir, graph.tasks, seeds, **opts)}
    if result.warmup_model_dir:
        out["warmup"] = evaluate(result.warmup_model_dir, graph.tasks, seeds, **opts)
    return out
