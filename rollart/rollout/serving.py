"""``BatchingEngine``: the skeleton both generation engines share, written once.

``TorchEngine`` (``rollart.rollout.engine``) and ``VLLMEngine``
(``rollart.rollout.vllm_engine``) subclass it. It consumes ``GenRequest``s through
``serve(admit, deliver)`` (an ``InferenceWorker``'s engine thread) or ``generate``
(tests, evaluation) and produces ``GenResult``s; it owns what is the same in both:

* ``validate``: a request the model cannot serve is refused with a ``ValueError``;
* the continuous-batching loop (``serve``): admit at step boundaries, sample, deliver
  finished rows at once, drop rows whose caller went away, fail every live row (not the
  engine) on an error;
* the version swap at a step boundary: suspend -> update -> resume, then recompute the
  rows' KV (``weight_update="recompute"``) or go on over it (``"keep"``); the pending
  version is a ``StagedUpdates`` part (``self.updates``, ``rollart.rollout.staging``);
* the counters the worker's ``stats`` reads (``stats()``).

What differs is supplied by the subclass: a batch object (``_new_batch``: the live rows
and how a step, a recompute or an abort is done; see ``Batch``) and the weight functions
``_stage``, ``_copy_in``, ``_copy_stream``, ``_supersede`` given to ``StagedUpdates``.
No torch, vLLM or Dask here.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Callable, Iterable, Protocol

from rollart.rollout.base import serve_all
from rollart.rollout.staging import StagedUpdates, UpdateHook
from rollart.types import GenRequest, GenResult, ScoreRequest, ScoreResult

Delivered = Iterable[tuple[object, GenResult]]  # (tag, result) of rows that finished


class Batch(Protocol):
    """The live rows of one engine's continuous batch (``BatchingEngine._new_batch``)."""

    def __len__(self) -> int: ...  # live rows

    def tags(self) -> list: ...  # the live rows' tags

    def abandon(self, abandoned: Callable[[object], bool]) -> None: ...  # drop, no result

    def join(self, items: list[tuple]) -> None: ...  # admitted (request, tag[, handoff])

    def finished_empty(self) -> Delivered: ...  # joined with nothing to generate

    def sample(self) -> Delivered: ...  # one decode step's tokens; rows that finished

    def boundary(self) -> Delivered: ...  # at a step boundary: rows stopped there

    def suspend(self, recompute: bool) -> bool: ...  # before a swap: KV let go?

    def recompute(self) -> int: ...  # rebuild the rows' KV: context tokens prefilled

    def forward(self) -> None: ...  # the next step's forward over the KV the rows have

    def abort_all(self) -> None: ...  # an error: let every row go


