"""The Arrow schema of a stored trajectory, and its Parquet I/O.

Consumes ``rollart.types.Trajectory`` records; produces ``pyarrow`` record batches and
Parquet part files. The ``SampleBuffer`` holds its data in this schema and writes the
trajectories that leave it to ``{run_dir}/samples/part-*.parquet``; ``read_parts`` reads
them back (analysis code uses ``rollart.buffer.read_samples``, which adds the journal).
Every path is an fsspec URL (local, ``memory://``, ...).

One row per trajectory (schema metadata ``rollart_schema_version = "2"``; version 1 had
no ``tool_calls`` / ``invalid_tool_calls``: ``conform`` reads its files with those null):

==============  ===============  ========  ==================================================
column          type             nullable  meaning
==============  ===============  ========  ==================================================
traj_id         string           no        unique id of the rollout
task            string           no        task (environment) name
group_id        string           no        GRPO group; members share prompt and seed
seed            int64            no        environment seed
prompt_ids      list<int32>      no        prompt token ids
response_ids    list<int32>      no        all tokens after the prompt (generated + env)
loss_mask       list<int8>       no        1 where the policy generated the response token
logprobs        list<float32>    no        behaviour log-prob per response token (0 if masked)
versions        list<int32>      no        policy version per response token (-1 if masked)
reward          float64          no        scalar reward of the rollout
num_turns       int32            no        agent turns taken
env_time        float64          no        seconds spent in the environment
gen_time        float64          no        seconds spent waiting for generation
outcome         string           no        "success" | "failure" | "truncated" | "failed"
error           string           no        error text when the rollout failed
state           string           no        ``TrajState`` value (how it left the buffer)
tool_calls      int32            yes       tool calls the policy made (null: no tools offered)
invalid_tool_   int32            yes       how many of them were invalid (unknown tool, bad
calls                                      arguments, unparsable); null: no tools offered
version         int32            no        derived: oldest generated-token version (-1: none)
trained_step    int32            yes       trainer step that took it (taken, trained,
                                           lost_in_step; null otherwise)
==============  ===============  ========  ==================================================
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import fields as dc_fields

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollart.types import Trajectory

SCHEMA_VERSION = "2"

_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("traj_id", pa.string(), False, "unique id of the rollout"),
    ("task", pa.string(), False, "task (environment) name"),
    ("group_id", pa.string(), False, "GRPO group; members share prompt and seed"),
    ("seed", pa.int64(), False, "environment seed"),
    ("prompt_ids", pa.list_(pa.int32()), False, "prompt token ids"),
    ("response_ids", pa.list_(pa.int32()), False, "tokens after the prompt (generated + env)"),
    ("loss_mask", pa.list_(pa.int8()), False, "1 where the policy generated the token"),
    ("logprobs", pa.list_(pa.float32()), False, "behaviour log-prob per response token"),
    ("versions", pa.list_(pa.int32()), False, "policy version per response token (-1 masked)"),
    ("reward", pa.float64(), False, "scalar reward of the rollout"),
    ("num_turns", pa.int32(), False, "agent turns taken"),
    ("env_time", pa.float64(), False, "seconds spent in the environment"),
    ("gen_time", pa.float64(), False, "seconds spent waiting for generation"),
    ("outcome", pa.string(), False, "success | failure | truncated | failed"),
    ("error", pa.string(), False, "error text when the rollout failed"),
    ("state", pa.string(), False, "TrajState value: how the row left the buffer"),
    ("tool_calls", pa.int32(), True, "tool calls the policy made (null: no tools offered)"),
    ("invalid_tool_calls", pa.int32(), True, "invalid ones among them (null: no tools)"),
    ("version", pa.int32(), False, "derived: oldest generated-token policy version (-1 none)"),
    ("trained_step", pa.int32(), True, "trainer step that took the row (null otherwise)"),
]

SCHEMA: pa.Schema = pa.schema(
    [pa.field(n, t, nullable=nl, metadata={b"doc": d.encode()}) for n, t, nl, d in _COLUMNS],
    metadata={b"rollart_schema_version": SCHEMA_VERSION.encode()},
)

#: The columns that are ``Trajectory`` fields (everything but the derived ones).
TRAJ_FIELDS: tuple[str, ...] = tuple(f.name for f in dc_fields(Trajectory))
_DERIVED = ("version", "trained_step")
assert set(TRAJ_FIELDS) | set(_DERIVED) == set(SCHEMA.names), "schema out of sync with types"


def to_record_batch(trajs: list[Trajectory], trained_step: int | None = None) -> pa.RecordBatch:
    """Trajectories as one batch in ``SCHEMA``; every row gets ``trained_step``."""
    cols: dict[str, list] = {name: [getattr(t, name) for t in trajs] for name in TRAJ_FIELDS}
    cols["state"] = [getattr(s, "value", s) for s in cols["state"]]
    cols["version"] = [t.version for t in trajs]
    cols["trained_step"] = [trained_step] * len(trajs)
    arrays = [pa.array(cols[f.name], type=f.type) for f in SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def from_table(table_or_batch: pa.Table | pa.RecordBatch) -> list[Trajectory]:
    """Rows back as ``Trajectory`` records (derived columns are ignored)."""
    cols = {name: table_or_batch.column(name).to_pylist() for name in TRAJ_FIELDS}
    return [
        Trajectory(**{name: cols[name][i] for name in TRAJ_FIELDS})
        for i in range(table_or_batch.num_rows)
    ]


def conform(table: pa.Table) -> pa.Table:
    """A table read from a file in ``SCHEMA``: a nullable column that an older version
    lacks (``tool_calls``, ``invalid_tool_calls`` before version 2) comes back null."""
    for f in SCHEMA:
        if f.name not in table.column_names and f.nullable:
            table = table.append_column(f, pa.nulls(table.num_rows, f.type))
    return table.select(SCHEMA.names).cast(SCHEMA)


def _as_table(data: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch]) -> pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    return pa.Table.from_batches(list(data), schema=SCHEMA)


def write_parquet(batches_or_table, url: str) -> int:
    """Write a table, a batch or a list of batches as one Parquet file; returns rows."""
    table = _as_table(batches_or_table)
    with fsspec.open(str(url), "wb") as f:
        pq.write_table(table, f)
    return table.num_rows


def _sample_files(run_dir_or_url: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    fs, root = fsspec.core.url_to_fs(str(run_dir_or_url))
    root = root.rstrip("/")
    if root.endswith(".parquet"):
        return fs, [root]
    base = f"{root}/samples" if fs.isdir(f"{root}/samples") else root
    return fs, sorted(fs.glob(f"{base}/*.parquet"))


def read_parts(run_dir_or_url: str) -> pa.Table:
    """All ``samples/*.parquet`` under a run dir (or one file / a samples dir) as a table:
    the rows that left the buffer. ``rollart.buffer.read_samples`` adds what only the
    buffer's journal holds (``rollart.buffer.journal``).

    Files are read in name order, so rows come back in the order they were written.
    An empty table in ``SCHEMA`` when there is nothing yet.
    """
    fs, paths = _sample_files(run_dir_or_url)
    tables = []
    for path in paths:
        with fs.open(path, "rb") as f:
            tables.append(conform(pq.read_table(f)))
    if not tables:
        return SCHEMA.empty_table()
    return pa.concat_tables(tables)


def batch_digest(traj_ids) -> str:
    """A short fingerprint of which trajectories a step trained on (order-free): compare
    it with the Parquet rows ``trained`` at that step (16 hex digits of a SHA-1 over the
    sorted ids, one per line). The trainer reports it per step; the buffer for a step
    whose trainer was lost after publishing (``SampleBuffer.release_taken``)."""
    import hashlib

    return hashlib.sha1("\n".join(sorted(traj_ids)).encode()).hexdigest()[:16]


def trainable_groups(trajs) -> int:
    """How many GRPO groups among ``trajs`` have unequal rewards (a group whose members all
    got the same reward has zero advantages: nothing to learn from it).

    >>> T = lambda g, r: Trajectory("", "t", g, 0, [], [], [], [], [], reward=r)
    >>> trainable_groups([T("a", 1.0), T("a", 1.0), T("b", 0.0), T("b", 1.0)])
    1
    """
    rewards: dict[str, set] = {}
    for t in trajs:
        rewards.setdefault(t.group_id, set()).add(t.reward)
    return sum(len(r) > 1 for r in rewards.values())


def sampled_entropy(trajs) -> float | None:
    """The mean −log μ of the generated tokens of ``trajs`` (their ``loss_mask`` ones,
    μ the behaviour log-prob each was sampled with): a sample estimate of the sampling
    policy's entropy per token, at its temperature. Falling towards 0, a task's members
    all do the same thing and its groups stop having unequal rewards. Tokens without a
    finite log-prob (the trainer's ``RESCORE`` marks) are left out; None when no token
    is left.

    >>> T = lambda lp: Trajectory("", "t", "g", 0, [1], [5, 6, 7], [1, 1, 0], lp, [0, 0, 0])
    >>> sampled_entropy([T([-0.5, -1.5, -9.0]), T([float("inf"), -2.0, 0.0])])
    1.3333333333333333
    """
    nll = [-lp for t in trajs for m, lp in zip(t.loss_mask, t.logprobs)
           if m and math.isfinite(lp)]
    return sum(nll) / len(nll) if nll else None


def batch_metrics(batch, trainer_version: int) -> dict:
    """Per-task reward, success, trajectories (``trainer/rows/<task>``), trainable
    groups (``trainer/trainable_groups/<task>``) and the sampled tokens' entropy
    estimate (``entropy/<task>``, ``sampled_entropy``), staleness and sizes of a
    trained batch (a list of ``Trajectory``; ``trainer_version``: the version its update
    was computed on); a task with nothing in the batch gets its keys from
    ``rollart.observe.figures.step_row``. The trainer reports them per step; the pipeline
    for a step whose trainer was lost after publishing, from the buffer
    (``SampleBuffer.release_taken``)."""
    from collections import defaultdict

    by_task = defaultdict(list)
    for t in batch:
        by_task[t.task].append(t)
    out = {}
    for task, ts in sorted(by_task.items()):
        out[f"reward/{task}"] = sum(t.reward for t in ts) / len(ts)
        out[f"success/{task}"] = sum(t.outcome == "success" for t in ts) / len(ts)
        out[f"trainer/rows/{task}"] = len(ts)
        out[f"trainer/trainable_groups/{task}"] = trainable_groups(ts)
        out[f"entropy/{task}"] = sampled_entropy(ts)
    out["trainer/entropy"] = sampled_entropy(batch)
    stale = [trainer_version - t.version for t in batch]
    out["trainer/staleness_mean"] = sum(stale) / len(stale)
    out["trainer/staleness_max"] = max(stale)
    for k in sorted(set(stale)):  # the staleness histogram of this batch
        out[f"trainer/staleness/{k}"] = stale.count(k)
    out["trainer/batch_size"] = len(batch)
    out["trainer/batch_sha1"] = batch_digest([t.traj_id for t in batch])
    out["rollout/turns_mean"] = sum(t.num_turns for t in batch) / len(batch)
    out["reward/mean"] = sum(t.reward for t in batch) / len(batch)
    return out


def generated_tokens(batches: list[pa.RecordBatch]) -> int:
    """Tokens the policy generated in these rows (their ``loss_mask`` ones)."""
    return sum(int(pc.sum(pc.list_flatten(b.column("loss_mask"))).as_py() or 0)
               for b in batches)
