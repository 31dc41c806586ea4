"""``BucketStream``: one weight version read bucket by bucket, a bounded number ahead.

Consumes a ``rollart.weights.store.WeightStore`` (its ``_bucket_order``, ``_read_bucket``,
``_name`` and ``_unreadable``, called from a reader thread of its own) and a version's
manifest; produces ``(bucket name, tensors)`` pairs to its consumer, holding at most about
``ahead`` parsed buckets. ``WeightStore.iter_buckets`` makes one; inference workers
(``rollart.rollout.prefetch``) load each bucket as it arrives.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator

from safetensors.torch import load as st_load

logger = logging.getLogger(__name__)


class BucketStream:
    """One version's buckets as they arrive: iterate for ``(bucket name, tensors)``.

    ``names`` (the manifest's buckets, ``[]`` for a one-blob version) and ``metadata``
    (its header) are known at once. From ``start()`` (or the first ``next``) a reader
    thread reads the buckets in the store's
    order (``_bucket_order``) and parses them; it starts a bucket only while fewer than
    ``ahead`` are read and not yet released by the consumer (a bucket is released when
    the consumer asks for the next one), so at most about ``ahead`` buckets are held.
    A bucket that cannot be read raises ``UnreadableWeightsError`` from the iteration.
    ``close`` (or leaving a ``with`` block) stops the reader and calls ``on_close`` once
    (an inference worker releases its hold there).
    """

    _END = object()

    def __init__(self, store: WeightStore, version: int, names: list[str],
                 metadata: dict[str, str], *, reader: str | None = None, ahead: int = 2,
                 whole: dict | None = None, on_close: Callable[[], None] | None = None):
        if int(ahead) < 1:
            raise ValueError(f"ahead must be at least 1 bucket, got {ahead}")
        self.store, self.version = store, int(version)
        self.names, self.metadata = list(names), dict(metadata)
        self.reader, self.on_close = reader, on_close
        self.received: list[str] = []  # bucket names handed to the consumer so far
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(int(ahead))
        self._closed = threading.Event()
        self._held = False  # the consumer holds a bucket (its slot is released at next)
        self._done = False
        if whole is not None:  # one blob: already read
            self._queue.put((store._name(version), whole))
            self._queue.put(self._END)
            self._thread = None
        else:
            self._thread = threading.Thread(target=self._read_all, daemon=True,
                                            name=f"rollart-buckets-v{version}")

    def start(self) -> BucketStream:
        """Start reading ahead now (else at the first ``next``)."""
        if self._thread is not None and self._thread.ident is None and \
                not self._closed.is_set():
            self._thread.start()
        return self

    def _read_all(self) -> None:
        for name in self.store._bucket_order(self.names, self.reader):
            while not self._slots.acquire(timeout=0.1):
                if self._closed.is_set():
                    return
            if self._closed.is_set():
                return
            try:
                blob = self.store._read_bucket(self.version, name, self.reader)
                if blob is None:
                    raise ValueError(f"bucket {name} is missing")
                tensors = st_load(blob)
                del blob
            except Exception as e:  # noqa: BLE001 - raised to the consumer
                self._queue.put(self.store._unreadable(self.version, e))
                return
            self._queue.put((name, tensors))
            del tensors
        self._queue.put(self._END)

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        return self

    def __next__(self) -> tuple[str, dict]:
        if self._held:  # the consumer is done with the previous bucket
            self._held = False
            self._slots.release()
        if self._done:
            raise StopIteration
        self.start()
        item = self._queue.get()
        if item is self._END:
            self._done = True
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            self.close()
            raise item
        self._held = True
        self.received.append(item[0])
        return item

    def close(self) -> None:
        """Stop reading (a version superseded or loaded) and call ``on_close`` once."""
        if self._closed.is_set():
            return
        self._closed.set()
        while True:  # drop what was read ahead
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None and self._thread.ident is not None and \
                self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # a bucket read in progress ends on its own
        if self.on_close is not None:
            try:
                self.on_close()
            except Exception as e:  # noqa: BLE001 - a release that failed: say so
                logger.warning("closing the bucket stream of v%d: %r", self.version, e)

    def __enter__(self) -> BucketStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
