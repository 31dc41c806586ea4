"""``StagedUpdates``: an engine's pending weight version, applied at a step boundary.

Held by each generation engine (``rollart.rollout.serving.BatchingEngine``, the base of
``TorchEngine`` and ``VLLMEngine``) as ``engine.updates``. It consumes weights from any
thread (a whole state dict: ``request``; a version still arriving bucket by bucket:
``request_stream``) and produces, when the engine's decode loop calls ``apply`` at a
step boundary (or an idle engine, ``apply_pending_update``), one call of the engine's
copy function and one ``on_update(version, error)`` report. It owns the pending
version, the lock that guards it, the failure counters (``error``, ``mixed``) and the
time spent copying (``seconds``). What it does to the weights is given to its
constructor as plain callables (the engine's methods):

* ``stage(state_dict)``: check the names and shapes (``check_state_dict``) and return
  the tensors in the form the engine copies in (its device and dtype, or CPU fp32);
  called on the requesting thread, so the swap itself is a plain copy;
* ``copy_in(staged, version)``: replace the weights in place and set the version;
* ``copy_stream(stream, version)``: the same for a ``_Stream`` of buckets;
* ``supersede(older, newer)``: what to stage when ``newer`` replaces ``older`` before it
  was applied (an engine with LoRA keeps a new base that only ``older`` carried).

Rules: a newer request replaces one not applied yet; an older one is ignored; a
version loaded now (``load_now``) drops a pending one not newer.

Bucket by bucket: a stream is applied while the engine is suspended, each bucket copied
into the weights as it arrives, so the worker holds about two buckets, not a second copy
of the model. Requests see the old weights or the new version fully loaded, never a
mix, because nothing generates while the stream is copied in. If the stream fails
after a bucket was copied, the weights are a mix of two versions (``mixed``): ``apply``
waits for a later update and applies it, until the weights are one version again (the
worker stages one at once); ``cancel`` ends that wait (closing).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

#: the output head's Hugging Face name (``rollart.model.HEAD``; not imported: this
#: module stays free of ``transformers``)
HEAD = "lm_head.weight"

#: ``on_update(version, error)``: called on the thread that applied (or failed to apply)
#: a requested update; ``error`` is ``None`` on success.
UpdateHook = Callable[[int, "BaseException | None"], None]


def check_state_dict(state_dict: dict, shapes: dict[str, tuple], *, tied: bool) -> dict:
    """Drop a tied head; raise ``KeyError`` / ``ValueError`` naming the keys whose
    names or shapes do not match ``shapes``; return the dict to stage."""
    sd = {k: v for k, v in state_dict.items() if not (tied and k == HEAD)}
    expected = {k for k in shapes if not (tied and k == HEAD)}
    missing, unexpected = sorted(expected - sd.keys()), sorted(sd.keys() - shapes.keys())
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    wrong = [k for k, v in sd.items() if tuple(v.shape) != tuple(shapes[k])]
    if wrong:
        raise ValueError(f"state dict shapes do not match the model for {wrong[:5]}")
    return sd


def check_bucket(name: str, part: dict, shapes: dict[str, tuple], *, tied: bool) -> dict:
    """One bucket of a streamed version (``copy_stream``): drop a tied head; raise
    ``KeyError`` naming unexpected keys or wrong shapes; return the tensors to copy."""
    part = {k: v for k, v in part.items() if not (tied and k == HEAD)}
    unexpected = sorted(set(part) - shapes.keys())
    wrong = [k for k, v in part.items() if k in shapes and tuple(v.shape) != tuple(shapes[k])]
    if unexpected or wrong:
        raise KeyError(f"bucket {name} does not match the model: unexpected "
                       f"{unexpected[:5]}, wrong shapes {wrong[:5]}")
    return part


def check_complete(version: int, seen, shapes: dict[str, tuple], *, tied: bool) -> None:
    """A streamed version's end: ``KeyError`` if a weight of the model never came."""
    missing = sorted(k for k in shapes if k not in seen and not (tied and k == HEAD))
    if missing:
        raise KeyError(f"version {version} lacks weights the model has: {missing[:5]} "
                       f"({len(missing)} in all)")


