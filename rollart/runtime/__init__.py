"""Dask plumbing: actor handles, calls to a near actor, bounded waits, process priority."""
