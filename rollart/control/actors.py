"""``Actors``: the record of everything a run started on the cluster, one ``Member``
(role, pool tag, worker address, handle) per actor.

``rollart.control.stages.Stages`` builds and re-builds it (``start``, ``reconcile``);
the control loop, the fleet and the modes read the trainer, the buffer, the inference
workers and the env managers by pool from it; the run's config and metrics record its
``placement``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart.policy.affinity import env_tag
from rollart.types import BUFFER, TRAIN

ROLES = ("trainer", "buffer", "inference", "env")


@dataclass
class Member:
    """One placed actor: its ``role`` (``ROLES``; ``"rank"``: a trainer gang's rank
    1, 2, ..., placed by the gang's rank 0, no handle), pool ``tag``, worker ``address``
    and handle."""

    role: str
    tag: str
    address: str
    actor: object


class Actors:
    """The record of everything a run started on the cluster: one ``Member`` per actor.
    Everything else (the trainer, the buffer, the workers and managers by pool, the
    placement) is read from the members, never kept beside them.

    >>> a = Actors(None, None, [("w", "H800", "tcp://w:1")], [])
    >>> a.placement["inference"], a.workers
    (['tcp://w:1'], [('w', 'H800', 'tcp://w:1')])
    """

    def __init__(self, trainer=None, buffer=None, workers=(), managers=(),
                 manager_tags=None):
        self.members: list[Member] = []
        for role, actor in (("trainer", trainer), ("buffer", buffer)):
            if actor is not None:
                self.add(role, actor, TRAIN if role == "trainer" else BUFFER,
                         getattr(actor, "_address", None))
        for w, tag, addr in workers:
            self.add("inference", w, tag, addr)
        for m, tag in zip(managers, manager_tags or [None] * len(managers)):
            self.add("env", m, tag, getattr(m, "_address", None))

    def _one(self, role: str):
        return next((m.actor for m in self.members if m.role == role), None)

    @property
    def trainer(self):
        return self._one("trainer")

    @property
    def buffer(self):
        return self._one("buffer")

    @property
    def workers(self) -> list[tuple]:
        """``[(InferenceWorker actor, pool tag, address)]``."""
        return self.of("inference")

    @property
    def managers(self) -> list:
        return [m.actor for m in self.members if m.role == "env"]

    @property
    def manager_tags(self) -> list:
        """The pool tag of each manager (in ``managers``' order)."""
        return [m.tag for m in self.members if m.role == "env"]

    @property
    def placement(self) -> dict[str, list[str]]:
        """Role -> the addresses of the workers its actors run on; a trainer gang's:
        every rank's, in rank order (``set_ranks``)."""
        out = {role: sorted({m.address for m in self.members if m.role == role})
               for role in ROLES}
        ranks = [m.address for m in self.members if m.role == "rank"]
        if ranks:
            out["trainer"] = out["trainer"][:1] + ranks
        return out

    def set_ranks(self, addresses: list[str]) -> None:
        """The workers of a trainer gang's ranks 1, 2, ... (rank 0's is the trainer's),
        as the gang last formed (its ``stats()["ranks"]``)."""
        self.members = [m for m in self.members if m.role != "rank"]
        self.members += [Member("rank", TRAIN, a, None) for a in addresses]

    def managers_for(self, task) -> list:
        """The env managers on the pool ``task``'s env declares (all when untagged)."""
        tag = env_tag(task)
        mine = [m for m, t in zip(self.managers, self.manager_tags) if t == tag]
        return mine or self.managers

    def of(self, role: str, tag: str | None = None) -> list[tuple]:
        """``[(actor, tag, address)]`` of ``role`` (on ``tag``'s pool, if given)."""
        return [(m.actor, m.tag, m.address) for m in self.members
                if m.role == role and (tag is None or m.tag == tag)]

    def remove(self, role: str, actor) -> None:
        self.members = [m for m in self.members if not (m.role == role and m.actor is actor)]

    def add(self, role: str, actor, tag: str, addr: str) -> None:
        """Record a new actor of ``role``; a trainer or buffer replaces the one before."""
        if role in ("trainer", "buffer"):  # one of each; the buffer's pool reads BUFFER
            self.members = [m for m in self.members if m.role != role and
                            not (role == "trainer" and m.role == "rank")]
            tag = TRAIN if role == "trainer" else BUFFER
        self.members.append(Member(role, tag, addr, actor))
