"""Checkpoints of a run: everything needed to continue it exactly, under any fsspec URL.

API (used by the control loop and by anything that restarts a lost trainer)::

    path = save(url, step, actors, pipeline=p, graph=g, resources=r)  # -> ".../step-00000012"
    path = latest(url)          # newest *complete* checkpoint under url, or None
    ckpt = load(path)           # a verified ``Checkpoint`` (raises ``CheckpointError``)
    restore(ckpt, actors, pipeline=p)   # push its state into freshly started actors

``url`` is a folder URL (a local path, ``file://``, ``memory://``, object stores); each
checkpoint is ``{url}/step-{step:08d}/``::

    model/              the policy as a Hugging Face model folder (model + tokenizer;
                        a trainer gang's in shards, one per weight bucket, with an index)
    dcp/                a torch trainer gang's: each rank's shards of the weights and
                        AdamW state (torch.distributed.checkpoint; ``rollart.trainer.gang``)
    ref_model.safetensors  the KL reference policy, when the algorithm uses one
    trainer.pt          optimizer state (or ``optimizer_format: "dcp"``: it is in
                        ``dcp/``), scheduler state, version counter, torch RNG state
    buffer.parquet      trajectories the buffer holds, buffered or taken (``SCHEMA``) ...
    buffer.json         ... and the buffer's counts, ledger totals, groups (and the step
                        holding a taken one), next Parquet part and journal entry (a
                        restore sets the lost run's later parts and journal entries aside:
                        ``rollart.buffer.restore``)
    state.json          step, version, driver RNG states, the pipeline's group counter,
                        elapsed run time (so a resumed run's metrics continue the curve)
    graph.json, resources.json   the graph and the resources/placement that were used
    manifest.json       size and sha256 of every file above
    COMPLETE            written last; a folder without it is ignored by ``latest``

``load`` checks the manifest, so a truncated or altered file is a ``CheckpointError``
naming the file, never a half-restored run. The trainer writes its own files (model and
optimizer stay on its worker; a gang's ranks each write theirs, so ``url`` must be one
place every TRAIN worker reaches); the buffer writes its own; the driver writes the rest.
Who calls: ``rollart.control.loop`` (every ``Graph.checkpoint_every`` steps and at the end,
and ``train(resume=RUN)``).
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field

import fsspec

from rollart.control.door import Door
from rollart.control.fleet import ActorLost
# the checkpoint's folder layout and file writes (rollart.runtime.storage), used here and
# read through this module by callers that handle checkpoints
from rollart.runtime.storage import MARKER, digest, local_dir, step_dir, steps, write_bytes

logger = logging.getLogger(__name__)



class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message says which file."""


@dataclass
class Checkpoint:
    """A verified checkpoint. ``model_dir`` is a local folder (downloaded if remote)."""

    path: str
    step: int
    version: int
    state: dict
    graph: dict
    resources: dict
    model_dir: str
    files: dict = field(default_factory=dict)  # name -> {"size", "sha256"}


# -- the API ---------------------------------------------------------------------------
def save(url: str, step: int, actors, *, pipeline=None, graph=None, resources=None,
         elapsed: float = 0.0, extra: dict | None = None) -> str:
    """Write a checkpoint of the run behind ``actors`` after trainer step ``step``.

    ``actors`` is ``rollart.control.loop.Actors`` (trainer and buffer handles); ``pipeline``
    (optional) contributes its group counter and RNG; ``graph`` a ``Graph`` or dict;
    ``resources`` a dict (source, placement). Returns the checkpoint's URL.
    """
    path = step_dir(url, step)
    fs, root = fsspec.core.url_to_fs(path)
    if fs.exists(f"{root}/{MARKER}"):
        fs.rm(f"{root}/{MARKER}")  # rewriting the same step: invalid until done again
    files, version = _actor_files(path, actors, pipeline,
                                  _asker(f"checkpoint step {step} at {path}", pipeline))
    state = {"step": int(step), "version": int(version), "elapsed": float(elapsed),
             "python_rng": _jsonable(random.getstate()), **(extra or {})}
    if pipeline is not None:
        state["pipeline"] = pipeline.state()
    gdict = graph.to_dict() if hasattr(graph, "to_dict") else dict(graph or {})
    for name, obj in (("state.json", state), ("graph.json", gdict),
                      ("resources.json", dict(resources or {}))):
        files.update(write_bytes(path, name, json.dumps(obj, indent=1, default=str).encode()))
    files.update(write_bytes(path, "manifest.json", json.dumps(files, indent=1).encode()))
    with fs.open(f"{root}/{MARKER}", "w") as f:
        f.write(str(int(step)))
    return path


