"""``TurnBarrier``: a batch of trajectories that advances turn by turn (lockstep).

The synchronous baselines (``one-off``, ``sync``: ``rollart.control.modes.lockstep``)
run each step's batch through ``EnvManager.run_batch``, which gives every member's
``TrajectoryRunner.run`` one barrier: before each generation a member waits until every
live member of the batch has arrived, and a member that finishes leaves, so the others
stop waiting for it. Plain asyncio on the env manager's event loop, no actor; the
simulator's ``rollart.sim.members.Barrier`` follows the same rule.
"""

from __future__ import annotations

import asyncio

__all__ = ["TurnBarrier"]


class TurnBarrier:
    """All live members wait at each turn until every one of them has arrived.

    A member that finishes calls ``leave`` so the others do not wait for it.
    """

    def __init__(self, parties: int):
        self.parties = parties
        self.arrived = 0
        self._release = asyncio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        release = self._release
        if self.arrived >= self.parties:
            self._open()
        await release.wait()

    def leave(self) -> None:
        self.parties -= 1
        if self.parties > 0 and self.arrived >= self.parties:
            self._open()

    def _open(self) -> None:
        self._release.set()
        self._release = asyncio.Event()
        self.arrived = 0
