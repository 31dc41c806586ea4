"""A GRPO group in the ``SampleBuffer``: its members as records while it fills, as Arrow
(``rollart.buffer.schema.SCHEMA``) once it completes or must leave; ``Taken``, the groups
a trainer step holds until its update is confirmed; and ``restate``, which marks rows
with how they left. Used by ``rollart.buffer.buffer`` and ``rollart.buffer.restore``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from rollart.buffer.schema import SCHEMA, to_record_batch
from rollart.types import Trajectory

_STATE = SCHEMA.get_field_index("state")
_STEP = SCHEMA.get_field_index("trained_step")


@dataclass
class Group:
    """One GRPO group: the non-failed members that arrived, as Arrow.

    Members arrive one at a time; they are kept as records and become Arrow in one
    batch per group (``arrow()``: when the group completes or must leave earlier), not
    one single-row batch per arrival (20 ``pa.array`` calls each)."""

    group_id: str
    size: int
    arrived: int = 0  # members seen, failed ones included
    batches: list[pa.RecordBatch] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of the buffered members
    pending: list[Trajectory] = field(default_factory=list)  # not yet in ``batches``

    @property
    def complete(self) -> bool:
        return self.arrived >= self.size

    @property
    def rows(self) -> int:
        return len(self.versions)

    @property
    def version(self) -> int | None:
        """Min version over the buffered (non-failed) members; None when there are none."""
        return min(self.versions) if self.versions else None

    @property
    def nbytes(self) -> int:
        """Arrow bytes held; members not yet converted are estimated (the stats that ask
        every second do not convert them)."""
        return sum(b.nbytes for b in self.batches) + sum(arrow_size(t) for t in self.pending)

    def add(self, traj: Trajectory) -> None:
        self.pending.append(traj)
        self.versions.append(traj.version)

    def arrow(self) -> list[pa.RecordBatch]:
        """The buffered members as Arrow batches (pending ones converted now)."""
        if self.pending:
            self.batches.append(to_record_batch(self.pending))
            self.pending = []
        return self.batches

    def compact(self) -> None:
        """The members of a complete group as one batch."""
        if len(self.arrow()) > 1:
            table = pa.Table.from_batches(self.batches, schema=SCHEMA).combine_chunks()
            self.batches = table.to_batches() or []


@dataclass
class Taken:
    """The groups trainer step ``step`` took, until its update is confirmed or settled.
    ``take`` names this hand-out: a confirmation naming another one (from a trainer
    that was given up for lost while its step went on) is refused."""

    min_version: int  # the bound they were taken for: min_version + alpha = its version
    groups: list[Group]
    take: str

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def meta(self) -> dict:
        return {"min_version": self.min_version, "take": self.take}


def arrow_size(t: Trajectory) -> int:
    """About the Arrow bytes of ``t`` in ``SCHEMA``: int32 token columns (+ offsets),
    int8 mask, float32 log-probs, the strings and the scalars."""
    n = len(t.prompt_ids) + len(t.response_ids) + len(t.logprobs) + len(t.versions)
    text = len(t.traj_id) + len(t.task) + len(t.group_id) + len(t.outcome) + len(t.error) \
        + len(str(getattr(t.state, "value", t.state)))
    return 4 * n + len(t.loss_mask) + text + 89  # + offsets and fixed-width columns


def restate(batch: pa.RecordBatch, state: str, trained_step: int | None) -> pa.RecordBatch:
    """The batch with ``state`` and ``trained_step`` set on every row."""
    n = batch.num_rows
    batch = batch.set_column(_STATE, SCHEMA.field(_STATE), pa.array([state] * n, pa.string()))
    return batch.set_column(_STEP, SCHEMA.field(_STEP), pa.array([trained_step] * n, pa.int32()))
