"""GRPO groups in the ``SampleBuffer``: ``Group``, one group's members as records while it
fills, as Arrow (``rollart.buffer.schema.SCHEMA``) once it completes or must leave;
``Groups``, the buffer's part that holds them (open, complete in completion order, and
the ids of those that left); ``Taken``, the groups a trainer step holds until its update
is confirmed (kept by ``rollart.buffer.taken.TakenBatches``); and ``restate``, which
marks rows with how they left. Used by ``rollart.buffer.buffer``, ``rollart.buffer.taken``
and ``rollart.buffer.restore``."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import pyarrow as pa

from rollart.buffer.schema import SCHEMA, to_record_batch
from rollart.policy.admission import take_order
from rollart.policy.staleness import within
from rollart.types import Trajectory, TrajState

TAKEN = TrajState.TAKEN.value
TAKE_KEY = b"rollart_take"  # a taken batch's schema metadata: which hand-out it is

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
    task: str = ""  # its members' task (what ``groups_too_small`` is counted under)
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

    def table(self, step: int) -> pa.Table:
        """The groups' rows as one table, ``taken`` for ``step``, naming this hand-out in
        the schema metadata (``TAKE_KEY``: the trainer's confirmation quotes it)."""
        rows = [restate(b, TAKEN, step) for g in self.groups for b in g.arrow()]
        table = pa.Table.from_batches(rows, schema=SCHEMA)
        return table.replace_schema_metadata({**SCHEMA.metadata, TAKE_KEY: self.take})


class Groups:
    """The buffer's groups: ``open`` (filling, by id), ``complete`` (oldest completion
    first: the order the trainer takes them in) and ``closed`` (ids of groups that left:
    a late member of one is dropped). Knows nothing of ledgers, slots or files.

    >>> gs = Groups()
    >>> g = gs.arrive("g0", 2); g.arrived += 2
    >>> gs.completed(g), gs.ready(), gs.ended("g0")
    (False, 0, True)
    """

    def __init__(self):
        self.open: dict[str, Group] = {}
        self.complete: OrderedDict[str, Group] = OrderedDict()
        self.closed: set[str] = set()

    def rows(self) -> int:
        """Rows held (open and complete groups)."""
        return sum(g.rows for g in self.held())

    def held(self) -> list[Group]:
        """Open groups, then complete ones."""
        return list(self.open.values()) + list(self.complete.values())

    def ready(self, limit: int | None = None) -> int:
        """Complete groups waiting for the trainer (with ``limit``: those numbered below
        it, ``Slots.take_limit``)."""
        return len(take_order(self.complete, limit))

    def ended(self, group_id: str) -> bool:
        """Complete or closed: a member arriving now is late."""
        return group_id in self.complete or group_id in self.closed

    def arrived(self, group_id: str) -> int:
        """Members an open group has seen (0 for any other)."""
        group = self.open.get(group_id)
        return group.arrived if group else 0

    def seen(self, group_id: str) -> int:
        """``arrived``, or "all of them" (2**30) for a group that ended: nothing of it is
        to run again."""
        return 1 << 30 if self.ended(group_id) else self.arrived(group_id)

    def live(self, running: set[str]) -> int:
        """Groups live: open, complete, or with members ``running`` (and not closed)."""
        return len((running - self.closed) | set(self.open) | set(self.complete))

    def arrive(self, group_id: str, size: int, task: str = "") -> Group:
        """The open group ``group_id`` (opened now with ``size`` members of ``task`` if
        new)."""
        return self.open.setdefault(group_id, Group(group_id, max(1, int(size)), task))

    def completed(self, group: Group, min_rows: int = 1) -> bool:
        """``group`` has all its members: complete (True) when it holds at least
        ``min_rows`` rows to train on, else closed (too many members failed: its rows
        are the caller's to drop, ``rollart.buffer.infra``)."""
        del self.open[group.group_id]
        if group.rows < max(1, min_rows):
            self.closed.add(group.group_id)
            return False
        group.compact()
        self.complete[group.group_id] = group
        return True

    def close(self, group_id: str) -> None:
        """``group_id`` leaves (taken, dropped, ended): later members are late."""
        self.open.pop(group_id, None)
        self.complete.pop(group_id, None)
        self.closed.add(group_id)

    def older_than(self, min_version: int, open_too: bool = False) -> list[tuple[Group, bool]]:
        """``(group, complete)`` of the complete (and, ``open_too``, open) groups whose
        buffered members are older than ``min_version``."""
        groups = [(g, False) for g in self.open.values()] if open_too else []
        groups += [(g, True) for g in self.complete.values()]
        return [(g, done) for g, done in groups if g.rows and not within(g.version, min_version)]

    def figures(self) -> dict:
        """Rows and Arrow bytes held, and open groups (``SampleBuffer.stats``)."""
        held = self.held()
        return {"buffered_rows": sum(g.rows for g in held),
                "arrow_bytes": sum(g.nbytes for g in held), "groups_incomplete": len(self.open)}

    def oldest(self, n: int, limit: int | None = None) -> list[Group]:
        """The ``n`` complete groups that completed first; with ``limit`` (start order),
        the ``n`` that started first among those numbered below ``limit``."""
        return [self.complete[g] for g in take_order(self.complete, limit)[:n]]

    def first_in_line(self, group: Group) -> None:
        """A complete ``group`` (back from a lost step) goes to the front of the queue."""
        self.complete[group.group_id] = group
        self.complete.move_to_end(group.group_id, last=False)

    def add_complete(self, group: Group) -> None:
        """A complete ``group`` (restored or recovered) joins the end of the queue."""
        self.complete[group.group_id] = group

    def close_all(self, group_ids) -> None:
        """Groups known to have left (restored or recovered ones)."""
        for gid in group_ids:
            self.close(gid)


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
