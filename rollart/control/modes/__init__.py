"""How rollout and training interleave: the modes, on the same actors.

==========  ==========================================================================
mode        one trainer step
==========  ==========================================================================
``async``   Trajectory-level: the buffer owns the backpressure. It holds
            ``max(alpha, 1) * groups_per_step`` slots; env managers take the next group
            when one frees (``EnvManager.take_work``, ``rollart.buffer.backpressure``),
            ``redundancy`` × members each, extras cancelled; the trainer takes any
            ``alpha``-fresh complete groups; workers pick up the new version from the
            weight store and swap it in at the next decode step; members that can no
            longer meet the bound are aborted and replaced. A step's take (which
            frees its slots) waits until every worker holds the version just
            published, and rollout processes on the trainer's host yield the CPU to
            the trainer (``rollart.runtime.priority``).
``areal``   AReaL's scheme: asynchronous like ``async`` (slots, redundancy, weights
            swapped in mid-trajectory), but the bound is checked only when a group
            starts: groups started ≤ ``(version + alpha + 1) * groups_per_step``
            (``rollart.policy.admission.StartBound``); nothing is aborted or dropped, so
            a long group is trained however stale it became (``alpha`` default 1).
``one-off`` One-step off-policy: the next batch rolls out (turn by turn, batch-level
            barriers) while the trainer trains on the current one (``alpha = 1``),
            launched once every worker holds the trainer's version.
``sync+``   The paper's main baseline: a batch's groups on the trainer's version,
            each trajectory on its own (``EnvManager.run_group``: no turn barrier,
            ``redundancy`` extras cancelled), then train with rollout stopped, then
            wait until every worker loaded the new version (``alpha = 0``).
``sync``    The strengthened synchronous baseline: roll out a batch turn by turn with
            every worker on the trainer's version, then train with rollout stopped,
            then wait until every worker loaded the new version (``alpha = 0``).
==========  ==========================================================================

Modules: ``base`` (``Pipeline``: what every mode shares: the trainer step and its
recovery, the watchdog), ``lockstep`` (the driver launches each batch, restarts the groups
of a lost manager, refills), ``asynchronous`` (the buffer's slots pace rollout). ``make_pipeline`` builds the graph's mode; used by
``rollart.control.loop``.
"""

from __future__ import annotations

from rollart.control.modes.asynchronous import AReaLPipeline, AsyncPipeline, slot_capacity
from rollart.control.modes.base import Pipeline
from rollart.control.modes.lockstep import OneOffPipeline, SyncPipeline, SyncPlusPipeline

PIPELINES = {"async": AsyncPipeline, "areal": AReaLPipeline, "one-off": OneOffPipeline,
             "sync+": SyncPlusPipeline, "sync": SyncPipeline}

__all__ = ["PIPELINES", "AReaLPipeline", "AsyncPipeline", "OneOffPipeline", "Pipeline",
           "SyncPipeline", "SyncPlusPipeline", "make_pipeline", "slot_capacity"]


def make_pipeline(fleet, graph) -> Pipeline:
    """The pipeline of ``graph.mode`` (one of ``rollart.config.graph.MODES``) over the
    run's ``fleet`` (``rollart.control.fleet.Fleet``)."""
    return PIPELINES[graph.mode](fleet, graph)
