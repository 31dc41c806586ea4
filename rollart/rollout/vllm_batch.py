"""``_VBatch``: ``VLLMEngine``'s continuous batch, the requests it has inside vLLM.

Driven by the shared serve loop (``rollart.rollout.serving.BatchingEngine.serve``,
whose ``Batch`` protocol it follows), it consumes admitted ``(request, tag)`` pairs,
adds them to the engine's ``LLMEngine`` (``VLLMEngine._add``: sampling parameters,
``cache_salt``, adapter), steps vLLM once per decode step and produces ``(tag,
GenResult)`` for each request that finishes: a stop id (vLLM's ``stop_token_ids``), a
stop string (checked here on the decoded tail with ``hits_stop_string``, as the torch
engine does: vLLM runs without detokenizing), ``max_new_tokens``, or ``abort(req)``
(``finish_reason="abort"``, the tokens so far). Before a swap under
``weight_update="recompute"`` the requests leave vLLM (``suspend``) and come back with
their prompt + tokens so far (``recompute``), so their KV is recomputed under the new
weights; under ``"keep"`` they stay scheduled. No Dask here.
"""

from __future__ import annotations

from rollart.rollout.batch import hits_stop_string
from rollart.types import GenRequest, GenResult


class _VRow:
    """One request inside vLLM: who asked and what it has produced so far."""

    __slots__ = ("req", "tag", "tokens", "logps", "versions")

    def __init__(self, req: GenRequest, tag):
        self.req, self.tag = req, tag
        self.tokens: list[int] = []
        self.logps: list[float] = []
        self.versions: list[int] = []

    def result(self, reason: str) -> GenResult:
        return GenResult(token_ids=self.tokens, logprobs=self.logps, versions=self.versions,
                         finish_reason=reason)


class _VBatch:
    """The live requests of one ``VLLMEngine.serve`` call, by vLLM request id."""

    def __init__(self, engine):  # a VLLMEngine
        self.engine = engine
        self.rows: dict[str, _VRow] = {}
        self.empty: list[_VRow] = []  # max_new_tokens == 0: done before vLLM sees them

    def __len__(self) -> int:
        return len(self.rows)

    def tags(self) -> list:
        return [row.tag for row in self.rows.values()]

    def abandon(self, abandoned) -> None:
        """Abort inside vLLM the requests whose caller went away, without a result."""
        gone = [rid for rid, row in self.rows.items() if abandoned(row.tag)]
        if gone:
            self.engine.llm.abort_request(gone)
            for rid in gone:
                self.engine.abandoned_tokens += len(self.rows.pop(rid).tokens)
            self.engine.aborts += len(gone)

    def join(self, items: list[tuple]) -> None:
        """Add the admitted requests to vLLM's running batch."""
        added = 0
        for item in items:
            req, row = item[0], _VRow(item[0], item[1])
            if req.max_new_tokens == 0:
                self.empty.append(row)
                continue
            self.rows[self.engine._add(0, req, 0, req.prompt_ids)] = row
            added += 1
        self.engine.batches += bool(added)

    def finished_empty(self) -> list[tuple]:
        done, self.empty = self.empty, []
        return [(row.tag, row.result("length")) for row in done]

    def sample(self):
        """One ``LLMEngine.step()``: each request's new tokens; yields ``(tag, result)``
        of each request that finished (delivered as they come)."""
        eng = self.engine
        for out in eng.llm.step():
            row = self.rows.get(out.request_id)
            if row is None:
                continue
            comp = out.outputs[0]
            hit = False
            for tok, lps in zip(comp.token_ids, comp.logprobs or []):
                row.tokens.append(int(tok))
                row.logps.append(float(lps[tok].logprob))
                row.versions.append(eng.version)
                eng.tokens_generated += 1
                hit = bool(row.req.stop_strings) and hits_stop_string(
                    eng.tokenizer, row.tokens, row.req.stop_strings)
                if hit:  # vLLM detokenizes nothing here: stop strings are ours
                    break
            if hit and not out.finished:
                eng.llm.abort_request([out.request_id])
            if hit:
                del self.rows[out.request_id]
                yield row.tag, row.result("stop")
            elif out.finished:
                del self.rows[out.request_id]
                yield row.tag, row.result("stop" if comp.finish_reason == "stop" else "length")

    def boundary(self):
        """Requests stopped by ``VLLMEngine.abort(req)``: out of vLLM, delivered with
        their tokens (``finish_reason="abort"``)."""
        eng = self.engine
        with eng._abort_lock:
            if not eng._aborted:
                return
            gone = [rid for rid, row in self.rows.items() if id(row.req) in eng._aborted]
            eng._aborted.difference_update(id(self.rows[rid].req) for rid in gone)
        if gone:
            eng.llm.abort_request(gone)
            for rid in gone:
                row = self.rows.pop(rid)
                yield row.tag, row.result("abort")
            eng.aborts += len(gone)

    def suspend(self, recompute: bool) -> bool:
        """Before a swap: with ``recompute`` the requests leave vLLM (their KV with
        them) and must be re-added whether or not the swap succeeds; ``keep``: they stay."""
        if not recompute:
            return False
        self.engine.llm.abort_request(list(self.rows))
        return True

    def recompute(self) -> int:
        """Re-add every request with its prompt + tokens so far (KV recomputed by vLLM
        under the weights it has now); return the context tokens re-added."""
        resumed, tokens = {}, 0
        for row in self.rows.values():
            context = list(row.req.prompt_ids) + row.tokens
            resumed[self.engine._add(0, row.req, len(row.tokens), context)] = row
            tokens += len(context)
        self.rows = resumed
        return tokens

    def forward(self) -> None:
        """Nothing to do: the next ``LLMEngine.step()`` (``sample``) runs the forward."""

    def abort_all(self) -> None:
        """An error: every request leaves vLLM."""
        if self.rows:
            self.engine.llm.abort_request(list(self.rows))
