"""Staged weight updates, shared by the generation engines (``TorchEngine``, ``VLLMEngine``).

An engine mixes in ``StagedUpdates`` and provides two methods of its own:

* ``_stage(state_dict)``: check the names and shapes (``check_state_dict``) and return
  the tensors in the form the engine copies in (its device and dtype, or CPU fp32);
* ``_copy_in(staged, version)``: replace the weights in place and set ``version``.

The mixin gives the engine protocol's weight half (``rollart.rollout.base``):
``load_state_dict`` (now), ``request_update`` (any thread: staged and applied at the
engine's next decode-step boundary by ``_apply_pending``), ``pending_version`` and
``apply_pending_update``, with the counters ``stall_seconds`` and ``update_error`` and
the ``on_update(version, error)`` hook. The decode loops call ``_apply_pending``.

Bucket by bucket: ``request_stream(buckets, version)`` stages a version that is still
arriving (an iterable of ``(bucket name, tensors)``, e.g. a ``WeightStore.iter_buckets``
stream reading ahead). At the boundary the engine suspends, and ``_copy_stream`` copies
each bucket into the weights as it arrives (an engine defines ``_copy_stream(buckets,
version)``), so the worker holds about two buckets, not a second copy of the model.
The invariant is the same as for a whole state dict: requests see the old weights or
the new version fully loaded, never a mix, because nothing generates while the stream
is copied in. If the stream fails after a bucket was copied, the weights are a mix of
two versions (``mixed``): the engine does not generate again until a later update was
applied whole; ``_apply_pending`` waits for it (the worker stages one at once) and
``cancel_updates`` ends that wait (closing).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

#: ``on_update(version, error)``: called on the thread that applied (or failed to apply)
#: a requested update; ``error`` is ``None`` on success.
UpdateHook = Callable[[int, "BaseException | None"], None]


def check_state_dict(state_dict: dict, shapes: dict[str, tuple], *, tied: bool) -> dict:
    """Drop a tied head; raise ``KeyError`` / ``ValueError`` naming the keys whose
    names or shapes do not match ``shapes``; return the dict to stage."""
    head = "lm_head.weight"
    sd = {k: v for k, v in state_dict.items() if not (tied and k == head)}
    expected = {k for k in shapes if not (tied and k == head)}
    missing, unexpected = sorted(expected - sd.keys()), sorted(sd.keys() - shapes.keys())
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    wrong = [k for k, v in sd.items() if tuple(v.shape) != tuple(shapes[k])]
    if wrong:
        raise ValueError(f"state dict shapes do not match the model for {wrong[:5]}")
    return sd


class StagedUpdates:
    """The weight-update half of an engine: call ``_init_updates`` in ``__init__`` and
    define ``_stage`` and ``_copy_in`` (see the module docstring)."""

    def _init_updates(self, on_update: UpdateHook | None) -> None:
        self.on_update = on_update
        self._update_lock = threading.Lock()
        self._pending_update: tuple[dict, int] | None = None
        self.update_error: tuple[int, BaseException] | None = None  # last failed apply
        self.stall_seconds = 0.0  # time spent applying updates (+ re-prefilling)
        # a stream that failed after copying part of a version: (version, error) until a
        # later update is applied; nothing generates meanwhile
        self.mixed: tuple[int, BaseException] | None = None
        self._update_cond = threading.Condition(self._update_lock)
        self._updates_cancelled = False

    def load_state_dict(self, state_dict: dict, version: int) -> None:
        """Replace the weights in place now (all keys must match) and set ``version``.

        A pending ``request_update`` for ``version`` or older is dropped.
        """
        self._copy_in(self._stage(state_dict), version)
        dropped = None
        with self._update_lock:
            self.mixed = None
            if self._pending_update is not None and self._pending_update[1] <= int(version):
                dropped, self._pending_update = self._pending_update[0], None
        if isinstance(dropped, _Stream):
            dropped.close()

    def request_update(self, state_dict: dict, version: int) -> None:
        """Stage new weights; thread-safe, returns at once.

        Keys and shapes are checked here (``KeyError`` / ``ValueError`` to the caller)
        and the tensors converted on the calling thread, so the swap itself is a plain
        copy. The update is applied at the next decode-step boundary of a running batch,
        or before the next one (or by ``apply_pending_update``) when idle. A newer request
        replaces one not applied yet; a request older than the pending one is ignored.
        """
        self._put_pending(self._stage(state_dict), int(version))

    def request_stream(self, buckets, version: int) -> None:
        """Stage ``version`` arriving bucket by bucket (an iterable of ``(name, tensors)``
        with an optional ``close()``, e.g. ``WeightStore.iter_buckets``); thread-safe,
        returns at once. Applied like ``request_update``: at the next decode-step
        boundary each bucket is checked and copied in as it arrives; the version counts
        once every weight came. A newer request replaces it (and closes it)."""
        if not getattr(self, "streams_weights", False):
            raise TypeError(f"{type(self).__name__} cannot load weights bucket by bucket "
                            "here (LoRA?): pass the whole state dict to request_update")
        self._put_pending(_Stream(buckets), int(version))

    def _put_pending(self, staged, version: int) -> None:
        dropped = None
        with self._update_lock:
            pending = self._pending_update
            if pending is None or version >= pending[1]:
                if pending is not None:
                    dropped = pending[0]
                    if not isinstance(staged, _Stream) and not isinstance(dropped, _Stream):
                        staged = self._supersede(dropped, staged)
                self._pending_update = (staged, version)
            else:
                dropped = staged
            self._update_cond.notify_all()
        if isinstance(dropped, _Stream):
            dropped.close()

    def cancel_updates(self) -> None:
        """The engine is closing: stop waiting for an update to mend mixed weights, and
        close a staged stream (its reader stops, its hold is released)."""
        dropped = None
        with self._update_lock:
            self._updates_cancelled = True
            if self._pending_update is not None and isinstance(self._pending_update[0],
                                                               _Stream):
                dropped, self._pending_update = self._pending_update[0], None
            self._update_cond.notify_all()
        if dropped is not None:
            dropped.close()

    def _supersede(self, older, newer):
        """What to stage when ``newer`` replaces ``older`` before it was applied (an
        engine with LoRA keeps a new base that only ``older`` carried)."""
        return newer

    @property
    def pending_version(self) -> int | None:
        """The version staged by ``request_update`` and not applied yet, if any."""
        pending = self._pending_update
        return None if pending is None else pending[1]

    def apply_pending_update(self) -> int | None:
        """Apply a staged update now (for an idle engine); return its version or ``None``.

        Raises if the copy fails (the weights keep their old version then).
        """
        return self._apply_pending(raise_errors=True)

    def _apply_pending(self, *, raise_errors: bool) -> int | None:
        """Swap in the staged weights, if any; report to ``on_update``. After a stream
        that failed half-way (``mixed``), wait for the next update and apply it, until
        the weights are one version again (or ``cancel_updates``)."""
        applied, error = self._apply_once()
        while self.mixed is not None:
            with self._update_lock:
                while self._pending_update is None and not self._updates_cancelled:
                    self._update_cond.wait(0.5)
                if self._pending_update is None:
                    error = RuntimeError(
                        f"the engine's weights are a mix of two versions (loading "
                        f"v{self.mixed[0]} failed half-way: {self.mixed[1]!r}) and it was "
                        "closed before another version loaded")
                    break
            applied, error = self._apply_once()
        if error is not None and raise_errors:
            raise error
        return applied

    def _apply_once(self) -> tuple[int | None, BaseException | None]:
        """Apply the staged update, if any: ``(its version or None, its error or None)``."""
        with self._update_lock:
            pending, self._pending_update = self._pending_update, None
        if pending is None:
            return None, None
        staged, version = pending
        t0 = time.perf_counter()
        try:
            if isinstance(staged, _Stream):
                with staged:
                    self._copy_stream(staged, version)
            else:
                self._copy_in(staged, version)
            self.mixed = None
            error = None
        except Exception as exc:  # noqa: BLE001 - reported, generation goes on
            error = exc
            self.update_error = (version, exc)
            if isinstance(staged, _Stream) and staged.copied:
                self.mixed = (version, exc)
        self.stall_seconds += time.perf_counter() - t0
        if self.on_update is not None:
            self.on_update(version, error)
        return (None, error) if error is not None else (version, None)


class _Stream:
    """A staged version still arriving: its buckets, and how many the engine began to
    copy into its weights (``copied``: the engine counts a bucket before writing it)."""

    def __init__(self, buckets):
        self.buckets, self.copied = buckets, 0

    def __iter__(self):
        """Each ``(name, tensors)``; the previous bucket is let go before the next one
        is asked for (so the reader may read ahead into the freed room)."""
        it = iter(self.buckets)
        while True:
            item = next(it, None)
            if item is None:
                return
            yield item
            item = None

    def close(self) -> None:
        close = getattr(self.buckets, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
