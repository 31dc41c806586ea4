"""Continuous batching for ``TorchEngine``: the live rows, their left-padded KV cache,
and each step's token choice (``rollart.rollout.sampling``: batched, each row with its
own generator).

``_Batch`` is ``TorchEngine``'s batch, driven by the shared serve loop
(``rollart.rollout.serving.BatchingEngine.serve``, whose ``Batch`` protocol it follows):
rows join with their own prefill (or a PD handoff) and leave the moment they finish (a
stop id, a stop string: ``hits_stop_string``, or ``max_new_tokens``); their KV goes to
the prefix cache.
"""

from __future__ import annotations

import torch

from rollart.rollout import pd, sampling
from rollart.rollout.lean import LeanCache
from rollart.types import GenRequest, GenResult


class _Row:
    """One request being generated: its sampling state and what it has produced."""

    __slots__ = ("req", "tag", "rng", "tokens", "logps", "versions", "reason", "handoff",
                 "kv_version")

    def __init__(self, req: GenRequest, tag, rng: torch.Generator, handoff=None,
                 kv_version: int = 0):
        self.req, self.tag, self.rng, self.handoff = req, tag, rng, handoff
        # the weights its oldest KV was computed under: older than the engine's once the
        # row went on over its KV through a weight swap (weight_update="keep")
        self.kv_version = kv_version
        self.tokens: list[int] = []
        self.logps: list[float] = []
        self.versions: list[int] = []
        self.reason: str | None = "length" if req.max_new_tokens == 0 else None

    def result(self) -> GenResult:
        return GenResult(token_ids=self.tokens, logprobs=self.logps, versions=self.versions,
                         finish_reason=self.reason or "length")