def latest(url: str) -> str | None:
    """URL of the newest complete checkpoint under ``url``; ``None`` when there is none."""
    done = steps(url)
    return step_dir(url, done[-1]) if done else None


def load(path: str, *, verify: bool = True) -> Checkpoint:
    """Read and verify the checkpoint at ``path`` (a ``step-N`` folder URL)."""
    fs, root = fsspec.core.url_to_fs(str(path))
    root = root.rstrip("/")
    if not fs.exists(root):
        raise CheckpointError(f"no checkpoint at {path}")
    if not fs.exists(f"{root}/{MARKER}"):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker: the "
                              "writer stopped midway); use an older one (checkpoint.latest)")
    files = _read_json(fs, root, path, "manifest.json")
    if verify:
        problems = []
        for name, want in sorted(files.items()):
            p = f"{root}/{name}"
            if not fs.exists(p):
                problems.append(f"{name} is missing")
            elif (got := digest(fs, p)) != want:
                problems.append(f"{name} is corrupt (size {got['size']}, expected "
                                f"{want['size']}; sha256 differs)")
        if problems:
            raise CheckpointError(f"checkpoint {path}: " + "; ".join(problems))
    state = _read_json(fs, root, path, "state.json")
    return Checkpoint(path=str(path), step=int(state["step"]), version=int(state["version"]),
                      state=state, graph=_read_json(fs, root, path, "graph.json"),
                      resources=_read_json(fs, root, path, "resources.json"),
                      model_dir=local_dir(f"{str(path).rstrip('/')}/model"), files=files)


def restore(ckpt: Checkpoint, actors, *, pipeline=None) -> None:
    """Load ``ckpt`` into freshly started actors (trainer, buffer) and the pipeline."""
    ask = _asker(f"restoring checkpoint {ckpt.path}")
    ask(actors.trainer, "load_state", "load its state", ckpt.path)
    ask(actors.buffer, "restore", "restore the buffer", ckpt.path)
    if pipeline is not None and "pipeline" in ckpt.state:
        pipeline.load_state(ckpt.state["pipeline"])
    if "python_rng" in ckpt.state:
        random.setstate(_tupled(ckpt.state["python_rng"]))


def _actor_files(path: str, actors, pipeline, ask) -> tuple[dict, int]:
    """The trainer's and the buffer's files of a checkpoint, and the trainer's version.
    A worker of either lost meanwhile (the trainer's after its step returned, as
    ``benchmarks/chaos.py``'s mid-step kill of an in-process worker can land) is healed
    once by the pipeline's supervisor, then the files are written again: the trainer
    re-created (it holds the newest published weights: the step's update) or the
    buffer's replacement waited for. Without a supervisor the loss is the caller's."""
    sup = getattr(getattr(pipeline, "fleet", None), "supervisor", None)

    def write() -> tuple[dict, int]:
        files = dict(ask(actors.trainer, "save_state", "save its state", path))
        files.update(ask(actors.buffer, "snapshot", "snapshot the buffer", path))
        return files, ask(actors.trainer, "stats", "report its version")["version"]

    try:
        return write()
    except ActorLost as e:  # healed below, once
        if sup is None:
            raise
        logger.warning("checkpoint %s: a worker was lost (%r); healing, then writing it "
                       "again", path, e.__cause__ or e)
    if sup.alive(actors.trainer):
        sup.wait_for_buffer()
    else:
        sup.replace_trainer()
        pipeline.trainer_recoveries += 1
    return write()


