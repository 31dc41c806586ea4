"""Decisions without I/O, shared by the runtime and the simulator (rollart.sim).

Consumes counts, versions, declarations and timings; produces decisions, as plain
objects with no Dask and no clock of their own: ``staleness`` (may a trajectory train at
this version), ``admission`` (the group sequence, slots, start bounds), ``redundancy``
(members, backups, first finishers), ``routing`` (which inference worker serves a
request), ``affinity`` (task, env, reward and phase pool declarations and their checks),
``scaling`` (the elastic reward pool's size), ``watchdog`` (when a run that no longer
progresses stops, and why), ``quarantine`` (when a task whose every trajectory fails
stops being launched). Called by the actors of the data plane, the control plane
and ``rollart.sim``'s simulated cluster, so the runtime and the simulator decide alike.
"""
