"""The staleness bound as one plain object: which data may still be trained, which
members to abort, which weights a worker loads.

Consumes versions (the trainer's, a group's, a member's oldest generated token's);
produces decisions. Called by the runtime at each site that applies the bound — the
trainer asking the ``SampleBuffer`` for ``min_version`` groups (``rollart.control.modes``),
the buffer dropping complete groups below it (``SampleBuffer.get_table``), env managers
aborting members that can no longer meet it (``EnvManager.abort_older_than``) — and by
the cluster simulator (``rollart.sim``) with the same object.

A trajectory may be trained at trainer version ``v`` only if its oldest token's policy
version is ≥ ``v - alpha`` (DESIGN.md, bounded staleness); ``alpha = 0`` is on-policy.

>>> b = StalenessBound(1)
>>> b.min_version(5), b.fresh(4, 5), b.fresh(3, 5), b.abort(3, 5)
(4, True, False, True)
>>> within(3, min_version=4)
False
>>> WeightRule().version_to_load(published=[1, 2, 3], held=1)
3
"""

from __future__ import annotations

from dataclasses import dataclass

POLL_S = 0.25  # inference workers look at the weight store this often (rollout.worker)


def within(version: int, min_version: int) -> bool:
    """``version`` meets a bound already turned into ``min_version``."""
    return version >= min_version


@dataclass(frozen=True)
class StalenessBound:
    """Train on data at most ``alpha`` versions behind the trainer."""

    alpha: int

    def __post_init__(self):
        if not isinstance(self.alpha, int) or self.alpha < 0:
            raise ValueError(f"StalenessBound(alpha={self.alpha!r}): alpha must be an int "
                             "≥ 0 (GRPO.alpha)")

    def min_version(self, trainer_version: int) -> int:
        """The oldest version a trainer at ``trainer_version`` may train on."""
        return trainer_version - self.alpha

    def fresh(self, group_version: int, trainer_version: int) -> bool:
        """A group whose oldest token is ``group_version`` may be trained now."""
        return within(group_version, self.min_version(trainer_version))

    def abort(self, member_version: int | None, trainer_version: int) -> bool:
        """A running member whose oldest generated token is ``member_version`` can never
        be trained any more (``None``: nothing generated yet, keep it)."""
        return member_version is not None and not self.fresh(member_version,
                                                             trainer_version)

    def lag(self, member_version: int, trainer_version: int) -> int:
        """Versions between the trainer and the member's oldest token (the staleness)."""
        return trainer_version - member_version


@dataclass(frozen=True)
class WeightRule:
    """Which version an inference worker loads, and when: the newest published one
    above what it holds, found by polling the store every ``poll_s`` seconds (lockstep
    modes ask at once: ``wait_version``)."""

    poll_s: float = POLL_S

    def version_to_load(self, published, held: int) -> int | None:
        newest = max(published, default=None)
        return newest if newest is not None and newest > held else None