def _asker(context: str, pipeline=None):
    """``ask(actor, method, doing, *args)``: ``actor.method(*args)``'s result within
    ``rollart.waits.call`` seconds, else ``StuckError`` naming the actor, its worker and
    ``context``. With a ``pipeline``, through its ``Fleet``: a call whose actor's worker
    left the cluster is ``ActorLost`` at once instead of a wait on Dask's connect
    time-out; without, through a ``Door`` without a view (errors as raised)."""
    from rollart.runtime.waits import Waits

    seconds = Waits.from_config().call
    door = getattr(pipeline, "fleet", None) or Door()

    def ask(actor, method: str, doing: str, *args):
        who = f"the {getattr(actor, '_cls', type(actor)).__name__} on " \
              f"{getattr(actor, '_address', '?')}"
        return door.call(actor, method, *args, timeout=seconds,
                         stuck=f"{who} did not {doing} ({context})")
    return ask


def _read_json(fs, root: str, path: str, name: str) -> dict:
    try:
        with fs.open(f"{root}/{name}", "r") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: {name} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {name} is corrupt ({e})") from None


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


# -- resuming a run (used by ``rollart.control.loop.train(resume=RUN)``) --------------------
def default_url(run_dir) -> str:
    """Where a run keeps its checkpoints unless told otherwise."""
    return f"{str(run_dir).rstrip('/')}/checkpoints"


def for_resume(run_dir, url: str | None = None) -> Checkpoint:
    """The newest complete checkpoint of the run at ``run_dir`` (verified)."""
    url = url or _recorded_url(run_dir) or default_url(run_dir)
    path = latest(url)
    if path is None:
        raise CheckpointError(f"no complete checkpoint under {url} to resume {run_dir} "
                              "from (checkpoints are written every Graph.checkpoint_every "
                              "steps and at the end of a run)")
    return load(path)


def record_url(run_dir, url: str) -> None:
    """Remember a run's checkpoint URL in its run directory (for ``--resume``)."""
    with open(os.path.join(str(run_dir), "checkpoint_url.txt"), "w") as f:
        f.write(str(url))


def _recorded_url(run_dir) -> str | None:
    p = os.path.join(str(run_dir), "checkpoint_url.txt")
    if os.path.isfile(p):
        with open(p) as f:
            return f.read().strip() or None
    return None


def graph_from(ckpt: Checkpoint, given=None):
    """The ``Graph`` a checkpointed run used: ``given`` if it is a ``Graph``, else the
    saved source (or ``given`` as a graph spec) with the saved settings applied."""
    from dataclasses import replace

    from rollart.config.graph import GRPO, Graph, Policy, Rollout, load_graph

    if isinstance(given, Graph):
        return given
    saved = ckpt.graph
    source = given or saved.get("source")
    if not source or source == "<python>":
        raise CheckpointError(f"checkpoint {ckpt.path} was written by a graph given as a "
                              "Python object: pass the same Graph to train(resume=...)")
    base, _ = load_graph(source)
    rollout = dict(saved["rollout"])
    rollout["inference_pools"] = tuple(rollout["inference_pools"])
    weights = saved.get("task_weights")
    return replace(base, name=saved["name"], policy=Policy(**saved["policy"]),
                   algo=GRPO(**saved["algo"]), rollout=Rollout(**rollout),
                   steps=saved["steps"], seed=saved["seed"], mode=saved["mode"],
                   checkpoint_every=saved.get("checkpoint_every", 0),
                   task_weights=tuple(weights) if weights else None)


def check_lora(ckpt: Checkpoint, graph) -> None:
    """A resumed run keeps the way it trains: LoRA on a full fine-tune's checkpoint (or
    off on a LoRA run's, or another rank) is a ``CheckpointError`` naming the fix."""
    saved = ckpt.graph.get("policy", {}).get("lora")
    now = graph.policy.lora
    rank = None if saved is None else saved.get("rank")
    if (saved is None) != (now is None) or (now is not None and now.rank != rank):
        was = "full fine-tuning" if saved is None else f"LoRA rank {rank}"
        asked = "full fine-tuning" if now is None else f"LoRA rank {now.rank}"
        fix = "--set policy.lora=none" if saved is None else f"--set policy.lora.rank={rank}"
        raise CheckpointError(
            f"checkpoint {ckpt.path} was trained with {was}, and the resumed run asks for "
            f"{asked}: a checkpoint's weights and optimizer state are for the former. "
            f"Resume without that change ({fix}, or no --set), or start a new run")


def truncate_metrics(path, step: int) -> list[dict]:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (a lost run may have logged
    steps after its last checkpoint); returns the kept rows."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get("step", 0) <= step]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows
