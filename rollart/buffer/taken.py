"""``TakenBatches``: the ``SampleBuffer``'s part that holds the batches trainer steps took.

A batch the trainer takes for step ``s`` (``get_table(..., trained_step=s)``) is held
here as ``taken`` until the trainer confirms that the update trained on it was published
(``mark_trained(s)``: the rows leave as ``trained``). A step that lost its trainer is
settled instead (``release_taken(s, min_version)``, called by ``rollart.control.modes``
after it replaced the trainer, or the next ``get_table``): if the trainer that asks
already holds a newer version than the batch was taken for, only the lost step's own
update can have published it, so the rows are ``trained`` and the step stands (the
pipeline records it from the figures made here: size, digest, per-task reward);
otherwise the groups go back to the front of the queue for the re-run step.

Holds ``step -> Taken`` (``rollart.buffer.group``) and decides ``published``; the
buffer's ``Handout`` (``rollart.buffer.handout``) moves the rows in the ledger and queue,
and the ``SampleBuffer`` (``rollart.buffer.buffer``) in its files.
``rollart.buffer.restore`` refills it from a checkpoint or the journal.
"""

from __future__ import annotations

import uuid

import pyarrow as pa

from rollart.buffer.group import Group, Taken
from rollart.buffer.schema import SCHEMA, batch_digest, batch_metrics, from_table


def row_ids(batches: list[pa.RecordBatch]) -> list[str]:
    """The ``traj_id`` of every row, in order."""
    return [t for b in batches for t in b.column("traj_id").to_pylist()]


class TakenBatches:
    """``step -> Taken``: the groups each trainer step holds until it is confirmed or
    settled (module docstring).

    >>> tb = TakenBatches()
    >>> tb.hold(3, min_version=1, groups=[]).min_version, 3 in tb, tb.published(3, 1)
    (1, True, False)
    """

    def __init__(self):
        self._by_step: dict[int, Taken] = {}

    def __contains__(self, step: int) -> bool:
        return step in self._by_step

    def steps(self) -> list[int]:
        """Steps holding a batch, oldest first."""
        return sorted(self._by_step)

    def get(self, step: int) -> Taken | None:
        return self._by_step.get(step)

    def hold(self, step: int, min_version: int, groups: list[Group],
             take: str | None = None) -> Taken:
        """Step ``step`` takes ``groups`` (for a trainer at ``min_version``); ``take``
        names the hand-out (a fresh one when not given)."""
        taken = self._by_step[step] = Taken(min_version, groups, take or uuid.uuid4().hex[:12])
        return taken

    def adopt(self, step: int, meta: dict, group: Group) -> None:
        """Add ``group`` to step ``step``'s batch (a checkpoint's or the journal's;
        ``meta``: ``Taken.meta()`` of the step, used when the step is new here)."""
        if step not in self._by_step:
            self.hold(step, meta["min_version"], [], meta["take"])
        self._by_step[step].groups.append(group)

    def pop(self, step: int) -> Taken | None:
        """Step ``step``'s batch, no longer held (None if none is)."""
        return self._by_step.pop(step, None)

    def published(self, step: int, min_version: int) -> bool:
        """Was step ``step``'s update published, judged by a trainer at ``min_version``
        asking? Only if that trainer holds a newer version than the batch was taken for
        (only that step's update can have made it)."""
        return min_version > self._by_step[step].min_version

    def figures(self, step: int, trained_on: int | None = None) -> dict:
        """Step ``step``'s batch digest (``batch_sha1``) and, given the version its update
        was computed on (``trained_on``), the trainer's figures (``metrics``)."""
        rows = [b for g in self._by_step[step].groups for b in g.arrow()]
        out = {"batch_sha1": batch_digest(row_ids(rows))}
        if trained_on is not None:
            out["metrics"] = batch_metrics(
                from_table(pa.Table.from_batches(rows, schema=SCHEMA)), trained_on)
        return out

    def groups(self) -> list[tuple[int, Group]]:
        """``(step, group)`` of every group held, by step in the order taken."""
        return [(s, g) for s, t in self._by_step.items() for g in t.groups]

    def in_training(self) -> int:
        """Groups held: steps took them and their update is not published yet."""
        return sum(len(t.groups) for t in self._by_step.values())

    def rows(self) -> int:
        return sum(t.rows for t in self._by_step.values())

    def meta(self) -> dict:
        """``{step: {"min_version", "take"}}`` (JSON keys) for the journal and snapshots."""
        return {str(s): t.meta() for s, t in self._by_step.items()}
