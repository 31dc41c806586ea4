"""``TorchEngine``: batched autoregressive generation with plain PyTorch + a KV cache.

Consumes ``GenRequest``s (token ids in, sampling settings, stop ids and stop strings,
seed) and produces ``GenResult`` lists (token ids, behaviour log-probs, policy version
per token, finish reason: ``stop`` on any stop id or once the decoded tail contains a
stop string, ``length`` at ``max_new_tokens``; the vLLM engine follows the same rules).
Weights come from a model folder (``rollart.model``) and are replaced in place, either
at once by ``load_state_dict`` or, while a batch is being generated, by
``request_update`` (any thread): the decode loop then suspends at the next decode-step
boundary, swaps the weights and resumes. What the rows still generating do then is
``weight_update`` (``Policy.weight_update``): ``"recompute"`` re-prefills their contexts
(prompt + tokens so far) to rebuild their KV cache under the new weights; ``"keep"``
goes on over the KV cache they have (the old weights'), so their later tokens come from
the new weights attending to old KV, with no re-prefill. Either way tokens keep the
behaviour log-probs and versions they were sampled under. KV made under other weights
is never reused beyond those rows, in both modes: the prefix cache keeps a finished
row's KV only when all of it was computed under the current weights and uses an entry
only under the version that made it, and a PD handoff prefilled under other weights is
recomputed here. ``score`` re-scores tokens already generated under the weights held now
(a stale member's, ``rollart.env.rescore``). Two hooks serve PD disaggregation
(``rollart.rollout.pd``): ``prefill`` returns a portable KV cache per request and
``decode`` continues from such caches; a per-trajectory prefix cache lets a later turn
prefill only its new tokens. No Dask here: the ``InferenceWorker`` actor owns one engine
and calls it from its engine thread. The serve loop, ``validate``, the version swap and
the counters are the shared skeleton's (``rollart.rollout.serving.BatchingEngine``);
this module supplies the batch (``rollart.rollout.batch._Batch``), the forward pass and
the weight copies.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

import torch
from transformers import DynamicCache

from rollart.model import load_model, load_tokenizer, ties_head
from rollart.rollout import pd
from rollart.rollout.base import serve_all, weight_update_problem
from rollart.rollout.batch import _Batch
from rollart.rollout.lean import LeanForward, unsupported
from rollart.rollout.serving import BatchingEngine
from rollart.rollout.staging import (UpdateHook, check_bucket, check_complete,
                                     check_state_dict)
from rollart.types import GenRequest, GenResult, ScoreRequest, ScoreResult
from rollart.weights import lora
from rollart.weights.lora import MergedAdapter


class TorchEngine(BatchingEngine):
    """One model + tokenizer that turns ``GenRequest``s into ``GenResult``s.

    Batching is continuous (``serve``): rows join at decode-step boundaries and leave the
    moment they finish, so a short answer never waits for a long one.
    ``step_callback(n)``, when given, is called at every decode-step boundary of a
    ``serve``/``generate`` call: after the ``n``-th sampling round (the first token of a
    row comes from its prefill) and before the forward pass of round ``n + 1``. An update
    requested there (or earlier) is applied at that boundary, so live rows keep their
    tokens from the old weights and later tokens come from the new ones. It is not
    called when no row is left after a round.
    """

    def __init__(
        self,
        model_path: str,
        *,
        version: int = 0,
        max_batch: int = 64,
        dtype: torch.dtype = torch.float32,
        step_callback: Callable[[int], None] | None = None,
        on_update: UpdateHook | None = None,
        prefix_cache: int = 512,
        admit_every: int = 4,
        lean: bool = True,
        lora: dict | None = None,
        weight_update: str = "recompute",
    ):
        problem = weight_update_problem(weight_update, "torch", bool(lora))
        if problem:
            raise ValueError(problem)
        self.model_path = str(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype=dtype)
        config = self.model.config
        # LoRA (Policy.lora): published adapters are merged into the adapted layers'
        # weights from a kept copy of their base (rollart.weights.lora.MergedAdapter)
        self.adapter = MergedAdapter(self.model, lora) if lora else None
        # admit_every: decode steps between two admissions into a running batch; arrivals
        # meanwhile are prefilled together (one forward) instead of one prefill each
        super().__init__(
            vocab_size=config.vocab_size,
            max_positions=getattr(config, "max_position_embeddings", 1 << 30),
            version=version, max_batch=max_batch, weight_update=weight_update,
            step_callback=step_callback, on_update=on_update, admit_every=admit_every)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self._cache_kwarg = _cache_kwarg(self.model)
        # score: the forward can make the logits of the last positions only
        self._keeps_logits = "logits_to_keep" in inspect.signature(
            self.model.forward).parameters
        # the lean forward (rollart.rollout.lean) where the architecture allows it: same
        # logits, a fraction of the per-step overhead, a KV cache grown in place
        self.lean = LeanForward(self.model) if lean and unsupported(self.model) is None \
            else None
        self._rng = torch.Generator()
        self._rng.seed()  # unseeded requests differ between engines
        # prefill (rollart.rollout.pd.prefill): tokens forwarded, the same with the padding
        # their chunks carried, rows that shared another row's forward (equal prompts)
        self.prefill_tokens = self.prefill_padded = self.prefill_shared = 0
        self.prefill_call_tokens = pd.PREFILL_CALL_TOKENS
        # per-trajectory KV kept for the next turn (rollart.rollout.pd); 0 = off
        self.prefix_cache = pd.PrefixCache(prefix_cache) if prefix_cache else None

    def _new_batch(self) -> _Batch:
        """An empty continuous batch (``serve``): rows join with their own prefill (reusing
        a cached prefix of their trajectory where there is one) or start from a
        ``KVHandoff`` another engine prefilled (PD: ``(request, tag, handoff)``); a
        finished row's KV goes to the prefix cache."""
        return _Batch(self)

    # -- PD disaggregation hooks (the logic lives in rollart.rollout.pd) -----------------
    @torch.inference_mode()
    def prefill(self, requests: list[GenRequest], source: str = "") -> list[pd.KVHandoff]:
        """Prefill only: one portable ``KVHandoff`` per request (prompt KV + logits).

        The prompt's KV also stays in the prefix cache, so the trajectory's next turn
        prefills only its new tokens here.
        """
        for req in requests:
            self.validate(req)
        self.updates.apply(raise_errors=False)
        out: list[pd.KVHandoff] = []
        for i in range(0, len(requests), self.max_batch):
            t0 = time.perf_counter()
            chunk = requests[i : i + self.max_batch]
            logits, mask, _, cache = pd.start_with_prefix(self, chunk, self.prefix_cache)
            rows = pd.split_rows(logits, mask, cache, self.version, source)
            if self.prefix_cache is not None:
                for req, h in zip(chunk, rows):
                    self.prefix_cache.store(req.cache_key, req.prompt_ids, h.kv(), self.version)
            out.extend(rows)
            self.busy_seconds += time.perf_counter() - t0
        return out

    def decode(self, requests: list[GenRequest], handoffs: list[pd.KVHandoff]) -> list[GenResult]:
        """Continue ``requests`` from their prefill ``handoffs`` (made by another engine).

        Exactly what ``generate`` does after its own prefill; a handoff made under other
        weights than this engine's is recomputed here, whatever ``weight_update`` says
        (that setting concerns only rows already generating when the weights change).
        """
        return serve_all(self, requests, handoffs)

    @torch.inference_mode()
    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        """Re-score generated tokens under the weights held now (``rollart.env.rescore``):
        per request one forward over its context (no KV cache kept, no sampling), the
        log-prob of each ``positions`` token under temperature-scaled logits, as
        ``sampling.pick`` takes a behaviour log-prob (temperature ≤ 0: under 1). Only
        the logits of the scored span are made (``logits_to_keep``): a long context
        does not cost a [length, vocab] tensor. Called on the engine thread between two
        decode steps; a bad request raises ``ValueError`` before any compute."""
        for req in requests:
            self.check_score(req)
        out = []
        for req in requests:
            t0 = time.perf_counter()
            first, last = min(req.positions), max(req.positions)
            ids = torch.tensor([req.token_ids[:last]], dtype=torch.long,
                               device=self.model.device)
            keep = last - first + 1  # logits at first-1 .. last-1 predict first .. last
            kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
            logits = self.model(input_ids=ids, use_cache=False, **kwargs).logits[0, -keep:]
            scale = req.temperature if req.temperature > 0 else 1.0
            logp = torch.log_softmax(logits.float() / scale, dim=-1)
            rows = torch.tensor([p - first for p in req.positions], device=logp.device)
            toks = torch.tensor([req.token_ids[p] for p in req.positions],
                                device=logp.device)
            out.append(ScoreResult(logp[rows, toks].tolist(), self.version))
            self.scored_tokens += len(req.positions)
            self.busy_seconds += time.perf_counter() - t0
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the current weights."""
        return {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}

    # -- weights -----------------------------------------------------------------------
    def _stage(self, state_dict: dict[str, torch.Tensor]):
        """Check keys and shapes (a tied head dropped); move to the model's device/dtype.
        With LoRA, ``(full weights or None, {layer: (A, B)} or None)``: a state dict may
        hold a new base, an adapter (peft's names), or both (the adapter on that base)."""
        full, adapter = lora.split(state_dict) if self.adapter is not None \
            else (state_dict, {})
        if adapter and self.adapter is None:
            raise KeyError("adapter (LoRA) tensors for an engine without Policy.lora")
        own = self.model.state_dict()
        if full:
            full = check_state_dict(full, {k: tuple(v.shape) for k, v in own.items()},
                                    tied=ties_head(self.model))
            full = {k: v.detach().to(device=own[k].device, dtype=own[k].dtype)
                    for k, v in full.items()}
        if self.adapter is None:
            return full
        return full or None, self.adapter.check(adapter) if adapter else None

    def _supersede(self, older, newer):
        if self.adapter is not None and newer[0] is None and older[0] is not None:
            return older[0], newer[1] if newer[1] is not None else older[1]
        return newer

    @property
    def streams_weights(self) -> bool:
        """Whether ``request_stream`` (bucket by bucket) is supported: without LoRA (an
        engine with an adapter takes whole versions)."""
        return self.adapter is None

    def _copy_stream(self, stream, version: int) -> None:
        """Copy each bucket into the parameters in place as it arrives (suspended: see
        ``rollart.rollout.staging``): names and shapes checked per bucket before it is
        written, every weight required by the end."""
        own = self.model.state_dict()  # views of the parameters: copy_ writes them
        shapes = {k: tuple(v.shape) for k, v in own.items()}
        tied = ties_head(self.model)
        seen: set[str] = set()
        with torch.inference_mode(False), torch.no_grad():
            for name, part in stream:
                part = check_bucket(name, part, shapes, tied=tied)
                stream.copied += 1
                for k, v in part.items():
                    own[k].copy_(v)
                seen.update(part)
                del part
        check_complete(version, seen, shapes, tied=tied)
        self.version = int(version)

    def _copy_in(self, sd, version: int) -> None:
        full, pairs = sd if self.adapter is not None else (sd, None)
        if full:
            with torch.inference_mode(False), torch.no_grad():
                self.model.load_state_dict(full, strict=False)
            if self.adapter is not None:  # a new base: the adapter goes on top of it
                self.adapter.rebase()
                self.adapter.apply()
        if pairs is not None:
            self.adapter.apply(pairs)
        self.version = int(version)

    # -- internals ---------------------------------------------------------------------
    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        if self.lean is not None:
            return self.lean(input_ids, attention_mask, position_ids, cache)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float()

    def _new_cache(self):
        if self.lean is not None:
            return self.lean.new_cache()
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    def _prefill(self, contexts: list[list[int]]):
        """Left-padded batched prefill into a fresh cache: (logits, mask, next_pos, cache)."""
        batch = len(contexts)
        width = max(len(c) for c in contexts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, ctx in enumerate(contexts):
            n = len(ctx)
            input_ids[i, width - n :] = torch.tensor(ctx, dtype=torch.long)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(input_ids, mask, positions, cache)
        return logits, mask, positions[:, -1:] + 1, cache


def _cache_kwarg(model) -> str:
    """transformers 5.x names the KV cache argument ``cache``; 4.x ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
