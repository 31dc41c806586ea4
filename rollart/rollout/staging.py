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

    def load_state_dict(self, state_dict: dict, version: int) -> None:
        """Replace the weights in place now (all keys must match) and set ``version``.

        A pending ``request_update`` for ``version`` or older is dropped.
        """
        self._copy_in(self._stage(state_dict), version)
        with self._update_lock:
            if self._pending_update is not None and self._pending_update[1] <= int(version):
                self._pending_update = None

    def request_update(self, state_dict: dict, version: int) -> None:
        """Stage new weights; thread-safe, returns at once.

        Keys and shapes are checked here (``KeyError`` / ``ValueError`` to the caller)
        and the tensors converted on the calling thread, so the swap itself is a plain
        copy. The update is applied at the next decode-step boundary of a running batch,
        or before the next one (or by ``apply_pending_update``) when idle. A newer request
        replaces one not applied yet; a request older than the pending one is ignored.
        """
        staged = self._stage(state_dict)
        with self._update_lock:
            pending = self._pending_update
            if pending is None or int(version) >= pending[1]:
                if pending is not None:
                    staged = self._supersede(pending[0], staged)
                self._pending_update = (staged, int(version))

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
        """Swap in the staged weights, if any; report to ``on_update``."""
        with self._update_lock:
            pending, self._pending_update = self._pending_update, None
        if pending is None:
            return None
        staged, version = pending
        t0 = time.perf_counter()
        try:
            self._copy_in(staged, version)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported, generation goes on
            error = exc
            self.update_error = (version, exc)
        self.stall_seconds += time.perf_counter() - t0
        if self.on_update is not None:
            self.on_update(version, error)
        if error is not None:
            if raise_errors:
                raise error
            return None
        return version
