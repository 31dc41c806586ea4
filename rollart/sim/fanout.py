"""How one weight version reaches every inference worker: the store or the gang's relay.

Consumes a ``rollart.sim.costs.WeightSync`` (the path, the per-GPU link rate, the
bucket size, the per-pull latency), the model's bytes, the trainer's ranks and each
puller's links and start time; produces a ``Fanout``: when each puller holds the whole
version, the version's sync time and how many bytes left the origins. Called by
``rollart.sim.cluster.Cluster.publish`` once per version; pure (no simpy, no I/O).

Two paths (``WeightSync.path``):

* ``store``: one store node serves every puller a whole copy. Its ``store_paths`` links
  are shared by the pullers that are pulling (a fluid processor share, each puller
  capped by its own links), so ``K`` pullers take ``K`` times one pull: the origin sends
  ``K`` copies (origin bytes ratio 1). What rollart had before the trainer gang.
* ``relay``: the trainer gang publishes a version as ``B`` buckets of about
  ``bucket_bytes``, bucket ``k`` written by rank ``k mod N`` (``rollart.trainer.gang``),
  so ``min(N, B)`` ranks are origins, each with one GPU's link. Pullers fetch buckets in
  rounds of one bucket time (``bucket / link rate``): a link carries one bucket per
  round, a puller with ``tp`` GPUs has ``tp`` links down and up; a bucket received in a
  round can be relayed from the next one (store and forward). Each round, buckets go
  rarest first, each to the pullers that hold the fewest buckets, served by peers that
  hold it (the relay) and by its origin only while no peer holds it, so the origins send
  about one copy in all (origin bytes ratio ``1/K``) and the copies of a bucket grow by
  ``1 + tp`` per round: a version takes about ``B / tp + log(K) / log(1 + tp)`` rounds.

Every pull also pays ``WeightSync.latency_s`` once (the manifest read and set-up). A
relaying puller joins at the first round boundary after its start (up to one bucket
time late: 21 ms for 256 MiB at 12.5 GB/s). Not modelled: links shared with other
traffic (KV transfers, training collectives), several GPUs' links through one node's
switch, cut-through (a bucket is relayed only once whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Fanout", "bucket_count", "fan_out"]


@dataclass(frozen=True)
class Fanout:
    """One version's distribution. ``done_s``: per puller, seconds from the publish until
    it holds every bucket (its start included); ``sync_s``: the last of them;
    ``origin_bytes``: bytes the origins (store node or trainer ranks) sent;
    ``delivered_bytes``: bytes the pullers received (one copy each)."""

    path: str
    done_s: tuple[float, ...]
    buckets: int
    origins: int
    origin_bytes: float
    delivered_bytes: float

    @property
    def sync_s(self) -> float:
        return max(self.done_s, default=0.0)

    @property
    def origin_ratio(self) -> float:
        """Origin bytes over delivered bytes: 1 for the store, about ``1/K`` relayed."""
        return self.origin_bytes / self.delivered_bytes if self.delivered_bytes else 0.0


def bucket_count(weight_bytes: float, bucket_bytes: float) -> int:
    """Buckets of a version: the trainer cuts its state into buckets of about
    ``bucket_bytes`` (``rollart.trainer.fsdp.buckets``); here all of one size."""
    return max(1, math.ceil(weight_bytes / bucket_bytes - 1e-9))


def fan_out(weights, weight_bytes: float, links: Sequence[int], ranks: int = 1,
            starts: Sequence[float] | None = None) -> Fanout:
    """Distribute ``weight_bytes`` to pullers with ``links[i]`` GPU links each (a worker's
    ``tp``), starting ``starts[i]`` seconds after the publish (default all at once),
    over ``weights.path`` from ``ranks`` trainer ranks (relay) or one store node."""
    links = np.asarray(links, dtype=np.int64)
    starts = np.zeros(len(links)) if starts is None else np.asarray(starts, dtype=float)
    if len(starts) != len(links):
        raise ValueError(f"fan_out: {len(links)} pullers but {len(starts)} start times")
    if (links < 1).any() or ranks < 1:
        raise ValueError("fan_out: every puller needs ≥ 1 link and the gang ≥ 1 rank")
    buckets = bucket_count(weight_bytes, weights.bucket_bytes)
    delivered = float(weight_bytes) * len(links)
    if not len(links):
        return Fanout(weights.path, (), buckets, 0, 0.0, 0.0)
    if weights.path == "store":
        done = _shared(float(weight_bytes), starts, links * weights.bytes_s,
                       weights.store_paths * weights.bytes_s)
        return Fanout("store", tuple(float(d) + weights.latency_s for d in done), buckets,
                      1, delivered, delivered)
    origins = min(int(ranks), buckets)
    done, sent = _relay(buckets, origins, links, starts,
                        weight_bytes / buckets / weights.bytes_s)
    return Fanout("relay", tuple(float(d) + weights.latency_s for d in done), buckets,
                  origins, sent * weight_bytes / buckets, delivered)


def _shared(size: float, starts: np.ndarray, caps: np.ndarray, rate: float) -> np.ndarray:
    """One server of ``rate`` bytes/s shared fairly by the jobs in progress (each job
    ``size`` bytes, arriving at ``starts[i]``, at most ``caps[i]`` bytes/s): when each
    finishes. Water-filling between events (arrivals and completions)."""
    n = len(starts)
    left = np.full(n, size)
    done = np.full(n, np.nan)
    order = list(np.argsort(starts, kind="stable"))
    active: list[int] = []
    t = float(starts[order[0]])
    while order or active:
        while order and starts[order[0]] <= t + 1e-12:
            active.append(order.pop(0))
        if not active:
            t = float(starts[order[0]])
            continue
        rates = _water_fill(rate, caps[active])
        finish = left[active] / rates
        step = float(finish.min())
        if order:
            step = min(step, float(starts[order[0]]) - t)
        left[active] -= rates * step
        t += step
        still = []
        for i, j in enumerate(active):
            if left[j] <= size * 1e-12 or finish[i] <= step * (1 + 1e-12):
                done[j] = t
            else:
                still.append(j)
        active = still
    return done


def _water_fill(rate: float, caps: np.ndarray) -> np.ndarray:
    """A fair share of ``rate`` over jobs capped at ``caps``: equal shares, a job's share
    that its cap leaves unused spread over the others."""
    out = np.zeros(len(caps))
    idx = np.argsort(caps, kind="stable")
    left, n = rate, len(caps)
    for k, i in enumerate(idx):
        share = left / (n - k)
        out[i] = min(caps[i], share)
        left -= out[i]
    return out


def _relay(buckets: int, origins: int, links: np.ndarray, starts: np.ndarray,
           round_s: float) -> tuple[np.ndarray, int]:
    """The relay in rounds of ``round_s`` (one bucket over one link): when each puller
    holds every bucket, and how many buckets the origins sent."""
    k = len(links)
    has = np.zeros((k, buckets), dtype=bool)  # pullers × buckets
    held = np.zeros(k, dtype=np.int64)
    copies = np.zeros(buckets, dtype=np.int64)  # peers holding each bucket
    done = np.full(k, np.nan)
    first = np.ceil(starts / round_s - 1e-9).astype(np.int64)  # first round it pulls in
    sent = 0
    r = 0
    while np.isnan(done).any():
        down = np.where((first <= r) & (held < buckets), links, 0)
        if not down.any():
            r = int(first[np.isnan(done)].min())
            continue
        up = links.copy()
        origin_up = np.ones(origins, dtype=np.int64)  # a rank: one GPU's link
        got: list[tuple[np.ndarray, int]] = []
        # rarest first; ties rotate with the round so no bucket always goes last
        for b in np.lexsort(((np.arange(buckets) - r) % buckets, copies)):
            wants = np.flatnonzero(~has[:, b] & (down > 0))
            if not wants.size:
                continue
            peers = np.flatnonzero(has[:, b] & (up > 0))
            from_peers = int(up[peers].sum())
            from_origin = int(copies[b] == 0 and origin_up[b % origins] > 0)
            n = min(wants.size, from_peers + from_origin)
            if not n:
                continue
            # the pullers furthest behind first (ties: rotate with the round)
            who = wants[np.lexsort(((wants - r) % k, held[wants]))[:n]]
            down[who] -= 1
            peer_n = min(n, from_peers)
            caps = up[peers]
            used = np.clip(peer_n - (np.cumsum(caps) - caps), 0, caps)
            up[peers] -= used
            if n > peer_n:
                origin_up[b % origins] -= 1
                sent += 1
            got.append((who, int(b)))
        if not got and (first > r).sum() == 0:
            raise RuntimeError("relay made no progress: a bucket has no holder")
        for who, b in got:
            has[who, b] = True
            held[who] += 1
            copies[b] += len(who)
        r += 1
        newly = np.isnan(done) & (held == buckets)
        done[newly] = r * round_s
    return done, sent
