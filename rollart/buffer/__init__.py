"""Trajectory storage: the Arrow/Parquet schema and the ``SampleBuffer`` actor.

Rollout code ``put``s finished ``Trajectory`` records into a ``SampleBuffer``; the trainer
takes bounded-stale GRPO groups with ``get_batch``; analysis reads what left the buffer
with ``read_samples(run_dir)``.
"""

from rollart.buffer.buffer import SampleBuffer
from rollart.buffer.schema import (
    SCHEMA,
    SCHEMA_VERSION,
    from_table,
    read_samples,
    to_record_batch,
    write_parquet,
)

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "SampleBuffer",
    "from_table",
    "read_samples",
    "to_record_batch",
    "write_parquet",
]
