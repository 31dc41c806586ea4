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

How rollout and training interleave (async / one-off / sync) is ``rollart.control.modes``;
every call the driver makes on an actor goes through the run's ``Fleet``
(``rollart.control.fleet``), which knows what is lost and owns the supervisor.
Backpressure (async) is the buffer's: ``max(alpha, 1) * groups_per_step`` slots
(``rollart.policy.admission``; with ``Rollout.max_in_flight="auto"`` re-decided after
each step by the pipeline's ``adapt``), so rollout leads the trainer by no more than the
staleness bound; the lockstep modes launch their batches from here. The driver only moves
small summaries; tokens, rewards and weights stay on the workers.

``train`` = ``prepare`` (every check that needs no cluster: graph, overrides, resources,
run directory; ``rollart.start_run`` calls it before its thread starts) + ``execute``
(the model folder, the cluster, ``run_loop``).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rollart.config.graph import Graph
from rollart.control.fleet import Fleet
from rollart.control.lifecycle import shutdown, start
from rollart.control.modes import make_pipeline
from rollart.control.prepare import Prepared, connect, model_folder, prepare
from rollart.control.stages import Stages
from rollart.env.tasks import is_agent_task
from rollart.observe.figures import step_row
from rollart.observe.metrics import stop_requested
from rollart.observe.monitor import Monitor
from rollart.observe.silent import SilentTasks
from rollart.reward.offload import is_serverless
from rollart.runtime.resources import Resources
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
    prep = prepare(graph, resources, client=client, steps=steps, seed=seed, alpha=alpha,
                   mode=mode, run_dir=run_dir, resume=resume, weights=weights,
                   checkpoint_url=checkpoint_url, checkpoint_every=checkpoint_every,
                   overwrite=overwrite, overrides=overrides, report_to=report_to)
    return execute(prep, client=client, model=model, weights=weights, progress=progress,
                   eval_seeds=eval_seeds)


def execute(prep: Prepared, *, client=None, model: str | None = None,
            weights: str | None = None, progress: bool = True,
            eval_seeds: int = 64) -> RunResult:
    """Run what ``prepare`` checked: the model folder (``model_folder``), the cluster,
    ``run_loop``."""
    from rollart.config.preflight import check_cluster_tags
    from rollart.weights import store_url

    graph, run_dir = prep.graph, prep.run_dir
    model_path, warm = model_folder(prep, model, progress)
    source = prep.resources.source if prep.resources else "the cluster you connected"
    with connect(prep.resources, client, progress) as c, \
            store_url(weights, run_dir) as weights_url:
        check_cluster_tags(c, graph, source, model_path)
        if progress and c.dashboard_link:
            print(f"Dask dashboard: {c.dashboard_link}")
        return run_loop(c, graph, run_dir, model_path, warm, progress=progress,
                        eval_seeds=eval_seeds, resources_source=source,
                        store_url=weights_url, ckpt=prep.ckpt,
                        checkpoint_url=prep.checkpoint_url, graph_source=prep.graph_source,
                        trackers=prep.trackers, started=prep.started)


def run_loop(client, graph: Graph, run_dir: Path, model_path: str, warm: bool, *,
             progress: bool, eval_seeds: int, resources_source: str,
             store_url: str | None = None, ckpt=None, checkpoint_url: str | None = None,
             graph_source: str | None = None, trackers=None,
             started: float | None = None) -> RunResult:
    """Start actors, warm up, then alternate: keep groups flowing, step the trainer.
    ``trackers`` (``rollart.observe.trackers.Trackers``) get every metrics row as it is logged;
    ``started`` (``time.time()``) is when the run began, for ``RunResult.timings``."""
    from rollart.control import checkpoint
    from rollart.observe.report import MetricsLog, plot_rewards
    from rollart.observe.trackers import Trackers

    trackers, clock = trackers if trackers is not None else Trackers([]), _Timings(started)
    stages = Stages(client, graph, model_path, run_dir, store_url=store_url)
    fleet, warmup_dir, pools = start(stages, ckpt, warm, checkpoint_url, resources_source,
                                      progress, clock)
    pipeline, log = make_pipeline(fleet, graph), MetricsLog(run_dir / "metrics.jsonl")
    first, t_start = _resume(pipeline, log, ckpt, run_dir)
    rows = _Rows(client, fleet, graph, run_dir, model_path, log, trackers)
    record = {"graph": {"source": graph_source, **graph.to_dict()},
              "resources": {"source": resources_source, **fleet.actors.placement}}
    trackers.start(run_dir, run_dir.name, record)
    save_to, running = checkpoint_url or checkpoint.default_url(run_dir), True
    last = {"step": first - 1, "time": 0.0}  # the last step done (for a stop short of TRAIN)
    steps = _steps(client, pipeline, first, run_dir, pools, t_start, progress,
                   rows.monitor.scaled)  # a generator: runs as it is iterated
    try:
        with clock.timing("rl_s"), closing(steps), \
                _short_of_train(fleet, pipeline, save_to, run_dir, last, record):
            for row, sample in steps:
                last.update(step=row["step"], time=row["time"])
                running = rows.add(row, sample)  # False once request_stop(run)
                clock.times["rl_steps"] += 1
                if _checkpoint_due(graph, row["step"]):
                    checkpoint.save(save_to, row["step"], fleet.actors, pipeline=pipeline,
                                    elapsed=row["time"], **record)
                if not running:
                    break
        running = running and not stop_requested(run_dir.name)  # stopped before step 1
        model_dir = _save_model(fleet, stages, run_dir)
        fleet.supervisor.settle()  # a loss late in the run in recovery.json too
    except BaseException:
        trackers.finish(status="failed")
        raise
    finally:
        final_counts = _close(fleet, rows.monitor, pipeline, pools, run_dir)
    if log.rows:  # none when stopped before the first step (e.g. in the warm-up)
        plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
    rows.feed.maybe_publish(force=True)
    trackers.finish(str(run_dir / "reward.png"), "finished" if running else "stopped")
    result = RunResult(str(run_dir), log.rows, model_dir, warmup_dir,
                       recovery=fleet.supervisor.events, final_counts=final_counts)
    return _finish(result, graph, eval_seeds, progress, clock)


class _Rows:
    """Where each step's metrics row goes as the step is done: the live figures
    (``Monitor``: it also says whether the run was asked to stop), the notices of tasks
    gone silent, ``metrics.jsonl``, the trackers and the page of decoded samples."""

    def __init__(self, client, fleet: Fleet, graph: Graph, run_dir: Path, model_path: str,
                 log, trackers):
        from rollart.observe.samples import SampleFeed

        self.monitor = Monitor(client, fleet, graph, run_dir.name)  # live figures -> dashboard
        weights = graph.task_weights or [1] * len(graph.tasks)
        self.silent = SilentTasks([t for t, w in zip(graph.task_names, weights) if w > 0],
                                  graph.rollout.silent_task_steps,  # the tasks watched
                                  exempt=[t.name for t in graph.tasks if is_agent_task(t)])
        self.feed = SampleFeed(client, run_dir, model_path, graph)  # decoded trajectories
        self.log, self.trackers = log, trackers

    def add(self, row: dict, sample) -> bool:
        """Record one step's ``row``; False once the run was asked to stop."""
        running = self.monitor.step(row, sample)
        for notice in self.silent.update(row, sample.buffer.get("tasks")):
            logger.warning("%s", notice.text)
            self.monitor.notice(notice)
        self.log.write(row)
        self.trackers.log_step(row["step"], row)
        self.feed.maybe_publish()
        return running


def _checkpoint_due(graph: Graph, step: int) -> bool:
    """A checkpoint after the last step and every ``Graph.checkpoint_every`` steps."""
    return bool(step == graph.steps or graph.checkpoint_every
                and step % graph.checkpoint_every == 0)


def _save_model(fleet: Fleet, stages: Stages, run_dir: Path) -> str:
    """The trained policy as the run's ``model/`` folder (the trainer writes it)."""
    trainer = fleet.actors.trainer
    return fleet.call(trainer, "save", str(run_dir / "model"), timeout=stages.waits.call,
                      stuck=f"the trainer on {trainer._address} did not save the model")


def _close(fleet: Fleet, monitor, pipeline, pools: list, run_dir: Path) -> dict:
    """Stop the supervisor, the live figures, the pipeline and the actors, and write
    ``recovery.json``; returns the ledger's counts after shutdown."""
    fleet.supervisor.close()
    monitor.close()
    pipeline.close()  # e.g. the rollout workers' priority back
    final_counts = shutdown(fleet.actors, pools, fleet)
    (run_dir / "recovery.json").write_text(json.dumps(fleet.supervisor.events, indent=2))
    return final_counts


@contextmanager
def _short_of_train(fleet: Fleet, pipeline, url: str, run_dir: Path, last: dict,
                    record: dict):
    """A trainer gang that cannot form (``GangWaitError``: fewer TRAIN workers than its
    ranks for ``rollart.waits.start``) stops the run with a checkpoint of the last step
    done (``last``: its step and time, updated in place by the caller) and the model
    folder, then the same error with where they are and how to go on: one line (the
    CLI's exit status 2), never a traceback. The step that found too few workers
    published nothing: its batch goes back to the buffer first."""
    from rollart.control import checkpoint
    from rollart.trainer.gang_faults import GangWaitError

    try:
        yield
    except GangWaitError as e:
        trainer, step = fleet.actors.trainer, last["step"]
        version = fleet.call(trainer, "stats", timeout=60)["version"]
        pipeline.release_taken(step + 1, version)
        saved = [checkpoint.step_dir(url, step)] if step in checkpoint.steps(url) else []
        if step > 0 and not saved:
            saved = [checkpoint.save(url, step, fleet.actors, pipeline=pipeline,
                                     elapsed=last["time"], **record)]
        fleet.call(trainer, "save", str(run_dir / "model"), timeout=600)
        where = f"checkpoint {saved[0]} and " if saved else ""
        raise GangWaitError(
            f"{e}. The run stopped after step {step}: {where}{run_dir / 'model'} hold its "
            f"weights (v{version}); resume with `rollart train --resume {run_dir}` once "
            f"the TRAIN workers are back (a resumed gang has as many ranks as TRAIN "
            f"workers at its start)") from None


def _resume(pipeline, log, ckpt, run_dir: Path) -> tuple[int, float]:
    """The first step and the run's clock start; a resumed run's curve continues
    (counters, group sequence, metrics rows, time axis)."""
    from rollart.control import checkpoint

    if ckpt is None:
        return 1, time.time()
    from rollart.observe.progress import say

    pipeline.load_state(ckpt.state["pipeline"])
    log.rows = checkpoint.truncate_metrics(run_dir / "metrics.jsonl", ckpt.step)
    say(f"resumed {run_dir} from its checkpoint of step {ckpt.step} (policy version "
        f"{ckpt.version}, {ckpt.path}): training goes on from step {ckpt.step + 1}")
    return ckpt.step + 1, time.time() - ckpt.state.get("elapsed", 0.0)


class _Timings:
    """Where a run's wall time goes (``RunResult.timings``, ``timings.json``)."""

    def __init__(self, started: float | None):
        self.started = time.time() if started is None else started
        self.times = {"warmup_s": 0.0, "rl_s": 0.0, "rl_steps": 0, "evaluation_s": 0.0}

    @contextmanager
    def timing(self, key: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.times[key] += time.time() - t0

    def done(self) -> dict:
        t = dict(self.times, total_s=time.time() - self.started)
        t["other_s"] = t["total_s"] - t["warmup_s"] - t["rl_s"] - t["evaluation_s"]
        return {k: round(v, 2) for k, v in t.items()}



def _steps(client, pipeline, first: int, run_dir: Path, pools: list, t_start: float,
           progress: bool, on_scale=None):
    """Trainer steps ``first``..``graph.steps``: yields each step's metrics row and the
    sample it was made from (``Fleet.sample``: read once, after the step)."""
    from rollart.control.scaling import Scaler
    from rollart.reward.elastic import reward_metrics

    graph, fleet = pipeline.graph, pipeline.fleet
    serverless = bool(pools) or any(is_serverless(t.reward_fn) for t in graph.tasks)
    scaler = Scaler(fleet, pipeline, run_dir.name, on_scale) \
        if fleet.supervisor is not None else None
    bar = _progress(graph.steps, progress)
    bar.update(first - 1)
    try:
        for step in range(first, graph.steps + 1):
            if stop_requested(run_dir.name):  # asked before a step ran (warm-up, start-up)
                return
            if scaler is not None:  # Run.scale and Pool.adapt: pools resized between steps
                scaler.apply(step, sample if step > first else None)
            trainer = _step(client, pipeline, step, run_dir)
            sample = fleet.sample(latencies=True, timeout=None)
            pipeline.after_step(sample.buffer)  # name failing tasks, stop hopeless ones
            extra = reward_metrics(client, pools, sample.managers) if serverless else {}
            extra.update(pipeline.adapt(trainer, sample))  # async: the in-flight limit
            extra.update({"recovery/actors_replaced": len(fleet.supervisor.events),
                          "recovery/groups_restarted": pipeline.restarted_groups,
                          "rollout/groups_refilled": pipeline.refilled_groups,
                          "rollout/tasks_stopped": len(pipeline.failing.stopped)})
            row = step_row(trainer, sample, elapsed=time.time() - t_start,
                           driver_errors=len(pipeline.errors), extra=extra,
                           tasks=graph.task_names)
            bar.update(1)
            bar.set_postfix_str(" ".join(
                f"{k[7:]}={'-' if v is None else format(v, '.2f')}" for k, v in row.items()
                if k.startswith("reward/") and k != "reward/mean"))
            yield row, sample
    finally:
        bar.close()
        if scaler is not None:
            scaler.close()


def _finish(result: RunResult, graph: Graph, eval_seeds: int, progress: bool,
            clock: _Timings) -> RunResult:
    """Held-out evaluation (``eval.json``) and the run's timings (``timings.json``)."""
    from rollart.observe.progress import phase

    run_dir = Path(result.run_dir)
    if eval_seeds:
        with clock.timing("evaluation_s"), \
                phase(f"held-out evaluation ({eval_seeds} seeds per task)", progress):
            result.evaluation = _evaluate_run(graph, result, eval_seeds)
        (run_dir / "eval.json").write_text(json.dumps(result.evaluation, indent=2))
    result.timings = clock.done()
    (run_dir / "timings.json").write_text(json.dumps(result.timings, indent=2))
    return result


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
