"""Relay: the pullers of a weight version serve its buckets to each other.

Without it, K inference workers pulling a version read K copies from the trainer's
Mooncake segment. With ``relay_mb=N`` in a Mooncake store URL, each puller mounts a
segment of N MiB of its own and, for every bucket it has read, puts a replica
``{bucket}.r{slot}`` there (``slot``: its reader slot, ``readers/{slot}``); the replica's
existence is its registration as a source. A puller takes each bucket:

1. from a replica, when one exists (sources tried starting at its own slot, so pullers
   spread over them);
2. else from the origin if it wins the bucket's claim ``{bucket}.c`` (Mooncake's ``put``
   never overwrites: the first claim wins), so one puller reads each bucket from the
   trainer's segment;
3. else it waits up to ``relay_wait`` s for the claimer's replica, then reads the origin.

Any failure of a replica read (a relay process that died: its read fails at once; one
that hangs: the read is abandoned after ``relay_timeout`` s; a replica of the wrong
size) moves on to the next source, then to the origin: a dead relay never blocks a pull.
Every such origin read is counted (``fallbacks``, and by reason ``relay_fallback_<why>``)
and logged. Pullers start at different buckets (striping: slot s takes bucket
``(s + j) mod B`` j-th), so the first reads spread over the buckets. Replicas are placed
in the puller's own segment (``preferred_segment``) and checked there; one that landed
elsewhere is removed, one that does not fit is skipped (``relay_skipped``): the origin
then serves that bucket to whoever needs it.

Lifetime: a version's replicas and claims are removed with it (``gc`` ->
``MooncakeWeightStore._remove_extras``); a reader's hold keeps the version, and so its
replicas, while it reads; a replica being read is leased and its removal retried at the
next ``gc``. The origin bytes are counted where they are read: ``transfer["origin_bytes"]``
(objects the trainer wrote) against ``transfer["relay_bytes"]`` (replicas).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

logger = logging.getLogger(__name__)

DEFAULT_WAIT_S = 10.0  # for a claimed bucket's replica before reading the origin
DEFAULT_TIMEOUT_S = 10.0  # for one replica read before abandoning it
POLL_S = 0.02
CLAIM_S = 1.0  # a claim that stays unreadable this long: its owner is gone


def striped(names: list[str], slot: int) -> list[str]:
    """``names`` starting at bucket ``slot mod len(names)`` (reader ``slot``'s order).

    >>> striped(["a", "b", "c"], 4)
    ['b', 'c', 'a']
    """
    if not names:
        return []
    k = int(slot) % len(names)
    return names[k:] + names[:k]


def extra_names(name: str, max_readers: int) -> list[str]:
    """The objects readers may add next to bucket ``name``: replicas and the claim.

    >>> extra_names("v00000001.b00000.safetensors", 2)[-1]
    'v00000001.b00000.safetensors.c'
    """
    return [f"{name}.r{j}" for j in range(int(max_readers))] + [f"{name}.c"]


def placed_in(segment: str | None):
    """A ``ReplicateConfig`` that places an object in the segment named ``segment``
    (``None``: Mooncake's default, any mounted segment)."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    if segment is not None:
        config.preferred_segment = segment
    return config


def pinned_here(client):
    """A ``ReplicateConfig`` that places an object in ``client``'s own segment (the
    publisher's buckets, a reader's replicas): unpinned, Mooncake may place it in any
    mounted segment, another reader's relay segment included."""
    return placed_in(client.get_hostname())


class Relay:
    """The relay half of a ``MooncakeWeightStore`` in one puller process (see the module
    docstring). ``client`` is a Mooncake client with a mounted segment of its own."""

    def __init__(self, store, client, *, max_readers: int, wait_s: float = DEFAULT_WAIT_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.store, self.client = store, client
        self.max_readers = int(max_readers)
        self.wait_s, self.timeout_s = float(wait_s), float(timeout_s)
        self.segment = client.get_hostname()
        self._me = uuid.uuid4().hex

    # -- reading ----------------------------------------------------------------------
    def read(self, version: int, name: str, slot: int) -> bytes | None:
        """Bucket ``name`` of ``version`` for the reader in ``slot``: from a replica, else
        from the origin (claimed, or after the wait); then replicated here."""
        size = self.client.get_size(self.store._key(name))
        if size < 0:
            return None  # not (or no longer) in the store: the caller says which bucket
        data = self._from_sources(name, slot, size)
        if data is None:
            claim = self._claim(name, slot)
            if claim == "mine":
                data = self._origin(name)
            elif claim == "lost":
                self._fallback("claim", name, "its claimer's segment does not answer "
                                              "(the process is gone?)")
                data = self._origin(name)
            else:
                data = self._wait_for_source(name, slot, size)
                if data is None:
                    self._fallback("wait", name, f"no replica within {self.wait_s:g} s "
                                                  "(relay_wait) of the claimed bucket")
                    data = self._origin(name)
        if data is not None:
            self._replicate(name, slot, data)
        return data

    def _origin(self, name: str) -> bytes | None:
        data = self.store._read(name)
        if data is not None:
            self.store._count("origin_bytes", len(data))
        return data

    def _sources(self, name: str, slot: int) -> list[int]:
        """Slots holding a replica of ``name``, from ``slot`` + 1 on (so readers spread)."""
        keys = [self._replica(name, j) for j in range(self.max_readers)]
        there = self.client.batch_is_exist(keys)
        found = [j for j, ok in enumerate(there) if ok == 1 and j != slot]
        return sorted(found, key=lambda j: (j - slot - 1) % self.max_readers)

    def _from_sources(self, name: str, slot: int, size: int) -> bytes | None:
        for j in self._sources(name, slot):
            data, why = self._from_replica(self._replica(name, j), size)
            if data is not None:
                self.store._count("relay_bytes", len(data))
                return data
            self._fallback(why, name, f"the replica of reader slot {j} {why}",
                           count=False)
            self.store._count("relay_failed_reads")
        return None

    def _wait_for_source(self, name: str, slot: int, size: int) -> bytes | None:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            data = self._from_sources(name, slot, size)
            if data is not None:
                return data
            time.sleep(POLL_S)
        return None

    def _from_replica(self, key: str, size: int) -> tuple[bytes | None, str]:
        """A replica's bytes, read on a thread of its own and abandoned after
        ``timeout_s`` (a relay process that stopped answering must not block the pull)."""
        box: list = []
        done = threading.Event()

        def get():
            try:
                box.append(bytes(self.client.get(key)))
            except Exception as e:  # noqa: BLE001 - reported as the reason
                box.append(e)
            done.set()

        threading.Thread(target=get, daemon=True, name="rollart-relay-read").start()
        if not done.wait(self.timeout_s):
            return None, "timeout"
        got = box[0]
        if isinstance(got, BaseException):
            return None, "error"
        if len(got) != size:  # empty: its owner is gone; else truncated
            return None, "failed"
        return got, ""

    def _claim(self, name: str, slot: int) -> str:
        """Claim the origin read of ``name``: ``"mine"``, ``"other"`` (another reader
        reads it and will relay it) or ``"lost"`` (the claim cannot be read: its owner's
        segment is gone)."""
        key, me = self.store._key(f"{name}.c"), f"{slot}/{self._me}".encode()
        deadline = time.monotonic() + CLAIM_S
        while True:
            # a claim another reader is putting is invisible for a moment (its put
            # fails ours); one whose owner is gone stays unreadable: lost after CLAIM_S
            try:
                self.client.put(key, me, self._here())  # never overwrites: first wins
                owner = bytes(self.client.get(key))
            except Exception as e:  # noqa: BLE001 - no claim: read the origin anyway
                logger.warning("relay: claiming %s failed (%r)", key, e)
                return "lost"
            if owner or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return "mine" if owner == me else "other" if owner else "lost"

    def _fallback(self, why: str, name: str, text: str, count: bool = True) -> None:
        if count:
            self.store._count("fallbacks")
        self.store._count(f"relay_fallback_{why}")
        logger.warning("relay: %s: %s%s", name, text,
                       "; reading the origin" if count else "; trying the next source")

    # -- serving ----------------------------------------------------------------------
    def _here(self):
        return pinned_here(self.client)

    def _replica(self, name: str, slot: int) -> str:
        return self.store._key(f"{name}.r{int(slot)}")  # as extra_names

    def _replicate(self, name: str, slot: int, data: bytes) -> None:
        """Put ``data`` as this reader's replica of ``name`` in its own segment."""
        key = self._replica(name, slot)
        rc = self.client.put(key, data, self._here())
        if rc != 0:
            self.store._count("relay_skipped")
            logger.warning("relay: no replica of %s here (put returned %d: the relay "
                           "segment is full? raise relay_mb in the store URL)", name, rc)
            return
        try:
            where = [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                     for r in self.client.get_replica_desc(key) if r.is_memory_replica()]
        except Exception as e:  # noqa: BLE001 - unknown placement: do not serve it
            where = [repr(e)]
        if where != [self.segment]:  # elsewhere it would not relieve the origin
            self.client.remove(key)
            self.store._count("relay_misplaced")
            logger.warning("relay: the replica of %s landed in %s, not this reader's "
                           "segment %s; removed", name, where, self.segment)
            return
        self.store._count("relay_replicas")