class StagedUpdates:
    """The pending weight version of one engine (module docstring): requested from any
    thread, applied on the engine's thread by ``apply``.

    >>> weights = {}
    >>> updates = StagedUpdates(stage=dict, copy_in=lambda sd, v: weights.update(sd, v=v))
    >>> updates.request({"w": 1}, 3); updates.request({"w": 0}, 2)  # older: ignored
    >>> updates.pending_version
    3
    >>> updates.apply(raise_errors=True), weights
    (3, {'w': 1, 'v': 3})
    """

    def __init__(self, *, stage: Callable[[dict], object],
                 copy_in: Callable[[object, int], None],
                 copy_stream: Callable[["_Stream", int], None] | None = None,
                 supersede: Callable[[object, object], object] | None = None,
                 on_update: UpdateHook | None = None):
        self.stage, self.copy_in, self.copy_stream = stage, copy_in, copy_stream
        self.supersede = supersede or _newer
        self.on_update = on_update
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: tuple[object, int] | None = None  # (staged or _Stream, version)
        self._cancelled = False
        self.error: tuple[int, BaseException] | None = None  # the last failed apply
        self.seconds = 0.0  # time spent copying updates in
        # a stream that failed after copying part of a version: (version, error) until a
        # later update is applied; nothing generates meanwhile
        self.mixed: tuple[int, BaseException] | None = None

    @property
    def pending_version(self) -> int | None:
        """The version requested and not applied yet, if any."""
        pending = self._pending
        return None if pending is None else pending[1]

    def load_now(self, state_dict: dict, version: int) -> None:
        """Stage and copy in ``state_dict`` on the calling thread; a pending request for
        ``version`` or older is dropped."""
        self.copy_in(self.stage(state_dict), version)
        dropped = None
        with self._lock:
            self.mixed = None
            if self._pending is not None and self._pending[1] <= int(version):
                dropped, self._pending = self._pending[0], None
        if isinstance(dropped, _Stream):
            dropped.close()

    def request(self, state_dict: dict, version: int) -> None:
        """Stage ``state_dict`` (checked and converted here: errors go to the caller)."""
        self._put(self.stage(state_dict), int(version))

    def request_stream(self, buckets, version: int) -> None:
        """Stage ``version`` arriving bucket by bucket (an iterable of ``(name, tensors)``
        with an optional ``close()``); a replaced or cancelled stream is closed."""
        if self.copy_stream is None:
            raise TypeError("these updates cannot load weights bucket by bucket: pass the "
                            "whole state dict to request")
        self._put(_Stream(buckets), int(version))

    def _put(self, staged, version: int) -> None:
        dropped = None
        with self._lock:
            pending = self._pending
            if pending is None or version >= pending[1]:
                if pending is not None:
                    dropped = pending[0]
                    if not isinstance(staged, _Stream) and not isinstance(dropped, _Stream):
                        staged = self.supersede(dropped, staged)
                self._pending = (staged, version)
            else:
                dropped = staged
            self._cond.notify_all()
        if isinstance(dropped, _Stream):
            dropped.close()

    def cancel(self) -> None:
        """The engine is closing: stop waiting for an update to mend mixed weights, and
        close a staged stream (its reader stops, its hold is released)."""
        dropped = None
        with self._lock:
            self._cancelled = True
            if self._pending is not None and isinstance(self._pending[0], _Stream):
                dropped, self._pending = self._pending[0], None
            self._cond.notify_all()
        if dropped is not None:
            dropped.close()

    def apply(self, *, raise_errors: bool) -> int | None:
        """Copy in the pending version, if any, and report it to ``on_update``; return
        it (``None``: nothing pending, or it failed). After a stream that failed half-way
        (``mixed``), wait for the next update and apply it, until the weights are one
        version again (or ``cancel``)."""
        applied, error = self._apply_once()
        while self.mixed is not None:
            with self._lock:
                while self._pending is None and not self._cancelled:
                    self._cond.wait(0.5)
                if self._pending is None:
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
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None, None
        staged, version = pending
        t0 = time.perf_counter()
        try:
            if isinstance(staged, _Stream):
                with staged:
                    self.copy_stream(staged, version)
            else:
                self.copy_in(staged, version)
            self.mixed = None
            error = None
        except Exception as exc:  # noqa: BLE001 - reported, generation goes on
            error = exc
            self.error = (version, exc)
            if isinstance(staged, _Stream) and staged.copied:
                self.mixed = (version, exc)
        self.seconds += time.perf_counter() - t0
        if self.on_update is not None:
            self.on_update(version, error)
        return (None, error) if error is not None else (version, None)


def _newer(older, newer):
    """``supersede``'s default: the newer request replaces the older one whole."""
    return newer


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