class _Batch:
    """The live rows of a continuous batch and their left-padded KV cache.

    Invariant between calls: ``logits[j]`` are the next-token logits of ``rows[j]`` (after
    ``admit``/``step``/``recompute``), ``mask``/``next_pos``/``cache`` hold one row each.
    Rows join with their own prefill (caches are left-padded to a common width) and
    leave by index selection; columns no live row attends to are trimmed.
    """

    def __init__(self, engine):  # a TorchEngine
        self.engine = engine
        self.rows: list[_Row] = []
        self.empty: list[_Row] = []  # max_new_tokens == 0: done before any compute
        self.logits = self.mask = self.next_pos = self.cache = None

    def __len__(self) -> int:
        return len(self.rows)

    def tags(self) -> list:
        return [row.tag for row in self.rows]

    def abandon(self, abandoned) -> None:
        """Drop the rows whose caller went away (``abandoned(tag)``), without a result;
        their tokens are counted as never returned (``abandoned_tokens``)."""
        gone = [j for j, row in enumerate(self.rows) if abandoned(row.tag)]
        self.engine.abandoned_tokens += sum(len(self.rows[j].tokens) for j in gone)
        self.drop(gone)

    @torch.inference_mode()
    def join(self, items: list[tuple]) -> None:
        """New rows join: their own prefill (or a PD handoff), then one merged cache."""
        eng = self.engine
        new = [_Row(it[0], it[1], _request_rng(it[0], eng._rng),
                    it[2] if len(it) > 2 else None, eng.version) for it in items]
        self.empty.extend(r for r in new if r.reason is not None)
        new = [r for r in new if r.reason is None]
        local = [r for r in new if r.handoff is None]
        remote = [r for r in new if r.handoff is not None]
        if local:  # prefill here, reusing cached prefixes (rollart.rollout.pd)
            self._join(local, pd.start_with_prefix(eng, [r.req for r in local], eng.prefix_cache))
        if remote:  # decode from KV prefilled on another worker
            if all(r.handoff.version == eng.version for r in remote):
                start = pd.merge_rows(eng, [r.handoff for r in remote])
            else:  # made under other weights: recompute here
                start = pd.prefill(eng, [r.req.prompt_ids for r in remote])
                eng.recompute_tokens += sum(len(r.req.prompt_ids) for r in remote)
            for r in remote:
                r.handoff = True  # only "came from a handoff" is needed from now on
            self._join(remote, start)

    def _join(self, new: list[_Row], start) -> None:
        self.engine.batches += 1
        parts = [(self.logits, self.mask, self.next_pos, self.cache)] if self.rows else []
        self.logits, self.mask, self.next_pos, self.cache = pd.concat_starts(parts + [start])
        self.rows = self.rows + new

    def finished_empty(self) -> list[tuple]:
        """``(tag, result)`` of the rows that joined with nothing to generate."""
        done, self.empty = self.empty, []
        return [(row.tag, row.result()) for row in done]

    def sample(self) -> list[tuple]:
        """One decode step's token choice; ``(tag, result)`` of the rows it finished."""
        self.pick()
        return [(row.tag, row.result()) for row in self.retire()]

    def boundary(self) -> list[tuple]:
        """Nothing stops here at a step boundary (callers abort through ``abandon``)."""
        return []

    def suspend(self, recompute: bool) -> bool:
        """A weight swap keeps the rows and their KV (recomputed after, if at all)."""
        return False

    def abort_all(self) -> None:
        """An error: the rows are let go with the batch (nothing is held elsewhere)."""

    def pick(self) -> None:
        """Choose the next token of every row (and note which rows are now done)."""
        eng = self.engine
        reqs = [r.req for r in self.rows]
        tokens, logps = sampling.pick(self.logits, [r.temperature for r in reqs],
                                      [r.top_p for r in reqs], [r.rng for r in self.rows])
        for row, tok, lp in zip(self.rows, tokens, logps):
            row.tokens.append(tok)
            row.logps.append(lp)
            row.versions.append(eng.version)
            if tok in row.req.stop_ids or (row.req.stop_strings and hits_stop_string(
                    eng.tokenizer, row.tokens, row.req.stop_strings)):
                row.reason = "stop"
            elif len(row.tokens) >= row.req.max_new_tokens:
                row.reason = "length"
        eng.tokens_generated += len(tokens)

    def retire(self) -> list[_Row]:
        """Remove the rows that are done (their KV kept for the trajectory's next turn in
        the prefix cache: prompt + every token but the last, when all of it was computed
        under the current weights; a row that went on over older KV through a swap
        leaves nothing there, so the next turn prefills under the current weights);
        return them."""
        gone = [j for j, r in enumerate(self.rows) if r.reason is not None]
        if not gone:
            return []
        prefix = self.engine.prefix_cache
        if prefix is not None:
            self._keep_prefixes(prefix, gone)
        done = [self.rows[j] for j in gone]
        self.drop(gone)
        return done

    def _keep_prefixes(self, prefix, gone: list[int]) -> None:
        """Store the KV of the rows ``gone`` that may be reused (gathered together)."""
        keep = []
        for j in gone:
            row = self.rows[j]
            if row.handoff is not None or row.req.cache_key is None:
                continue
            if row.kv_version != self.engine.version:
                prefix.drop(row.req.cache_key)
                continue
            keep.append(j)
        if not keep:
            return
        for j, kv in zip(keep, pd.rows_kv(self.cache, keep, self.mask)):
            row = self.rows[j]
            prefix.store(row.req.cache_key, list(row.req.prompt_ids) + row.tokens[:-1],
                         kv, self.engine.version, owned=True)

    def drop(self, indices: list[int]) -> None:
        if not indices:
            return
        gone = set(indices)
        keep = [j for j in range(len(self.rows)) if j not in gone]
        self.rows = [self.rows[j] for j in keep]
        if not self.rows:
            self.logits = self.mask = self.next_pos = self.cache = None
            return
        idx = torch.tensor(keep, dtype=torch.long)
        self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
        self.logits = self.logits[idx]
        live = torch.nonzero(self.mask.sum(0) > 0)
        first = int(live[0]) if len(live) else 0
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            if isinstance(self.cache, LeanCache):  # its spare room kept
                layer.keep(idx, first)
            else:
                layer.keys = layer.keys[idx, :, first:]
                layer.values = layer.values[idx, :, first:]

    @torch.inference_mode()
    def forward(self) -> None:
        """One decode forward pass: each row's last token in, next-token logits out."""
        last = torch.tensor([r.tokens[-1] for r in self.rows], dtype=torch.long)[:, None]
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long)],
                              dim=1)
        self.logits = self.engine._forward(last, self.mask, self.next_pos, self.cache)
        self.next_pos = self.next_pos + 1

    @torch.inference_mode()
    def recompute(self) -> int:
        """Rebuild the KV cache of every row (prompt + tokens so far) under the current
        weights; return the number of context tokens re-prefilled."""
        contexts = [list(r.req.prompt_ids) + r.tokens for r in self.rows]
        self.logits, self.mask, self.next_pos, self.cache = pd.prefill(self.engine, contexts)
        for r in self.rows:
            r.kv_version = self.engine.version
        return sum(len(c) for c in contexts)


def hits_stop_string(tokenizer, tokens: list[int], stops) -> bool:
    """Whether the decoded tail of ``tokens`` contains one of the ``stops`` strings.

    Called after each new token, so only a tail that can hold the longest stop string
    is decoded (a token is at least one byte; a character at most four): the check is
    incremental, its cost independent of how much was generated. A stop string that was
    complete before the newest token would have stopped the row then. Shared by the
    torch and vLLM engines (``rollart.rollout.vllm_engine``), so both stop alike.
    """
    window = 4 * max(len(s) for s in stops) + 4
    tail = tokenizer.decode(tokens[-window:], skip_special_tokens=False)
    return any(s in tail for s in stops)


def _request_rng(req: GenRequest, default: torch.Generator) -> torch.Generator:
    if req.seed is None:
        return default
    rng = torch.Generator()
    rng.manual_seed(int(req.seed))
    return rng
