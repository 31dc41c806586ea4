"""The ``SampleBuffer``'s taken batches: confirmed as ``trained``, or settled after a loss.

A batch the trainer takes for step ``s`` (``get_table(..., trained_step=s)``) is held
here as ``taken`` until the trainer confirms that the update trained on it was published
(``mark_trained(s)``: the rows leave as ``trained``). A step that lost its trainer is
settled instead (``release_taken(s, min_version)``, called by ``rollart.control.modes`` after
it replaced the trainer, or the next ``get_table``): if the trainer that asks already
holds a newer version than the batch was taken for, only the lost step's own update can
have published it, so the rows are ``trained`` and the step stands (the pipeline records
it from the figures returned here: size, digest, per-task reward); otherwise the groups
go back to the front of the queue for the re-run step.

Mixed into ``SampleBuffer`` (``rollart.buffer.buffer``), which holds the state used
here (``_taken``, ``_complete``, the ledger, the store); its methods run on the buffer
worker's event loop like the rest of the buffer's.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from rollart.buffer.schema import SCHEMA, batch_digest, batch_metrics, from_table
from rollart.types import TrajState

logger = logging.getLogger(__name__)

BUFFERED = TrajState.BUFFERED.value


def _ids(batches: list[pa.RecordBatch]) -> list[str]:
    return [t for b in batches for t in b.column("traj_id").to_pylist()]


class TakenBatches:
    """``SampleBuffer``'s taken-batch bookkeeping (module docstring)."""

    def _confirm(self, step: int, state: TrajState = TrajState.TRAINED) -> int:
        """Step ``step``'s taken rows leave as ``state``; returns how many."""
        taken = self._taken.pop(step, None)
        for g in taken.groups if taken else ():
            self._leave(g.arrow(), state, step, durable=True)
        if taken and state == TrajState.TRAINED:
            self._published(len(taken.groups))  # the admission counts it (backpressure)
        return taken.rows if taken else 0

    def _release(self, step: int) -> int:
        """Step ``step``'s taken groups go back to the front of the queue, in order."""
        taken = self._taken.pop(step)
        for g in reversed(taken.groups):
            for traj_id in _ids(g.arrow()):
                self.ledger.move(traj_id, BUFFERED)
            self._complete[g.group_id] = g
            self._complete.move_to_end(g.group_id, last=False)
            self._rehold(g.group_id)
        return taken.rows

    def _settle(self, step: int, min_version: int, trained_on: int | None = None) -> dict:
        """A taken batch whose confirmation will not come: ``trained`` if a trainer at
        ``min_version`` holds a newer version than the batch was taken for (only that
        step's update can have published it), else buffered again. Trained, it comes
        with its digest (``batch_sha1``) and, given the version its update was computed
        on (``trained_on``), the trainer's per-batch figures (``metrics``:
        ``batch_metrics``)."""
        if min_version <= self._taken[step].min_version:
            return {"trained": 0, "buffered": self._release(step)}
        rows = [b for g in self._taken[step].groups for b in g.arrow()]
        out = {"batch_sha1": batch_digest(_ids(rows))}
        if trained_on is not None:
            out["metrics"] = batch_metrics(
                from_table(pa.Table.from_batches(rows, schema=SCHEMA)), trained_on)
        return {"trained": self._confirm(step), "buffered": 0, **out}

    async def mark_trained(self, step: int, take: str | None = None) -> int:
        """The trainer published the update of step ``step``: its taken rows become
        ``trained`` (durably, before this returns). ``take``: the batch's
        ``TAKE_KEY`` metadata; a confirmation for another hand-out of ``step`` than the
        one taken now is refused (its step was settled, and maybe re-run, meanwhile).
        Returns rows confirmed; 0 when nothing (or another hand-out) is taken for it."""
        async with self._condition:
            taken = self._taken.get(step)
            if taken is not None and take is not None and take != taken.take:
                logger.warning("step %d: a confirmation for hand-out %s refused (%s is "
                               "taken now)", step, take, taken.take)
                return 0
            n = self._confirm(step)
            fut = self._entry() if n else None
        await self.store.wait(fut)
        await self.store.maybe_flush()
        return n

    async def release_taken(self, step: int, min_version: int,
                            trained_on: int | None = None) -> dict:
        """Step ``step`` was lost with its trainer; its replacement trains at
        ``min_version`` (= its version - alpha). If that trainer holds a newer version
        than the batch was taken for, the lost step's update was published: the rows
        are ``trained`` and the step is done, not re-run (``batch_sha1``, and
        ``metrics`` when ``trained_on`` is given: ``_settle``). Otherwise its groups are
        buffered again, first in line for the re-run step. Returns
        ``{"trained": n, "buffered": n, ...}`` (rows)."""
        async with self._condition:
            if step not in self._taken:
                return {"trained": 0, "buffered": 0}
            out = self._settle(step, min_version, trained_on)
            if out["buffered"]:
                self._condition.notify_all()
            fut = self._entry()
        await self.store.wait(fut)
        await self.store.maybe_flush()
        return out
