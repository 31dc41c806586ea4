"""A lean forward pass for ``TorchEngine``: Llama/Qwen2-style decoders without the
per-call machinery of ``transformers``.

On a small model the ``transformers`` forward is bound by Python overhead rather than
arithmetic: building the 4-D attention mask, the cache object's bookkeeping, output
dataclasses and hooks cost more than the matrix products (a 2-layer, 128-wide model
spends ~1.5 ms per decode step on them). ``LeanForward`` runs the same computation with
plain tensor operations on the model's own parameters (no copies: a weight update copied
into the model is seen at once) and returns only the last position's logits.

It covers the decoder family the built-in tiny model and the Qwen2/Llama checkpoints
share: RMSNorm, rotary embeddings of the default kind, grouped-query attention with
optional q/k/v bias, a SiLU-gated MLP, full attention in every layer. ``unsupported``
names what rules a model out; ``TorchEngine`` then keeps the ``transformers`` forward.
The KV cache is ``LeanCache``: per layer ``keys``/``values`` of ``[batch, kv_heads,
columns, head_dim]``, the same layout ``rollart.rollout.pd`` reads from a
``transformers`` ``DynamicCache``. No Dask here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: ``config.model_type`` values whose layers have the structure computed here
FAMILIES = ("qwen2", "llama")


class _Layer:
    """One layer's keys and values: the first columns of buffers with spare room, so a
    decode step writes its column in place instead of copying the whole cache. Reading
    ``keys``/``values`` gives the used columns; assigning them replaces the buffer."""

    __slots__ = ("_k", "_v", "_nk", "_nv")

    def __init__(self):
        self._k = self._v = None
        self._nk = self._nv = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[..., : self._nk, :]

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:
        self._k, self._nk = value, value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[..., : self._nv, :]

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        self._v, self._nv = value, value.shape[-2]

    def append(self, keys: torch.Tensor, values: torch.Tensor):
        if self._k is None:  # the first columns, in buffers with room for more
            self._k, self._v = _roomy(keys), _roomy(values)
            self._nk = self._nv = 0
        used = self._nk
        if used != self._nv:
            raise RuntimeError(f"KV cache layer out of step: {used} key columns, "
                               f"{self._nv} value columns")
        new = used + keys.shape[-2]
        if new > self._k.shape[-2]:
            self._k, self._v = _grow(self._k, used, room(new)), _grow(self._v, used, room(new))
        self._k[..., used:new, :] = keys
        self._v[..., used:new, :] = values
        self._nk = self._nv = new
        return self.keys, self.values

    def hold(self, keys: torch.Tensor, values: torch.Tensor, used: int) -> None:
        """Take buffers whose first ``used`` columns are the KV, the rest room to append
        into (``room``)."""
        self._k, self._v, self._nk, self._nv = keys, values, used, used

    def keep(self, rows: torch.Tensor, first: int) -> None:
        """Only the batch rows ``rows`` and the columns from ``first`` on, the spare room
        kept: a row leaving costs one copy, not a second to grow again at the next step."""
        self._k = self._k[:, :, first:].index_select(0, rows)
        self._v = self._v[:, :, first:].index_select(0, rows)
        self._nk -= first
        self._nv -= first


def room(used: int) -> int:
    """Columns to allocate for ``used`` ones: spare room for decode steps to append into."""
    return used + max(16, used // 2)


def _roomy(t: torch.Tensor) -> torch.Tensor:
    """An empty buffer for ``t``'s columns and ``room`` to spare."""
    return t.new_empty((*t.shape[:-2], room(t.shape[-2]), t.shape[-1]))


def _grow(t: torch.Tensor, used: int, cols: int) -> torch.Tensor:
    out = t.new_empty((*t.shape[:-2], cols, t.shape[-1]))
    out[..., :used, :] = t[..., :used, :]
    return out


class LeanCache:
    """Per-layer key/value tensors, grown in place by ``update`` (the ``DynamicCache``
    subset that ``TorchEngine`` and ``rollart.rollout.pd`` use: ``layers[i].keys`` /
    ``.values`` to read or replace, ``update`` to append)."""

    def __init__(self, n_layers: int):
        self.layers = [_Layer() for _ in range(n_layers)]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int):
        """Append ``keys``/``values`` (new columns) to ``layer``; return the full ones."""
        return self.layers[layer].append(keys, values)


def unsupported(model) -> str | None:
    """Why ``LeanForward`` cannot run ``model`` (``None`` when it can)."""
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"model_type {family!r} is not one of {FAMILIES}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope_type != "default":
        return f"rotary embeddings of type {rope_type!r}"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "layers other than full attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "a biased MLP"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        return "no model.layers / model.embed_tokens"
    return None


class LeanForward:
    """``forward(input_ids, mask, positions, cache) -> last-position logits``."""

    def __init__(self, model):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"LeanForward cannot run this model: {reason}")
        config = model.config
        self.model = model
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // self.n_heads)
        self.eps = float(config.rms_norm_eps)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim
        self.inv_freq = 1.0 / (theta ** half)
        self.scale = self.head_dim ** -0.5
        self.n_layers = len(model.model.layers)

    def new_cache(self) -> LeanCache:
        return LeanCache(self.n_layers)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: LeanCache) -> torch.Tensor:
        """Forward ``input_ids`` ``[B, T]`` at ``positions`` ``[B, T]`` on top of ``cache``
        (which gains their keys/values); ``mask`` ``[B, W]`` marks the real columns of
        cache + new tokens (0 = left padding). Returns float logits ``[B, vocab]`` of the
        last position."""
        inner = self.model.model
        batch, t = input_ids.shape
        width = mask.shape[1]
        dtype = inner.embed_tokens.weight.dtype
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(dtype)[:, None]  # [B, 1, T, D]
        sin = emb.sin().to(dtype)[:, None]
        keep = mask.bool()
        if t == 1:
            attn = keep[:, None, None, :]
        else:  # causal over the new tokens; a padding query sees itself (no empty rows)
            cols = torch.arange(width)
            rows = torch.arange(width - t, width)[:, None]
            attn = (keep[:, None, :] & (cols <= rows)) | (cols == rows)
            attn = attn[:, None]
        h = inner.embed_tokens(input_ids)
        gqa = self.n_kv != self.n_heads
        for i, layer in enumerate(inner.layers):
            a = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, self.eps)
            q = F.linear(x, a.q_proj.weight, a.q_proj.bias)
            k = F.linear(x, a.k_proj.weight, a.k_proj.bias)
            v = F.linear(x, a.v_proj.weight, a.v_proj.bias)
            q = q.view(batch, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, t, self.n_kv, self.head_dim).transpose(1, 2)
            v = v.view(batch, t, self.n_kv, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v = cache.update(k, v, i)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=self.scale,
                                               enable_gqa=gqa)
            o = o.transpose(1, 2).reshape(batch, t, self.n_heads * self.head_dim)
            h = h + F.linear(o, a.o_proj.weight, a.o_proj.bias)
            m = layer.mlp
            x = _rms(h, layer.post_attention_layernorm.weight, self.eps)
            gate = F.linear(x, m.gate_proj.weight)
            up = F.linear(x, m.up_proj.weight)
            h = h + F.linear(F.silu(gate) * up, m.down_proj.weight)
        last = _rms(h[:, -1], inner.norm.weight, self.eps)
        head = self.model.get_output_embeddings()
        return F.linear(last, head.weight, getattr(head, "bias", None)).float()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
