"""The simulated run's records: a turn barrier, trajectories (members), their groups and
the env managers that run them.

Consumes a simpy environment and the runtime's ``Router``; produces the mutable records
``rollart.sim.cluster.Cluster`` keeps per group and per member (``Member``, ``Group``),
the lockstep modes' ``Barrier`` (``TurnBarrier``'s rule) and ``Manager`` (an
``EnvManager``'s slots, router and event loop). Used by ``rollart.sim.cluster`` and
``rollart.sim.modes``.
"""

from __future__ import annotations

import simpy

from rollart.policy.routing import Router
from rollart.sim.pools import Meter


class Barrier:
    """``TurnBarrier``'s rule: every live member waits at each turn for all of them."""

    def __init__(self, env, parties: int):
        self.env, self.parties, self.arrived = env, parties, 0
        self.event = env.event()

    def wait(self):
        self.arrived += 1
        ev = self.event
        self._maybe_open()
        return ev

    def leave(self) -> None:
        self.parties -= 1
        self._maybe_open()

    def _maybe_open(self) -> None:
        if self.parties > 0 and self.arrived >= self.parties:
            ev, self.event, self.arrived = self.event, self.env.event(), 0
            ev.succeed()


class Member:
    __slots__ = ("id", "group", "proc", "req", "worker", "oldest", "tokens", "state",
                 "failed")

    def __init__(self, traj_id: str, group):
        self.id, self.group = traj_id, group
        self.proc = self.req = self.worker = self.oldest = None
        self.tokens, self.state, self.failed = 0, None, False


class Group:
    def __init__(self, env, work, manager, barrier=None):
        self.task, self.seed, self.gid = work.task, work.seed, work.group_id
        self.size, self.need = work.size, work.need
        self.manager, self.barrier = manager, barrier
        self.members: dict[str, Member] = {}
        self.delivered: list[Member] = []
        self.replaced = self.backups = self.backup_at = self.next_index = 0
        self.done = env.event()

    @property
    def filled(self) -> bool:
        return len(self.delivered) >= self.need

    @property
    def version(self) -> int | None:
        versions = [m.oldest for m in self.delivered if not m.failed and m.oldest is not None]
        return min(versions) if versions else None


class Manager:
    """A simulated ``EnvManager``: its env pool's slots, its own ``Router`` copy, and its
    event loop (one asyncio loop shared by all its trajectories: a capacity-1 resource
    each turn holds for ``Costs.manager_turn_s``)."""

    def __init__(self, env, name: str, slots: simpy.Resource, meter: Meter, router: Router,
                 near: tuple = ()):
        self.name, self.slots, self.meter, self.router = name, slots, meter, router
        self.loop = simpy.Resource(env, capacity=1)
        self.loop_busy = 0.0
        self.near = near  # inference workers in this manager's process (one GIL)

    def turn(self, env, seconds: float):
        """One turn's Python on the loop: wait for it, hold it ``seconds`` (the workers
        of its process wait for the GIL as long)."""
        with self.loop.request() as req:
            yield req
            for w in self.near:
                w.stall(seconds)
            yield env.timeout(seconds)
        self.loop_busy += seconds
