"""Resizing the trainer's pool at a step boundary: the trainer gang goes from N to M ranks
with its exact state (``Run.scale("trainer", M)``, ``rollart scale RUN trainer=M``).

Consumes a scale request for the ``TRAIN`` pool (``rollart.control.scaling.Scaler``
calls ``resize_trainer`` before a trainer step, when the trainer is idle and its newest
update is published) and the run's ``Fleet``; produces a trainer of M ranks in the old
one's place and the scale event's fields (workers added or removed, ``ranks``):

1. grow: M - N TRAIN workers started (``Scaler._grow``: copies of the pool's spec), and
   waited for (``Waits.start``): a worker that does not join refuses the request, the
   old trainer trains on;
2. the trainer writes its state, as in a checkpoint (``save_state``: weights, AdamW
   moments, version, KL reference, RNG; a gang's sharded, every rank its shards) to
   ``{checkpoint url}/resize-{step}-{i}`` (one place every TRAIN worker reaches, as
   the run's checkpoints; removed after the next step: a gang's ranks read their shards
   of the moments from it as the gang forms, ``settle``);
3. a trainer of M ranks (``Stages._trainer_spec`` at ``trainer_ranks = M``: the
   one-process ``Trainer`` for M = 1, as for a one-worker pool at start, else a
   ``GangTrainer``) is built on rank 0's worker, loads that state without dropping a
   published version (``load_state(truncate=False)``; DCP reshards the moments to M
   ranks) and takes the old trainer's place. The old trainer and its ranks are let go
   (their Dask tasks forgotten; a trainer built later in one of their processes leaves
   the dead gang's process group: ``rollart.trainer.trainer.leave_dead_gang``);
4. shrink: the freed TRAIN workers (never rank 0's nor the buffer's) are retired
   (``Scaler._retire``) before the next step, so the new gang forms at M ranks on the
   TRAIN workers left.

The buffer is not touched: the next step takes its batch as it would have, the step
count and version go on, and the step row's ``trainer/ranks`` says M. Refused (a
``ScaleError`` naming what to do): 0 ranks, the Megatron gang (its checkpoints are
gathered, its layout fixed at start: it resizes at a ``--resume``), LoRA on more than
one rank, and a gang on a cluster whose workers are threads of one process.
"""

from __future__ import annotations

import logging
import time

from rollart.control.scaling import ScaleError
from rollart.types import TRAIN

logger = logging.getLogger(__name__)

__all__ = ["resize_trainer", "settle"]


def resize_trainer(scaler, pool: str, specs: dict, have: list[str], n: int,
                   step: int) -> dict:
    """Resize the TRAIN pool ``pool`` (``specs``: its spec names -> addresses) from the
    workers ``have`` (oldest first) to ``n`` before step ``step`` (module docstring);
    returns the scale event's fields."""
    fleet, stages = scaler.fleet, scaler.fleet.stages
    _check(scaler, specs, n)
    actors = fleet.actors
    _, _, rank0 = actors.of("trainer")[0]
    out = {"added": [], "removed": [], "ranks": [max(stages.trainer_ranks, 1), n]}
    if n == len(have) and n == out["ranks"][0]:
        return out
    gone = []
    if n > len(have):
        out["added"] = scaler._grow(pool, TRAIN, specs, n - len(have))
        _wait_for(scaler, n)
    elif n < len(have):
        keep = {rank0, *actors.placement.get("buffer", [])}
        free = [a for a in have if a not in keep]
        if len(have) - n > len(free):
            raise ScaleError(f"the TRAIN workers {', '.join(sorted(keep & set(have)))} "
                             f"hold the run's trainer and buffer: the pool shrinks to "
                             f"{len(have) - len(free)} worker(s) at least, not {n}")
        gone = free[len(free) - (len(have) - n):]
    old_keys = _old_ranks(scaler, [a for a in have if a != rank0])
    out["version"], state = _rebuild(scaler, rank0, n, step)
    scaler.resized.append(state)  # read as the gang forms: removed after the next step
    _let_go(scaler, old_keys)  # the old gang's ranks (Dask retires no worker holding one)
    if gone:
        scaler._retire(gone, specs)
        out["removed"] = gone
    return out


def _check(scaler, specs: dict, n: int) -> None:
    """Refuse what a resize cannot do (module docstring), saying what to do instead."""
    graph = scaler.fleet.stages.graph
    if n < 1:
        raise ScaleError("the trainer's pool runs 1 worker or more, not 0 (to pause: "
                         "Run.stop(), then `rollart train --resume RUN`)")
    if graph.policy.trainer_backend == "megatron":
        raise ScaleError("the Megatron trainer gang changes size at a resume only: stop "
                         "the run, change Pool(tag=TRAIN, workers=...) and `rollart train "
                         "--resume RUN` (its checkpoint loads on any number of ranks)")
    if n > 1 and graph.policy.lora is not None:
        raise ScaleError("Policy.lora on a trainer gang is not supported yet: LoRA trains "
                         "on one TRAIN worker")
    cluster = getattr(scaler.client, "cluster", None)
    spec = getattr(cluster, "worker_spec", None) or {}
    threads = [s for s in specs if s in spec and not _is_process(spec[s].get("cls"))]
    if n > 1 and threads:
        raise ScaleError("the cluster's workers are threads of one process "
                         "(Resources(processes=False)): a trainer gang needs a process "
                         "per rank; start the run with processes=True")


