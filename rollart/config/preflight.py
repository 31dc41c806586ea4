"""Checks a run's input before anything expensive starts (cluster, model, actors).

Consumes a validated ``Graph`` and ``Resources`` (their own ``__post_init__`` already
checked each field); produces nothing, or a ``GraphError`` / ``ResourceTagError`` /
``RunDirError`` whose message says what to change. ``rollart.control.loop.train`` (and
``rollart.app.api.start_run``) call ``preflight`` and the run-directory checks right after
loading the graph and resources, and ``check_cluster_tags`` once connected to a
cluster. What is checked here is what only shows up when the pieces meet:

* every resource tag the graph needs is carried by a declared pool with ≥ 1 worker (a
  Dask task restricted to a missing tag would wait forever);
* every task's env factory and reward function pickle (they travel to Dask workers);
* a lockstep batch (``sync`` / ``one-off``) fits the env managers' concurrency (else
  the turn barrier waits for members that can never start);
* a trainer gang's layout (``Policy.trainer_parallel``: tp x dp) makes the TRAIN
  workers, declared and live (``check_gang``);
* a new run gets a run directory, a weight store and checkpoints of its own
  (``check_run_dir``, ``check_weight_store``, ``check_checkpoints``): another run's weight
  versions outrank the new run's, so the store's garbage collection deleted each version
  the trainer published, the inference workers never loaded one and the run hung after
  two steps (and the two runs' metrics, samples and checkpoints mixed).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from rollart.policy.affinity import check_cluster, check_declared
from rollart.policy.affinity import needs as affinity_needs
from rollart.config.graph import LOCKSTEP_MODES, Graph, GraphError
from rollart.env.tasks import is_agent_task
from rollart.runtime.resources import Resources, ResourceTagError, check_tags, workers_with
from rollart.types import ALL_TAGS, CPU_ENV, TRAIN


def preflight(graph: Graph, resources: Resources | None) -> None:
    """All checks that need no cluster; raises on the first problem found. The tags are
    checked here against the declared pools, and once more by ``check_cluster_tags``
    against the workers of a running cluster: nowhere else."""
    check_picklable(graph)
    if resources is not None and resources.pools:
        check_declared(graph, resources)  # affinity tags, named by the task that asks
        check_pools(graph, resources)
        env_workers = sum(p.workers for p in resources.pools if _carries(p, CPU_ENV))
        check_lockstep(graph, env_workers, resources.source)
        train_workers = sum(p.workers for p in resources.pools if _carries(p, TRAIN))
        check_gang(graph, train_workers, resources.source)


def check_cluster_tags(client, graph: Graph, source: str,
                       model_path: str | None = None) -> None:
    """On a running cluster: every tag the graph needs is carried by a worker (affinity
    tags named by the task that asks), a lockstep batch fits its env workers, and the
    TRAIN workers make the trainer's layout (for the model at ``model_path``)."""
    check_cluster(client, graph, source)
    rest = {t: n for t, n in graph.needs().items() if t not in affinity_needs(graph)}
    check_tags(client, rest, source, needed_by=f"graph {graph.name!r}")
    check_lockstep(graph, len(workers_with(client, CPU_ENV)), source)
    check_gang(graph, len(workers_with(client, TRAIN)), source, model_path)


def check_gang(graph: Graph, ranks: int, source: str, model_path: str | None = None) -> None:
    """``ranks`` TRAIN workers are a trainer gang of that many ranks
    (``rollart.trainer.gang``), laid out by ``Policy.trainer_parallel``: data-parallel
    FSDP2 on the torch backend, tensor x data parallel on the Megatron one
    (``rollart.trainer.megatron_gang``). A layout that does not make ``ranks``, a TP size
    that does not divide the heads of the model at ``model_path``, and what a gang cannot
    do yet are a ``GraphError`` naming the numbers and the fix, before any actor starts."""
    if ranks < 1:  # no TRAIN worker: the tag checks say so
        return
    p = graph.policy
    try:
        tp, _ = p.trainer_parallel.layout(ranks, p.trainer_backend)
    except GraphError as e:
        raise GraphError(f"graph {graph.name!r} with the TRAIN workers of {source}: {e}"
                         ) from None
    if tp > 1 and model_path is not None:
        from transformers import AutoConfig

        from rollart.trainer.megatron import check_tp

        try:
            check_tp(AutoConfig.from_pretrained(str(model_path)), tp)
        except ValueError as e:
            raise GraphError(f"graph {graph.name!r}, Policy.trainer_parallel on the model "
                             f"{model_path}: {e} (--set policy.trainer_parallel.tp=...)"
                             ) from None
    if ranks > 1 and p.lora is not None:
        raise GraphError(
            f"graph {graph.name!r}: Policy.lora with {ranks} {TRAIN} workers: LoRA on a "
            f"trainer gang is not built yet; train LoRA on 1 rank, or give the trainer one "
            f"worker (Pool(tag={TRAIN!r}, workers=1) in {source})")


def _carries(pool, tag: str) -> bool:
    return pool.tag == tag or pool.extra_tags.get(tag, 0) > 0


def check_pools(graph: Graph, resources: Resources) -> None:
    """Every tag the graph needs is on a declared pool with at least one worker."""
    src = resources.source
    named = affinity_needs(graph)  # checked by check_declared
    for tag in graph.needs():
        if tag in named:
            continue
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
    """Each task's ``env_factory`` and ``reward_fn`` (an ``AgentTask``'s ``agent`` too)
    survive Dask's serialisation."""
    import cloudpickle

    for task in graph.tasks:
        for field in ("env_factory", "reward_fn") + (("agent",) if is_agent_task(task)
                                                      else ()):
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
    manager must run at once: at most ``Rollout.env_concurrency`` of them. The other
    modes run each group on its own (members beyond the limit wait their turn)."""
    if graph.mode not in LOCKSTEP_MODES or env_workers < 1:
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


class RunDirError(ValueError):
    """A run directory or weight store that another run already used; says what to do."""


# what ``rollart.train`` and the actors it starts write into a run directory; a folder
# holding any of them holds a run (the first two are written by every run)
RUN_MARKERS = ("graph.json", "metrics.jsonl")
RUN_OUTPUTS = RUN_MARKERS + (
    "placement.json", "recovery.json", "eval.json", "checkpoint_url.txt", "reward.png",
    "throughput.png", "staleness.png", "report.html", "init_model", "warmup_model",
    "model", "weights", "samples", "checkpoints", "ledger", "pending")


def run_outputs(run_dir) -> list[Path]:
    """The outputs of an earlier run present in ``run_dir`` (empty: a fresh folder)."""
    run_dir = Path(run_dir)
    return [run_dir / n for n in RUN_OUTPUTS if (run_dir / n).exists()]


def check_run_dir(run_dir, overwrite: bool = False) -> None:
    """Refuse a run directory that already holds a run; with ``overwrite``, remove that
    run's outputs (only the names in ``RUN_OUTPUTS``, and only in a folder that has a
    ``RUN_MARKERS`` file) so the new run starts clean."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} is a file, not a directory; pass a new "
                          "directory")
    found = run_outputs(run_dir)
    if not found:
        return
    if not any((run_dir / n).exists() for n in RUN_MARKERS):
        raise RunDirError(
            f"{run_dir} holds {', '.join(p.name for p in found)} but no "
            f"{' or '.join(RUN_MARKERS)}, so it does not look like a rollart run directory; "
            "nothing was removed. Pass a new --run-dir (or clear the folder yourself)")
    if not overwrite:
        names = [p.name for p in found]
        listed = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
        raise RunDirError(
            f"{run_dir} already holds a run ({listed}). Continue "
            f"it with `rollart train --resume {run_dir}` (rollart.train(resume=...)), pass "
            "a new --run-dir, or pass --overwrite (overwrite=True) to delete that run's "
            "outputs first")
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def check_weight_store(spec: str | None, overwrite: bool = False) -> None:
    """A new run's trainer publishes versions 0, 1, 2, ...: a store URL (``--weights``)
    that already holds versions (another run's) is refused, or with ``overwrite``
    emptied (every version and every reader's hold removed). The default store lives in
    the run directory (``check_run_dir``); ``"mooncake"`` starts an empty master."""
    from rollart.weights import BACKENDS, WeightStore

    if spec is None or spec in BACKENDS:
        return
    url = str(spec)
    store = WeightStore(url)
    versions = store.versions()
    if not versions:
        return
    if not overwrite:
        raise RunDirError(
            f"the weight store {url} already holds versions {versions[0]}..{versions[-1]} "
            "of another run; a new run's versions would be deleted as older than them and "
            "its inference workers would wait forever. Pass a new --weights URL, resume "
            "that run (--resume RUN), or pass --overwrite to empty the store first")
    store.truncate(-1)
    for reader in store.holds():
        store.release(reader)


def check_checkpoints(url: str | None, overwrite: bool = False) -> None:
    """A checkpoint URL (``--checkpoint-url``) that holds another run's checkpoints is
    refused (``--resume`` would continue the newest, whichever run wrote it), or with
    ``overwrite`` its ``step-N`` folders are removed."""
    if url is None:
        return
    import fsspec

    from rollart.runtime import storage as checkpoint

    done = checkpoint.steps(url)
    if not done:
        return
    if not overwrite:
        raise RunDirError(
            f"the checkpoint URL {url} already holds checkpoints of another run (steps "
            f"{done[0]}..{done[-1]}). Pass a new --checkpoint-url, resume that run "
            "(--resume RUN), or pass --overwrite to delete them first")
    fs, root = fsspec.core.url_to_fs(str(url))
    for step in done:
        fs.rm(checkpoint.step_dir(root, step), recursive=True)
