"""Dask plumbing: the cluster and its pools, the one lost-actor rule, actor handles,
calls to a near actor, many items in one actor call, bounded waits, process priority,
durable files, Dask's log level.

Consumes a resources declaration (``resources``: pools to a ``SpecCluster``, tag
checks), Dask actors and futures; produces clusters, handles that fail fast on a lost
worker (``handles``, ``lost``), calls to an actor on the caller's own worker (``near``),
batched deliveries (``coalesce``), bounded waits (``waits``), rollout niced on the
trainer's host (``priority``), durable step folders through fsspec (``storage``) and
Dask's loggers quiet unless asked (``logs``).
Called by every stage and the control plane; it imports only ``rollart.types``.
"""
