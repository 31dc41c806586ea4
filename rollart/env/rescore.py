"""A stale member keeps what can be kept: its tokens re-scored instead of regenerated.

With ``Rollout.stale_members="rescore"`` (async mode) a running member whose oldest
generated token falls below the staleness bound is not aborted and run again: at its next
turn boundary, and once more when it ends (after its reward, before it is delivered),
the generated tokens older than the bound are re-scored under the weights an inference
worker holds now (``LLMProxy.rescore`` → ``InferenceWorker.rescore``: one forward over
prompt + turns, no sampling), their log-probs and versions replaced in the member's
``TokenLog``; the tokens stay and the member goes on. This is the paper's suspend →
update → resume → recompute-KV applied to a member between two turns.

Consumes the floor the driver broadcasts (``EnvManager.abort_older_than(min_version)``:
``raise_floor``) and a member's ``TokenLog``; ``refresh`` answers whether the member may
go on. A worker that cannot reach the floor within ``wait`` seconds (it has not loaded
the new weights yet), or cannot re-score at all, makes ``refresh`` answer False: the
``EnvManager`` then aborts the member as ``"abort"`` would have (counted in
``rescore_failed``). Held by the ``EnvManager``, whose ``TrajectoryRunner`` calls it.

>>> from rollart.chat.conversation import TokenLog
>>> log = TokenLog([1, 2])
>>> log.add_generation([5, 6], [-0.1, -0.2], [3, 4]); log.add_observation([7])
>>> log.add_generation([8], [-0.3], [5])
>>> stale_positions(log, min_version=5)
[0, 1]
"""

from __future__ import annotations

import logging

from rollart.policy.staleness import within
from rollart.types import ScoreRequest

logger = logging.getLogger(__name__)

#: Rollout.stale_members values: what becomes of a running member that crossed the bound
STALE_MEMBERS = ("abort", "rescore")
#: s a re-scoring waits for the worker to hold the floor's version before giving up
WAIT_S = 5.0


def stale_members_problem(value) -> str | None:
    """Why ``value`` cannot be ``Rollout.stale_members``, or None."""
    if value in STALE_MEMBERS:
        return None
    return (f"Rollout.stale_members must be one of {STALE_MEMBERS}, got {value!r}: 'abort' "
            "runs a member that crossed the staleness bound again from the start, "
            "'rescore' re-scores its old tokens under the new weights and keeps them "
            "(e.g. --set rollout.stale_members=rescore)")


def stale_positions(log, min_version: int) -> list[int]:
    """Indices into ``log.response_ids`` of the generated tokens older than
    ``min_version`` (the ones that keep the member from being trained)."""
    return [i for i, (m, v) in enumerate(zip(log.loss_mask, log.versions))
            if m and not within(v, min_version)]


class Rescorer:
    """The floor and the re-scoring of one ``EnvManager``'s members (module docstring);
    ``temperature``: the sampling temperature the behaviour log-probs were taken under."""

    def __init__(self, temperature: float, wait: float = WAIT_S):
        self.temperature = float(temperature)
        self.wait = float(wait)
        self.floor: int | None = None  # the newest min_version broadcast
        # rescored_members: re-scorings (a member may have several), at_end of them once
        # the member's turns were over (the others at a turn boundary, mid-episode)
        self.counts = {"rescored_tokens": 0, "rescored_members": 0, "rescored_at_end": 0,
                       "rescore_failed": 0}

    def raise_floor(self, min_version: int) -> None:
        """The trainer moved on: tokens older than ``min_version`` can no longer train."""
        self.floor = int(min_version) if self.floor is None else max(self.floor,
                                                                       int(min_version))

    async def refresh(self, proxy, traj_id: str, task: str | None, log, pools=None,
                      at_end: bool = False) -> bool:
        """Re-score ``log``'s tokens older than the floor through ``proxy`` (the
        trajectory's worker); False when they could not be brought up to it."""
        floor = self.floor
        stale = [] if floor is None else stale_positions(log, floor)
        if not stale:
            return True
        start = len(log.prompt_ids)
        ids = log.ids[:start + stale[-1] + 1]  # the context up to the last stale token
        req = ScoreRequest(ids, [start + i for i in stale], self.temperature, floor)
        try:
            res = await proxy.rescore(traj_id, req, pools, task, self.wait)
        except Exception as e:  # noqa: BLE001 - the member is aborted, as without rescore
            logger.warning("re-scoring %s failed (%s: %s); it is aborted", traj_id,
                           type(e).__name__, e)
            res = None
        if res is None or not within(res.version, floor) or len(res.logprobs) != len(stale):
            self.counts["rescore_failed"] += 1
            return False
        for i, lp in zip(stale, res.logprobs):
            log.logprobs[i] = lp
            log.versions[i] = res.version
        self.counts["rescored_tokens"] += len(stale)
        self.counts["rescored_members"] += 1
        self.counts["rescored_at_end"] += at_end
        return True