class BatchingEngine(ABC):
    """The shared skeleton of a generation engine (module docstring).

    Constructor inputs: the limits ``validate`` checks (``vocab_size``,
    ``max_positions``), ``version``, ``max_batch``, ``weight_update`` (checked by the
    subclass with ``weight_update_problem``), ``step_callback(n)`` (called at every
    decode-step boundary), ``on_update(version, error)`` (``StagedUpdates``) and
    ``admit_every`` (decode steps between two admissions into a running batch).
    """

    def __init__(self, *, vocab_size: int, max_positions: int, version: int = 0,
                 max_batch: int = 64, weight_update: str = "recompute",
                 step_callback: Callable[[int], None] | None = None,
                 on_update: UpdateHook | None = None, admit_every: int = 1):
        self.vocab_size, self.max_positions = int(vocab_size), int(max_positions)
        self.version = int(version)
        self.max_batch = max(1, int(max_batch))
        self.weight_update = weight_update
        self.step_callback = step_callback
        self.admit_every = max(1, int(admit_every))
        self.updates = StagedUpdates(stage=self._stage, copy_in=self._copy_in,
                                     copy_stream=self._copy_stream,
                                     supersede=self._supersede, on_update=on_update)
        self.tokens_generated = 0
        self.requests = 0
        self.batches = 0
        self.decode_steps = 0  # sampling rounds, counted live (not only per call)
        self.busy_seconds = 0.0
        self.suspends = 0  # weight swaps applied in the middle of a batch
        self.recompute_tokens = 0  # context tokens re-prefilled after those swaps (keep: 0)
        self.recompute_seconds = 0.0  # time re-prefilling them
        self.scored_tokens = 0  # tokens re-scored (``score``: stale members' tokens)
        self.abandoned_tokens = 0  # tokens of rows dropped mid-generation (never returned)

    # -- requests ------------------------------------------------------------------------
    def validate(self, req: GenRequest) -> None:
        """Raise ``ValueError`` if ``req`` cannot be served by this model."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("GenRequest.prompt_ids is empty: a prompt needs at least one token")
        if req.max_new_tokens < 0:
            raise ValueError(f"GenRequest.max_new_tokens must be >= 0, got {req.max_new_tokens}")
        if n + req.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the "
                f"model's {self.max_positions} positions: shorten the prompt or the budget"
            )
        bad = [t for t in req.prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"(size {self.vocab_size})")

    def check_score(self, req: ScoreRequest) -> None:
        """Raise ``ValueError`` if ``req`` (a re-scoring) cannot be served by this model."""
        n = len(req.token_ids)
        if not req.positions:
            raise ValueError("ScoreRequest.positions is empty: name the tokens to score")
        bad = [p for p in req.positions if not 1 <= int(p) < n]
        if bad:
            raise ValueError(f"ScoreRequest.positions {bad[:5]} are outside 1..{n - 1}: a "
                             "token is scored given the tokens before it")
        if max(req.positions) > self.max_positions:
            raise ValueError(f"ScoreRequest needs {max(req.positions)} context tokens, more "
                             f"than the model's {self.max_positions} positions")
        bad = [t for t in req.token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"ScoreRequest token ids {bad[:5]} are outside the vocabulary "
                             f"(size {self.vocab_size})")

    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        """Each request's tokens' log-probs under the weights held now (one forward over
        the context, no sampling; ``rollart.env.rescore``). Not every engine can."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot re-score tokens: set Rollout.stale_members="
            "'abort' (or use Policy.engine='torch')")

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Generate for every request (order preserved), ``max_batch`` rows at a time.

        Continuous batching: a row that finishes leaves the batch at once and the next
        request takes its place at the following decode-step boundary. A pending
        ``request_update`` is applied before the first row starts, and at the next
        decode-step boundary when it arrives while rows are generating. A staged update
        that fails to copy in is skipped (generation goes on under the old weights); it
        is recorded in ``update_error`` and reported to ``on_update``.
        """
        return serve_all(self, requests)

    def serve(
        self,
        admit: Callable[[int], list[tuple]],
        deliver: Callable[[object, "GenResult | BaseException"], None],
        *,
        abandoned: Callable[[object], bool] | None = None,
    ) -> None:
        """Continuous batching: run until no row is live and ``admit`` offers nothing.

        ``admit(free)`` is polled at decode-step boundaries (before the first, then every
        boundary until rows join, then again ``admit_every`` steps later) for at most
        ``free`` new ``(request, tag)`` pairs (or ``(request, tag, handoff)``: PD, where
        the engine supports it); they join the running batch together.
        ``deliver(tag, result)`` is called the moment a row finishes, with its
        ``GenResult``, or with the exception when its request is invalid or the model
        fails (every live row gets it then; the engine stays usable).
        ``abandoned(tag)``, when given, is checked at each boundary: such rows (their
        caller went away) are dropped without a result.
        """
        self._serving()
        batch = self._new_batch()
        n = 0
        since = self.admit_every  # decode steps since rows last joined
        while True:
            if not len(batch):
                self.updates.apply(raise_errors=False)
            t0 = time.perf_counter()
            joining: list = []  # admitted, not yet live rows: told of a failure too
            try:
                if abandoned is not None:
                    batch.abandon(abandoned)
                free = self.max_batch - len(batch)
                due = not len(batch) or since >= self.admit_every
                new = admit(free) if free > 0 and due else []
                if new:
                    since = 0
                good = [item for item in new if self._admissible(item, deliver)]
                if good:
                    self.requests += len(good)
                    joining = good
                    batch.join(good)
                    joining = []
                for tag, result in batch.finished_empty():
                    deliver(tag, result)
                if not len(batch):
                    if new:
                        continue
                    self._idle()
                    return
                for tag, result in batch.sample():
                    deliver(tag, result)
                self.decode_steps += 1
                n += 1
                since += 1
                if len(batch):
                    # -- decode-step boundary: suspend -> update -> resume (-> recompute KV)
                    if self.step_callback is not None:
                        self.step_callback(n)
                    for tag, result in batch.boundary():
                        deliver(tag, result)
                    if len(batch):
                        self._swap_or_go_on(batch)
            except Exception as exc:  # noqa: BLE001 - every live row learns of it
                live = batch.tags()
                batch.abort_all()
                for tag in live:
                    deliver(tag, exc)
                for item in joining:  # the join that failed was theirs
                    if not any(item[1] is tag for tag in live):
                        deliver(item[1], exc)
                batch = self._new_batch()
            finally:
                self.busy_seconds += time.perf_counter() - t0

    def _admissible(self, item: tuple, deliver) -> bool:
        """Whether an admitted item may join; if not, its caller gets the reason."""
        try:
            self._check_item(item)
            return True
        except Exception as exc:  # noqa: BLE001 - goes back to that caller
            deliver(item[1], exc)
            return False

    def _check_item(self, item: tuple) -> None:
        """Raise if an admitted ``(request, tag[, handoff])`` cannot join."""
        self.validate(item[0])

    def _swap_or_go_on(self, batch: Batch) -> None:
        """The version swap at a step boundary with live rows: without a pending version
        the rows go on; with one, suspend -> update -> resume, then recompute the rows'
        KV (``"recompute"``, or whenever the suspension let it go) or go on over it."""
        if self.updates.pending_version is None:
            batch.forward()
            return
        recompute = self.weight_update == "recompute"
        dropped = batch.suspend(recompute)
        swapped = self.updates.apply(raise_errors=False) is not None
        self.suspends += swapped or dropped
        if (swapped and recompute) or dropped:
            t1 = time.perf_counter()
            self.recompute_tokens += batch.recompute()
            self.recompute_seconds += time.perf_counter() - t1
        else:  # no swap (it failed), or "keep": the rows go on over the KV they have
            batch.forward()

    def _serving(self) -> None:
        """Hook: ``serve`` starts on the calling thread."""

    def _idle(self) -> None:
        """Hook: ``serve`` returns, no row live."""

    @abstractmethod
    def _new_batch(self) -> Batch:
        """An empty batch of this engine's rows."""

    # -- weights (the pending version is ``self.updates``) -------------------------------
    @abstractmethod
    def _stage(self, state_dict: dict):
        """Checked tensors in the form ``_copy_in`` copies (``StagedUpdates.stage``)."""

    @abstractmethod
    def _copy_in(self, staged, version: int) -> None:
        """Replace the weights in place and set ``version``."""

    def _copy_stream(self, stream, version: int) -> None:
        """Copy a version in bucket by bucket (an engine with ``streams_weights``)."""
        raise TypeError(f"{type(self).__name__} cannot load weights bucket by bucket")

    def _supersede(self, older, newer):
        """What to stage when ``newer`` replaces ``older`` before it was applied."""
        return newer

    @property
    def streams_weights(self) -> bool:
        """Whether ``request_stream`` (bucket by bucket) is supported."""
        return False

    def load_state_dict(self, state_dict: dict, version: int) -> None:
        """Replace the weights in place now (all keys must match) and set ``version``.

        A pending ``request_update`` for ``version`` or older is dropped.
        """
        self.updates.load_now(state_dict, version)

    def request_update(self, state_dict: dict, version: int) -> None:
        """Stage new weights; thread-safe, returns at once.

        Keys and shapes are checked here (``KeyError`` / ``ValueError`` to the caller)
        and the tensors converted on the calling thread, so the swap itself is a plain
        copy. The update is applied at the next decode-step boundary of a running batch,
        or before the next one (or by ``apply_pending_update``) when idle. A newer request
        replaces one not applied yet; a request older than the pending one is ignored.
        """
        self.updates.request(state_dict, version)

    def request_stream(self, buckets, version: int) -> None:
        """Stage ``version`` arriving bucket by bucket (an iterable of ``(name, tensors)``
        with an optional ``close()``, e.g. ``WeightStore.iter_buckets``); thread-safe,
        returns at once. Applied like ``request_update``: at the next decode-step
        boundary each bucket is checked and copied in as it arrives; the version counts
        once every weight came. A newer request replaces it (and closes it)."""
        if not self.streams_weights:
            raise TypeError(f"{type(self).__name__} cannot load weights bucket by bucket "
                            "here (LoRA?): pass the whole state dict to request_update")
        self.updates.request_stream(buckets, version)

    def cancel_updates(self) -> None:
        """The engine is closing: stop waiting for an update to mend mixed weights, and
        close a staged stream (``StagedUpdates.cancel``)."""
        self.updates.cancel()

    @property
    def pending_version(self) -> int | None:
        """The version staged by ``request_update`` and not applied yet, if any."""
        return self.updates.pending_version

    def apply_pending_update(self) -> int | None:
        """Apply a staged update now (for an idle engine); return its version or ``None``.

        Raises if the copy fails (the weights keep their old version then).
        """
        return self.updates.apply(raise_errors=True)

    @property
    def on_update(self) -> UpdateHook | None:
        """``on_update(version, error)``: told of each applied (or failed) update."""
        return self.updates.on_update

    @on_update.setter
    def on_update(self, hook: UpdateHook | None) -> None:
        self.updates.on_update = hook

    @property
    def update_error(self) -> tuple[int, BaseException] | None:
        """``(version, error)`` of the last update that failed to apply."""
        return self.updates.error

    @property
    def mixed(self) -> tuple[int, BaseException] | None:
        """``(version, error)`` while a stream that failed half-way left the weights a mix
        of two versions (``StagedUpdates.mixed``)."""
        return self.updates.mixed

    @property
    def stall_seconds(self) -> float:
        """Time generation stood still for weight updates: copying them in, and
        re-prefilling the rows' KV after a swap."""
        return self.updates.seconds + self.recompute_seconds

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """The counters an ``InferenceWorker``'s ``stats`` reports for its engine."""
        return {
            "version": self.version,
            "tokens_generated": self.tokens_generated,
            "requests": self.requests,
            "batches": self.batches,
            "busy_seconds": self.busy_seconds,
            "mean_batch_size": self.requests / self.batches if self.batches else 0.0,
            "decode_steps": self.decode_steps,
            "pending_version": self.pending_version,
            "weight_update": self.weight_update,
            "suspends": self.suspends,
            "recompute_tokens": self.recompute_tokens,
            "scored_tokens": self.scored_tokens,
            "abandoned_tokens": self.abandoned_tokens,
            "stall_seconds": self.stall_seconds,
            "weights_mixed": self.mixed is not None,
        }
