"""Prefill/decode disaggregation and prefix reuse: the KV cache as a portable value.

Consumes a ``TorchEngine``'s batched KV cache (``transformers.DynamicCache``, left-padded
rows); produces ``KVHandoff`` s, one per request: the request's KV tensors packed in ONE
contiguous byte buffer (a numpy array, so Dask's pickle-5 serialisation sends it as one
zero-copy frame) plus the last-position logits. Who calls it:

* ``TorchEngine.prefill`` → ``split_rows`` (on the compute-tagged prefill worker); the
  ``InferenceWorker`` keeps each handoff in its Dask worker's memory (``scatter``) and
  the decode worker fetches it from there directly over Dask's comms (tcp, or ucxx when
  the cluster uses that protocol) — the proxy and the driver only see its key.
* ``merge_rows`` (on the bandwidth-tagged decode worker) rebuilds a batched cache that
  ``TorchEngine.decode`` continues exactly as colocated decoding would.
* ``PrefixCache``: per-trajectory KV kept on the worker that served the last turn, so a
  sticky trajectory's next turn prefills only its new tokens (``start_with_prefix``).

Importing this module registers a Dask ``sizeof`` for torch tensors (and ``KVHandoff``
answers ``__sizeof__``), so Dask's memory accounting and transfer logs see real sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from dask.sizeof import sizeof

from rollart.rollout.lean import LeanCache, room

# -- Dask sizeof for torch ---------------------------------------------------------------


@sizeof.register(torch.Tensor)
def _sizeof_tensor(t: torch.Tensor) -> int:
    return int(t.element_size() * t.nelement()) + 64


# -- portable KV -------------------------------------------------------------------------


@dataclass
class KVHandoff:
    """One request's KV cache after prefill, ready to travel to another worker.

    ``data`` holds ``[layers, 2 (k, v), heads, tokens, head_dim]`` of ``dtype`` as raw
    bytes (one contiguous buffer); ``logits`` the last position's logits (float32).
    """

    data: np.ndarray
    shape: tuple[int, ...]
    dtype: str
    logits: np.ndarray
    tokens: int
    version: int
    source: str = ""  # address of the worker that ran the prefill

    def __sizeof__(self) -> int:
        return int(self.data.nbytes + self.logits.nbytes + 256)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def kv(self) -> torch.Tensor:
        """The KV tensor (a view on the received buffer, no copy)."""
        flat = torch.from_numpy(self.data)
        return flat.view(getattr(torch, self.dtype)).view(self.shape)


def pack(kv: torch.Tensor, logits: torch.Tensor, version: int, source: str = "") -> KVHandoff:
    """Pack one row's ``[L, 2, H, T, D]`` KV and its ``[V]`` logits into a ``KVHandoff``."""
    kv = kv.detach().to("cpu").contiguous()
    data = kv.view(-1).view(torch.uint8).numpy()
    return KVHandoff(data=data, shape=tuple(kv.shape), dtype=str(kv.dtype).split(".")[-1],
                     logits=logits.detach().float().cpu().numpy().copy(),
                     tokens=int(kv.shape[3]), version=int(version), source=source)


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), ...]`` of a ``DynamicCache`` (each ``[B, H, T, D]``)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))  # older transformers


