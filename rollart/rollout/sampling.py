"""Batched token choice for ``TorchEngine`` (``rollart.rollout.batch``): every live row's
next token and its behaviour log-prob, in a few tensor operations for the whole batch.

Each sampled row draws ONE uniform from its own ``torch.Generator`` (a request's seed
makes its generator, so an episode's tokens depend on its seed, never on its companions
in the batch); the draws are then turned into tokens together, by inverse CDF over each
row's ``top_p`` nucleus (sort, cumulative sum, ``searchsorted``). Greedy rows take the
argmax. Rows that share a generator (requests without a seed share the engine's) draw
in one call. Per-row work is thus one draw, where a per-row ``multinomial`` (plus a sort
for top-p) used to cost several tensor calls a row: on turns of two tokens
(``benchmarks/_engine_profile.py``) that was a tenth of the engine's CPU time at top-p 1
and a fifth at top-p 0.95.
"""

from __future__ import annotations

import torch


def pick(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
         rngs: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """The next token of each row of ``logits`` and its log-prob: ``(tokens, logps)``.

    Greedy (argmax) when the row's temperature is ``<= 0``, its log-prob then under
    temperature 1; otherwise sampled from the ``top_p`` nucleus of
    softmax(logits / temperature) with the row's generator. The log-prob is always
    taken over the full, untruncated distribution (the behaviour policy's).
    """
    scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if sampled:
        u = uniforms([rngs[i] for i in sampled])
        top_p = torch.tensor([top_ps[i] for i in sampled], dtype=torch.float64)
        if len(sampled) == len(temperatures):
            tokens = inverse_cdf(logp.exp(), top_p, u)
        else:
            idx = torch.tensor(sampled)
            tokens[idx] = inverse_cdf(logp[idx].exp(), top_p, u)
    lps = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), lps.tolist()


def uniforms(rngs: list[torch.Generator]) -> torch.Tensor:
    """One draw in [0, 1) per entry (float64), each from its generator; entries sharing
    a generator take consecutive draws of one call, in order."""
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, g in enumerate(rngs):
        groups.setdefault(id(g), (g, []))[1].append(i)
    if len(groups) == 1:
        return torch.rand(len(rngs), generator=rngs[0], dtype=torch.float64)
    draws = torch.cat([torch.rand(len(idx), generator=g, dtype=torch.float64)
                       for g, idx in groups.values()])
    out = torch.empty_like(draws)
    out[torch.tensor([i for _, idx in groups.values() for i in idx])] = draws
    return out


def inverse_cdf(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` ([rows, vocab]), the token that ``u`` (uniforms in [0, 1))
    selects from the row's ``top_p`` nucleus, renormalised.

    The nucleus: the most probable tokens while the probability before them is below
    ``top_p`` (the top token always; a row with ``top_p >= 1`` keeps every token, in
    vocabulary order: no sort). A row's token depends on its own probabilities, top-p
    and draw only, never on the other rows of the batch.
    """
    cut = top_p < 1.0
    if bool(cut.all()):
        return _nucleus_pick(probs, top_p, u)
    if not bool(cut.any()):
        return _cdf_pick(probs, u)
    out = torch.empty(len(u), dtype=torch.long)
    out[cut] = _nucleus_pick(probs[cut], top_p[cut], u[cut])
    out[~cut] = _cdf_pick(probs[~cut], u[~cut])
    return out


def _nucleus_pick(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``_cdf_pick`` over each row's nucleus, most probable token first."""
    probs, order = torch.sort(probs, dim=-1, descending=True)
    before = probs.cumsum(-1) - probs
    drop = before >= top_p[:, None].to(probs.dtype)
    drop[:, 0] = False
    pos = _cdf_pick(probs.masked_fill(drop, 0.0), u)
    return order.gather(1, pos[:, None]).squeeze(1)


def _cdf_pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u`` x the row's
    mass: token ``t`` comes with probability ``p_t / mass``, as a ``multinomial`` over
    the row would choose it (a token without mass never)."""
    cdf = probs.double().cumsum(-1)
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    # a draw at the very top can round to the mass: the last token with mass then
    last = probs.shape[1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(pos, last)
