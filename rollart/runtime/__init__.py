"""Dask plumbing: the cluster and its pools, the one lost-actor rule, actor handles,
calls to a near actor, many items in one actor call, bounded waits, process priority,
durable files."""