def rows_kv(cache, rows: list[int], mask: torch.Tensor) -> list[torch.Tensor]:
    """The KV of each of ``rows`` at its live columns (``mask``), each a new contiguous
    ``[L, 2, H, T, D]`` tensor of its own.

    A row's live columns form runs (left padding leaves one; a prefix-cache hit's
    padding in the middle, two), found for all the rows at once (``live_runs``); each
    run of every layer and side is copied in one ``stack``, where gathering column
    indices cost a copy per layer and side and row. Each row owns its memory, so a
    prefix-cache entry never keeps its batch-mates' KV alive."""
    sides = [t for kv in cache_layers(cache) for t in kv]  # k0, v0, k1, v1, ...
    spans = live_runs(mask.index_select(0, torch.tensor(rows, dtype=torch.long)))
    out = []
    for j, runs in zip(rows, spans):
        parts = [torch.stack([t[j, :, a:b] for t in sides]) for a, b in runs]
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        out.append(kv.view(len(sides) // 2, 2, *kv.shape[1:]))
    return out


def live_runs(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of a 0/1 ``mask``, its runs of ones as ``(start, end)`` column spans."""
    live = mask.to(torch.int8)
    edge = torch.zeros((live.shape[0], 1), dtype=torch.int8)
    step = torch.diff(live, dim=1, prepend=edge, append=edge)
    spans: list[list[tuple[int, int]]] = [[] for _ in range(live.shape[0])]
    starts, ends = (step == 1).nonzero().tolist(), (step == -1).nonzero().tolist()
    for (row, a), (_, b) in zip(starts, ends):
        spans[row].append((a, b))
    return spans


def split_rows(logits, mask, cache, version: int, source: str = "") -> list[KVHandoff]:
    """One ``KVHandoff`` per row of a left-padded prefill (padding dropped)."""
    kvs = rows_kv(cache, list(range(mask.shape[0])), mask)
    return [pack(kv, logits[i], version, source) for i, kv in enumerate(kvs)]


def build_cache(engine, kvs: list[torch.Tensor | None]):
    """A left-padded batched cache from per-row ``[L, 2, H, T, D]`` tensors.

    Returns ``(cache, mask)``; a ``None`` row is all padding. Padding slots are zeros and
    masked out, so attention over them contributes exactly nothing. A lean cache takes
    the tensor as it is, with room for the columns forwarded next (no copy to grow).
    """
    ref = next(k for k in kvs if k is not None)
    n_layers, _, heads, _, dim = ref.shape
    width = max(k.shape[3] for k in kvs if k is not None)
    batch = len(kvs)
    cache = engine._new_cache()
    lean = isinstance(cache, LeanCache)
    mask = torch.zeros((batch, width), dtype=torch.long)
    full = torch.zeros((n_layers, 2, batch, heads, room(width) if lean else width, dim),
                       dtype=ref.dtype)
    for i, kv in enumerate(kvs):
        if kv is None:
            continue
        n = kv.shape[3]
        full[:, :, i, :, width - n:width] = kv
        mask[i, width - n:] = 1
    for layer in range(n_layers):
        if lean:
            cache.layers[layer].hold(full[layer, 0], full[layer, 1], width)
        else:
            cache.update(full[layer, 0], full[layer, 1], layer)
    return cache, mask


def merge_rows(engine, handoffs: list[KVHandoff]):
    """The decode start ``(logits, mask, next_pos, cache)`` for a batch of handoffs."""
    cache, mask = build_cache(engine, [h.kv() for h in handoffs])
    logits = torch.stack([torch.from_numpy(h.logits) for h in handoffs])
    next_pos = torch.tensor([[h.tokens] for h in handoffs], dtype=torch.long)
    return logits, mask, next_pos, cache


# -- prefix reuse ------------------------------------------------------------------------


@dataclass
class _Prefix:
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [L, 2, H, len(tokens), D]
    version: int


class PrefixCache:
    """LRU of per-trajectory KV (keyed by ``GenRequest.cache_key``) on one engine.

    An entry is used when its tokens are a strict prefix of the new prompt and it was
    computed under the engine's current weights. ``hit_tokens`` / ``prompt_tokens`` is
    the reuse rate.

    Entries of older weights can never be used again, so the first store under new
    weights drops them all: the cache holds one version's live trajectories, not up to
    ``max_entries`` finished ones of every version (on a real model, tens of MB of KV
    each: a rollout worker of SmolLM2-135M-Instruct grew by ~150 MB a step before).
    """

    def __init__(self, max_entries: int = 512):
        self.max_entries = int(max_entries)
        self._entries: OrderedDict[str, _Prefix] = OrderedDict()
        self._version: int | None = None  # the weights of the newest store
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.hits = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, req, version: int) -> _Prefix | None:
        key = getattr(req, "cache_key", None)
        entry = self._entries.get(key) if key is not None else None
        n = len(entry.tokens) if entry is not None else 0
        if entry is not None and entry.version != version:  # computed by old weights
            self._entries.pop(key, None)
            return None
        if entry is None or n >= len(req.prompt_ids) or \
                tuple(req.prompt_ids[:n]) != entry.tokens:
            return None
        self._entries.move_to_end(key)
        return entry

    def peek(self, req, version: int) -> int:
        """Prompt tokens of ``req`` that ``lookup`` would find now, without touching the
        cache (no LRU move, no eviction): a request log's figure."""
        key = getattr(req, "cache_key", None)
        entry = self._entries.get(key) if key is not None else None
        if entry is None or entry.version != version:
            return 0
        n = len(entry.tokens)
        return n if n < len(req.prompt_ids) and tuple(req.prompt_ids[:n]) == entry.tokens \
            else 0

    def count(self, reqs, hits) -> None:
        for req, hit in zip(reqs, hits):
            self.lookups += 1
            self.prompt_tokens += len(req.prompt_ids)
            if hit is not None:
                self.hits += 1
                self.hit_tokens += len(hit.tokens)

    def store(self, key: str | None, tokens, kv: torch.Tensor, version: int,
              owned: bool = False) -> None:
        """Keep ``kv`` for ``tokens`` under ``key``; copied unless ``owned`` (the caller
        made it for the cache alone, as ``rows_kv`` does)."""
        if key is None or self.max_entries <= 0 or kv.shape[3] != len(tokens):
            return
        if version != self._version:  # new weights: no older entry can be used again
            self._entries = OrderedDict((k, e) for k, e in self._entries.items()
                                        if e.version == version)
            self._version = int(version)
        self._entries[key] = _Prefix(tuple(tokens), kv if owned else kv.clone(),
                                     int(version))
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    @property
    def reuse_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


#: a prefill forward's fixed cost, in tokens' worth of compute: one call costs what this
#: many more tokens in a call cost (the chat toy, 2 layers 128 wide, one CPU thread:
#: ~0.85 ms a call, 25-35 us a token). ``plan_prefill`` splits a batch where the padding
#: a long row would force onto the short ones costs more than another call.
PREFILL_CALL_TOKENS = 32


def plan_prefill(lengths: list[int], call_tokens: int = PREFILL_CALL_TOKENS) -> list[list[int]]:
    """Row indices in chunks, each to be forwarded as one left-padded call.

    Rows are sorted by length and cut where it is cheapest: the cuts minimise
    ``sum(call_tokens + rows * longest)`` over the chunks (exact, over contiguous runs
    of the sorted rows, O(n^2)). One long first-turn prompt among many short follow-up
    turns then goes alone instead of padding every row to its length.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [lengths[i] for i in order]
    n = len(sizes)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):  # the last chunk is sizes[i:j]; its width is sizes[j - 1]
        for i in range(j):
            cost = best[i] + call_tokens + (j - i) * sizes[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], n
    while j:
        chunks.append(order[cut[j]:j])
        j = cut[j]
    return chunks[::-1]


def start_with_prefix(engine, reqs, prefix: PrefixCache | None):
    """Prefill ``reqs`` reusing cached prefixes: ``(logits, mask, next_pos, cache)``.

    Rows with a cached prefix forward only their new tokens on top of it; the batch's
    mask may then have padding in the middle of a row, which positions make harmless.
    The forwards themselves are ``prefill``'s.
    """
    hits = [prefix.lookup(r, engine.version) for r in reqs] if prefix is not None else None
    if prefix is not None:
        prefix.count(reqs, hits)
    return prefill(engine, [r.prompt_ids for r in reqs], hits)


def prefill(engine, contexts: list, hits: list | None = None):
    """Left-padded batched prefill of ``contexts`` on ``engine``: ``(logits, mask,
    next_pos, cache)``, row ``i`` for ``contexts[i]``.

    ``hits[i]``, when not None, is a cached prefix of ``contexts[i]`` (``PrefixCache``):
    only the tokens after it are forwarded. Rows without one whose contexts are equal (a
    group's members on their first turn) share one row's forward. The distinct rows go
    in the chunks ``plan_prefill`` cuts, one forward each, merged back into one batch.
    The engine counts ``prefill_tokens`` (forwarded), ``prefill_padded`` (with the
    padding each chunk carried) and ``prefill_shared`` (rows that used another's).
    """
    hits = hits if hits is not None else [None] * len(contexts)
    starts = [len(h.tokens) if h is not None else 0 for h in hits]
    first: dict[tuple, int] = {}
    distinct: list[int] = []  # the rows forwarded
    source: list[int] = []  # per row: its index in distinct
    for i, (ctx, hit) in enumerate(zip(contexts, hits)):
        key = tuple(ctx) if hit is None else None
        if key is not None and key in first:
            source.append(first[key])
            continue
        if key is not None:
            first[key] = len(distinct)
        source.append(len(distinct))
        distinct.append(i)
    lengths = [len(contexts[i]) - starts[i] for i in distinct]
    chunks = plan_prefill(lengths, engine.prefill_call_tokens)
    parts = [_forward_rows(engine, [contexts[distinct[k]] for k in chunk],
                           [hits[distinct[k]] for k in chunk]) for chunk in chunks]
    engine.prefill_tokens += sum(lengths)
    engine.prefill_padded += sum(len(c) * max(lengths[k] for k in c) for c in chunks)
    engine.prefill_shared += len(contexts) - len(distinct)
    at = {k: p for p, k in enumerate(k for chunk in chunks for k in chunk)}
    return take_rows(concat_starts(parts), [at[k] for k in source])


def _forward_rows(engine, contexts, hits):
    """One forward of ``contexts``: each row's tokens after its cached prefix (``hits``)."""
    if not any(h is not None for h in hits):
        return engine._prefill(contexts)
    cache, pmask = build_cache(engine, [h.kv if h is not None else None for h in hits])
    starts = [len(h.tokens) if h is not None else 0 for h in hits]
    suffixes = [list(c[s:]) for c, s in zip(contexts, starts)]
    width = max(len(s) for s in suffixes)
    ids = torch.full((len(contexts), width), engine.pad_id, dtype=torch.long)
    smask = torch.zeros((len(contexts), width), dtype=torch.long)
    pos = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, (suf, s) in enumerate(zip(suffixes, starts)):
        n = len(suf)
        ids[i, width - n:] = torch.tensor(suf, dtype=torch.long)
        smask[i, width - n:] = 1
        pos[i, width - n:] = torch.arange(s, s + n)
    mask = torch.cat([pmask, smask], dim=1)
    logits = engine._forward(ids, mask, pos, cache)
    return logits, mask, pos[:, -1:] + 1, cache


def left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad a ``[B, T]`` mask on the left to ``width`` columns."""
    short = width - mask.shape[1]
    if short <= 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], short)), mask], dim=1)


def concat_starts(parts: list[tuple]) -> tuple:
    """One ``(logits, mask, next_pos, cache)`` of the rows of ``parts`` in order, each
    left-padded to the widest (the first part's cache object carries the result). Each
    layer's KV is written once into its new tensor; a lean cache's gets spare room, so
    the next decode step appends in place."""
    if len(parts) == 1:
        return parts[0]
    width = max(p[1].shape[1] for p in parts)
    cache = parts[0][3]
    lean = isinstance(cache, LeanCache)
    for i, layer in enumerate(cache.layers):
        cols = room(width) if lean else width
        keys = _left_stack([p[3].layers[i].keys for p in parts], width, cols)
        values = _left_stack([p[3].layers[i].values for p in parts], width, cols)
        if lean:
            layer.hold(keys, values, width)
        else:
            layer.keys, layer.values = keys, values
    return (torch.cat([p[0] for p in parts]),
            torch.cat([left_pad(p[1], width) for p in parts]),
            torch.cat([p[2] for p in parts]), cache)


def _left_stack(kvs: list[torch.Tensor], width: int, cols: int) -> torch.Tensor:
    """``[B, H, T, D]`` tensors stacked on the batch axis in one new ``cols``-column
    tensor, each right-aligned at column ``width`` (zeros to its left)."""
    ref = kvs[0]
    out = ref.new_zeros((sum(k.shape[0] for k in kvs), ref.shape[1], cols, ref.shape[3]))
    row = 0
    for k in kvs:
        out[row:row + k.shape[0], :, width - k.shape[2]:width] = k
        row += k.shape[0]
    return out


def take_rows(start: tuple, rows: list[int]) -> tuple:
    """``start``'s rows ``rows`` (in that order, a row possibly more than once)."""
    if rows == list(range(start[0].shape[0])):
        return start
    logits, mask, next_pos, cache = start
    idx = torch.tensor(rows, dtype=torch.long)
    for layer in cache.layers:
        if isinstance(cache, LeanCache):  # its spare room kept
            layer.keep(idx, 0)
        else:
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
    return logits[idx], mask[idx], next_pos[idx], cache
