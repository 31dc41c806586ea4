"""The trajectory ledger: every launched trajectory ends in exactly one final state.

Consumes state changes from the ``SampleBuffer`` (which owns one ledger) and its
``Handout`` (``rollart.buffer.handout``: hand-outs, settlements): launches and
cancellations/aborts reported by the env managers, arrivals, hand-outs to the trainer
(``taken``) and its confirmations (``trained``). Produces the counts every metrics row
carries, the accounting invariant

    launched = in_flight + buffered + taken + trained + dropped + aborted + cancelled
               + failed + lost_in_step

and the changes since they were last drained (``drain``: what the buffer's journal,
``rollart.buffer.journal``, writes). A trajectory moves

    in_flight -> buffered -> taken -> trained        (its step's update was published)
                    |          |----> buffered       (the step was lost: re-used)
                    |          '----> lost_in_step   (the step was lost: never re-run)
                    '--> dropped                      (too stale)
    in_flight -> failed | aborted | cancelled | dropped (a late member)

An impossible transition (a trajectory trained twice, delivered after it was cancelled,
launched twice, moved without ever being launched) raises ``AccountingError`` at once
instead of skewing the numbers. An id first reported when it arrives or settles, never
launched here (a buffer fed without env managers: tests, tools), is ``adopt``ed: launched
then, and counted (``unannounced``, outside the invariant), never taken in silently. The
ledger is a plain part of the buffer: it knows ids and states only.
"""

from __future__ import annotations

from collections import Counter

from rollart.types import TrajState

IN_FLIGHT = "in_flight"
BUFFERED = TrajState.BUFFERED.value
TAKEN = TrajState.TAKEN.value
TRAINED = TrajState.TRAINED.value
DROPPED = TrajState.DROPPED.value
LOST_IN_STEP = TrajState.LOST_IN_STEP.value
FINAL = tuple(s.value for s in (TrajState.TRAINED, TrajState.DROPPED, TrajState.ABORTED,
                                TrajState.CANCELLED, TrajState.FAILED,
                                TrajState.LOST_IN_STEP))
STATES = (IN_FLIGHT, BUFFERED, TAKEN) + FINAL
UNANNOUNCED = "unannounced"  # launches adopted from a report (``Ledger.adopt``), counted
_ALLOWED = {
    IN_FLIGHT: {BUFFERED, *(s for s in FINAL if s != LOST_IN_STEP)},
    # trained straight from buffered: a batch taken without a step to confirm
    BUFFERED: {TAKEN, TRAINED, DROPPED},
    TAKEN: {TRAINED, BUFFERED, LOST_IN_STEP},
}


class AccountingError(RuntimeError):
    """A trajectory changed state in a way that would lose or double-count it."""


class Ledger:
    """``traj_id -> state`` with transition checks, running counts and a change log."""

    def __init__(self):
        self.state: dict[str, str] = {}
        self.counts: Counter = Counter()
        self.changes: list[tuple[str, str, int | None]] = []  # since the last drain

    def launch(self, traj_id: str) -> None:
        if traj_id in self.state:
            raise AccountingError(f"trajectory {traj_id} launched twice "
                                  f"(it is {self.state[traj_id]})")
        self.state[traj_id] = IN_FLIGHT
        self.counts["launched"] += 1
        self.counts[IN_FLIGHT] += 1
        self.changes.append((traj_id, IN_FLIGHT, None))

    def adopt(self, traj_id: str) -> bool:
        """Launch ``traj_id`` if it never was: it is reported (arrived, settled) without a
        launch here, which is counted (``counts["unannounced"]``). True if it was new.

        >>> led = Ledger(); led.launch("a")
        >>> led.adopt("a"), led.adopt("b"), led.counts["unannounced"], led.check()["launched"]
        (False, True, 1, 2)
        """
        if traj_id in self.state:
            return False
        self.launch(traj_id)
        self.counts[UNANNOUNCED] += 1
        return True

    def __contains__(self, traj_id: str) -> bool:
        return traj_id in self.state

    def move(self, traj_id: str, new: str, step: int | None = None) -> None:
        """Record ``traj_id`` entering ``new`` (``step``: the trainer step of a taken or
        trained row). An id never launched is refused."""
        if new not in STATES:
            raise AccountingError(f"unknown trajectory state {new!r}")
        if traj_id not in self.state:
            raise AccountingError(f"trajectory {traj_id} was never launched: it cannot "
                                  f"go to {new}")
        old = self.state[traj_id]
        if new not in _ALLOWED.get(old, ()):
            raise AccountingError(f"trajectory {traj_id} cannot go from {old} to {new}")
        self.state[traj_id] = new
        self.counts[old] -= 1
        self.counts[new] += 1
        self.changes.append((traj_id, new, step))

    def drain(self) -> list[tuple[str, str, int | None]]:
        """The ``(traj_id, state, step)`` changes since the last drain, oldest first."""
        out, self.changes = self.changes, []
        return out

    def load(self, state: dict[str, str], counts: dict[str, int] | None = None) -> None:
        """Continue from a recorded ledger: ``state`` per id and, when given, the totals
        (which may cover ids ``state`` does not list: a run resumed from an old
        checkpoint); without ``counts`` they are counted from ``state``."""
        self.state = dict(state)
        self.counts = Counter(counts) if counts is not None else Counter(
            {"launched": len(state), **Counter(state.values())})
        self.changes = []

    def assume(self, traj_id: str, state: str) -> None:
        """Know ``traj_id`` in ``state`` without counting it (totals loaded from an old
        checkpoint already count the ids its state lacks); a known id keeps its state."""
        self.state.setdefault(traj_id, state)

    def end_in_flight(self, state: str) -> None:
        """Every trajectory in flight ends in ``state``, the ones the loaded totals count
        but ``state`` does not list (an old checkpoint's) included."""
        for t in self.in_flight():
            self.move(t, state)
        left = self.counts[IN_FLIGHT]
        if left:
            self.counts[state] += left
            self.counts[IN_FLIGHT] = 0

    def in_flight(self, prefix: str | tuple[str, ...] = "") -> list[str]:
        """Ids in flight (whose id starts with ``prefix``, if given), in launch order."""
        return [t for t, s in self.state.items() if s == IN_FLIGHT and t.startswith(prefix)]

    def totals(self) -> dict[str, int]:
        return {"launched": self.counts["launched"], **{s: self.counts[s] for s in STATES}}

    def check(self) -> dict[str, int]:
        """The totals, after verifying that they add up to the launches."""
        t = self.totals()
        if sum(t[s] for s in STATES) != t["launched"] or min(t.values()) < 0:
            raise AccountingError(f"trajectory counts do not add up: {t}")
        return t
