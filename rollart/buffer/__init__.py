"""Trajectory storage: the Arrow/Parquet schema and the ``SampleBuffer`` actor.

Rollout code ``put``s finished ``Trajectory`` records into a ``SampleBuffer``; the trainer
takes bounded-stale GRPO groups with ``get_table`` and confirms them with
``mark_trained``; analysis reads the latest state of every row with
``read_samples(run_dir)`` (the ``samples/`` parts plus the buffer's journal: see
``rollart.buffer.journal`` for the run dir's layout).
"""

from rollart.buffer.buffer import SampleBuffer
from rollart.buffer.journal import read_samples
from rollart.buffer.schema import (
    SCHEMA,
    SCHEMA_VERSION,
    from_table,
    read_parts,
    to_record_batch,
    write_parquet,
)

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "SampleBuffer",
    "from_table",
    "read_parts",
    "read_samples",
    "to_record_batch",
    "write_parquet",
]
