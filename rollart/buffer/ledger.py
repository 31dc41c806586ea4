"""The trajectory ledger: every launched trajectory ends in exactly one final state.

Consumes state changes from the ``SampleBuffer`` (which owns one ledger): launches and
cancellations/aborts reported by the env managers, arrivals, and hand-outs to the
trainer. Produces the counts every metrics row carries and the accounting invariant

    launched = in_flight + buffered + trained + dropped + aborted + cancelled + failed

An impossible transition (a trajectory trained twice, delivered after it was cancelled,
launched twice) raises ``AccountingError`` at once instead of skewing the numbers.
"""

from __future__ import annotations

from collections import Counter

from rollart.types import TrajState

IN_FLIGHT = "in_flight"
BUFFERED = TrajState.BUFFERED.value
FINAL = tuple(s.value for s in (TrajState.TRAINED, TrajState.DROPPED, TrajState.ABORTED,
                                TrajState.CANCELLED, TrajState.FAILED))
STATES = (IN_FLIGHT, BUFFERED) + FINAL
_ALLOWED = {
    IN_FLIGHT: {BUFFERED, *FINAL},
    BUFFERED: {TrajState.TRAINED.value, TrajState.DROPPED.value},
}


class AccountingError(RuntimeError):
    """A trajectory changed state in a way that would lose or double-count it."""


class Ledger:
    """``traj_id -> state`` with transition checks and running counts."""

    def __init__(self):
        self.state: dict[str, str] = {}
        self.counts: Counter = Counter()

    def launch(self, traj_id: str) -> None:
        if traj_id in self.state:
            raise AccountingError(f"trajectory {traj_id} launched twice "
                                  f"(it is {self.state[traj_id]})")
        self.state[traj_id] = IN_FLIGHT
        self.counts["launched"] += 1
        self.counts[IN_FLIGHT] += 1

    def move(self, traj_id: str, new: str) -> None:
        """Record ``traj_id`` entering ``new``; an unknown id counts as launched now."""
        if new not in STATES:
            raise AccountingError(f"unknown trajectory state {new!r}")
        if traj_id not in self.state:
            self.launch(traj_id)
        old = self.state[traj_id]
        if new not in _ALLOWED.get(old, ()):
            raise AccountingError(f"trajectory {traj_id} cannot go from {old} to {new}")
        self.state[traj_id] = new
        self.counts[old] -= 1
        self.counts[new] += 1

    def totals(self) -> dict[str, int]:
        return {"launched": self.counts["launched"], **{s: self.counts[s] for s in STATES}}

    def check(self) -> dict[str, int]:
        """The totals, after verifying that they add up to the launches."""
        t = self.totals()
        if sum(t[s] for s in STATES) != t["launched"] or min(t.values()) < 0:
            raise AccountingError(f"trajectory counts do not add up: {t}")
        return t