def _is_process(cls) -> bool:
    from distributed import Nanny

    return isinstance(cls, type) and issubclass(cls, Nanny)


def _wait_for(scaler, n: int) -> None:
    """Until ``n`` TRAIN workers are alive (the ones just started joined), within
    ``Waits.start``; else a ``ScaleError`` (the old trainer trains on)."""
    from rollart.runtime.resources import workers_with

    deadline = time.monotonic() + scaler.waits.start
    while True:
        alive = [a for a in workers_with(scaler.client, TRAIN) if a not in scaler.retired]
        if len(alive) >= n:
            return
        if time.monotonic() > deadline:
            raise ScaleError(f"only {len(alive)} of {n} TRAIN workers joined within "
                             f"{scaler.waits.start:.0f} s (Dask's config "
                             "rollart.waits.start); the trainer keeps its size")
        time.sleep(0.25)


def _old_ranks(scaler, addresses: list[str]) -> list[str]:
    """The keys of the gang ranks (``GangRank`` actors) on ``addresses``: the old
    gang's, let go once the new trainer holds the state."""
    if not addresses:
        return []
    return scaler.client.run_on_scheduler(_rank_keys, addresses=addresses)


def _rank_keys(addresses, dask_scheduler=None) -> list[str]:
    """(on the scheduler) the keys of the ``GangRank`` actors held on ``addresses``."""
    out = []
    for addr in addresses:
        ws = dask_scheduler.workers.get(addr)
        out += [ts.key for ts in (ws.actors if ws is not None else ())
                if str(ts.key).startswith("GangRank-")]
    return out


def _rebuild(scaler, rank0: str, n: int, step: int) -> tuple[int, str]:
    """Steps 2 and 3 of the module docstring; returns the new trainer's version and the
    URL of the state it loaded (a gang's ranks read their shards of it as it forms:
    ``settle`` removes it after the next step). A
    failure is a ``ScaleError``: the old trainer trains on at its size (a gang whose
    process group the new trainer left forms again at the next step, from the published
    weights: ``GangTrainer._failed``)."""
    from rollart.control import checkpoint
    from rollart.runtime.handles import handle

    fleet, stages, waits = scaler.fleet, scaler.fleet.stages, scaler.waits
    actors, old = fleet.actors, fleet.actors.trainer
    base = fleet.supervisor.checkpoint_url or checkpoint.default_url(stages.run_dir)
    url = f"{base.rstrip('/')}/resize-{step:08d}-{len(scaler.resized)}"
    before, fut = stages.trainer_ranks, None
    try:
        fleet.call(old, "save_state", url, timeout=waits.call)
        stages.trainer_ranks, stages._n = n, stages._n + 1
        spec = stages._trainer_spec()
        fut = stages.submit(spec, rank0, actors, suffix=f"-s{stages._n}")
        new = handle(fleet.result(fut, None, waits.start, setting="start", stuck=f"the "
                                  f"{spec.cls.__name__} of {n} rank(s) on {rank0} (TRAIN) "
                                  "did not start"))
        version = fleet.call(new, "load_state", url, False, timeout=waits.call)
    except Exception as e:  # noqa: BLE001 - said, and the run goes on as it was
        stages.trainer_ranks = before  # a replacement of the old trainer: its size
        if fut is not None:
            _let_go(scaler, [fut.key])
        _remove(url)
        raise ScaleError(f"the trainer did not hand its state to one of {n} rank(s) "
                         f"({e}); it trains on with {max(before, 1)}") from e
    actors.add("trainer", new, TRAIN, rank0)
    _let_go(scaler, [old.key])
    return version, url


def settle(scaler, urls: list[str]) -> None:
    """After the first step of a resized trainer (``Scaler.apply``, or the run's end):
    its gang formed, each rank reading its shard of the moments from the state it
    loaded (``urls``: one a resize since the step before), which goes now; the run's
    record of the ranks' workers (``Actors.set_ranks``) is read again."""
    for url in urls:
        _remove(url)
    fleet = scaler.fleet
    try:
        ranks = fleet.call(fleet.actors.trainer, "stats", timeout=scaler.waits.call)["ranks"]
    except Exception as e:  # noqa: BLE001 - the placement's record only
        logger.warning("reading the resized trainer's ranks: %r", e)
        return
    fleet.actors.set_ranks(ranks[1:])


def _let_go(scaler, keys: list[str]) -> None:
    """Forget the actors ``keys`` (``Scaler._release``); a failure is logged: a trainer
    left behind holds memory, not the run."""
    try:
        scaler._release(keys)
    except Exception as e:  # noqa: BLE001 - see above
        logger.warning("letting go of the trainer actors %s: %r", keys, e)


def _remove(url: str) -> None:
    """The resize's state, once loaded (or not)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    try:
        if fs.exists(root):
            fs.rm(root, recursive=True)
    except OSError as e:  # a leftover folder, not the run's failure
        logger.warning("removing the resize's state %s: %r", url, e)
