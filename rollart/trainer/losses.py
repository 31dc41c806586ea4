"""The GRPO policy loss with off-policy correction (pure torch).

Consumes new-policy token log-probs, the behaviour log-probs recorded at generation
time, per-token advantages and the loss mask; produces a scalar loss and statistics.
Called by ``Trainer.train_step``.

Trajectories may be up to ``alpha`` versions old, so the policy that generated a token
(behaviour, μ) differs from the one being trained (π). Three corrections:

``"ppo"`` (default)
    The clipped ratio against the behaviour policy, ``r = π / μ``::

        loss = -min(r·A, clip(r, 1±ε)·A)

    A token whose probability has already moved past ``1±ε`` of μ in its advantage's
    direction (by the updates since it was generated) gets no further push: the clip is
    a trust region around the policy that produced the data.
``"decoupled"`` (decoupled PPO as in AReaL)
    The clipping anchor is the *proximal* policy π_prox — the trainer's weights before
    this update — and the off-policy gap is an importance weight ``w = π_prox / μ``,
    truncated at ``is_cap``::

        loss = -w · min(r·A, clip(r, 1±ε)·A),   r = π / π_prox

    Staleness then scales a token's gradient instead of clipping it away.
``"tis"`` (truncated importance sampling)
    A policy gradient weighted by ``min(π/μ, is_cap)`` (no clipping).

Why ``"ppo"`` is the default: the ``Trainer`` takes one optimizer step per batch, so
π = π_prox at that step, the decoupled ratio is exactly 1 and its clip never binds:
``"decoupled"`` reduces to ``"tis"``, a policy gradient with *no* trust region, whose
weight ``π_prox/μ`` grows for the tokens whose probability already rose. On one-step-stale
data that feedback drove gridnav without KL (``benchmarks/vs_trl.py``'s setting, 80
steps, three seeds) to collapse in two seeds of three; ``"ppo"`` learned as well as
on-policy training there. On fresh data (``sync``, ``alpha = 0``) μ = π and all three
give the same gradient.

A behaviour log-prob of ``RESCORE`` (+inf, which no policy gives) marks a token
re-scored by the trainer (``GRPO.stale_groups="rescore"``: a complete group that went
too stale waiting for its take; ``rescore_stale`` marks its
tokens older than the bound): its μ is π_prox, the log-prob under the weights being
trained, as a rollout worker's re-scoring at that version would have given. (A NaN from
an engine is left as it is: it makes the loss NaN, it is never read as re-scored.)
"""

from __future__ import annotations

import functools
import inspect

import torch

from rollart.env.rescore import stale_positions
from rollart.types import DEFAULT_OFF_POLICY, OFF_POLICY

#: the behaviour log-prob of a token the trainer re-scores (module docstring)
RESCORE = float("inf")


def rescore_stale(batch, min_version: int) -> int:
    """Mark the generated tokens of ``batch`` (``Trajectory`` rows) older than
    ``min_version`` to be re-scored by the trainer (``GRPO.stale_groups="rescore"``):
    their behaviour log-probs become ``RESCORE``, which ``grpo_loss`` reads as the
    log-prob under the weights being trained. Returns how many were marked.

    >>> from rollart.types import Trajectory
    >>> t = Trajectory("t", "task", "g", 0, [1], [5, 6, 7], [1, 0, 1], [-0.1, 0.0, -0.3],
    ...                [2, -1, 4])
    >>> rescore_stale([t], min_version=3), t.logprobs
    (1, [inf, 0.0, -0.3])
    """
    n = 0
    for t in batch:
        for i in stale_positions(t, min_version):  # the rows' own loss_mask and versions
            t.logprobs[i] = RESCORE
            n += 1
    return n


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """Log-prob of each target token: ``logits[b, t]`` predicts ``targets[b, t]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def target_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, need: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """``token_logprobs`` of ``model`` on ``ids`` (``[B, T]``) where a loss needs them.

    ``need`` (``[B, T-1]``, bool) marks the positions ``t`` whose prediction of
    ``ids[:, t + 1]`` the loss uses. Returns ``[B, T-1]``: the log-probs at every column
    some row needs, 0 at the others. Only those columns go through the output head and
    the softmax (``logits_to_keep``, where the model's forward takes it: a Hugging Face
    model applies its own head, softcapping included; others give full logits, cut here),
    and no KV cache is built (``use_cache=False`` where the forward takes it).
    """
    cols = need.any(0).nonzero().squeeze(1)
    empty = cols.numel() == 0
    if empty:  # nothing needed: one column, zeroed, keeps the graph (a zero loss)
        cols = cols.new_zeros(1)
    kwargs = {}
    takes_cache, takes_keep, _ = _forward_takes(type(model))
    if takes_cache:
        kwargs["use_cache"] = False
    if takes_keep and cols.numel() < need.shape[1]:
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=cols,
                       **kwargs).logits
    else:
        logits = model(input_ids=ids, attention_mask=attn, **kwargs).logits[:, :-1][:, cols]
    logp = token_logprobs(logits, ids[:, 1:][:, cols], temperature)
    if empty:
        logp = logp * 0.0
    return logp.new_zeros(need.shape).index_copy(1, cols, logp)


def shared_prompt_logprobs(model, prompt: torch.Tensor, resp: torch.Tensor,
                           resp_attn: torch.Tensor, need: torch.Tensor,
                           temperature: float = 1.0) -> torch.Tensor:
    """``token_logprobs`` of ``model`` on responses that follow one shared prompt.

    ``prompt`` is ``[1, P]``; ``resp``/``resp_attn``/``need`` are ``[n, R]``
    (right-padded; ``need`` marks the response tokens the loss uses). The prompt goes
    through the model once and its KV cache, repeated ``n`` times, carries the
    responses (gradients flow back through it into the prompt's forward): what the
    full forward of each ``prompt + response`` computes, for a group's members, with
    the prompt computed once instead of ``n`` times. Returns ``[n, R]``, 0 where no
    row needs a column. The model's forward must take ``position_ids`` and a cache
    (``shares_prompts``).
    """
    n, width = resp.shape
    plen = prompt.shape[1]
    takes_cache, takes_keep, cache_arg = _forward_takes(type(model))
    keep = {"logits_to_keep": 1} if takes_keep else {}
    out = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True,
                **keep)
    first = out.logits[:, -1].expand(n, -1)  # predicts each response's first token
    values = [token_logprobs(first, resp[:, 0], temperature)[:, None]]
    where = [torch.zeros(1, dtype=torch.long, device=resp.device)]
    cols = need[:, 1:].any(0).nonzero().squeeze(1)  # response position j predicts j + 1
    if cols.numel():
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        cache.batch_repeat_interleave(n)
        attn = torch.cat([torch.ones((n, plen), dtype=resp_attn.dtype,
                                     device=resp.device), resp_attn], dim=1)
        pos = torch.arange(plen, plen + width, device=resp.device)[None].expand(n, width)
        kwargs = {cache_arg: cache, "use_cache": True}
        if takes_keep and cols.numel() < width:
            logits = model(input_ids=resp, attention_mask=attn, position_ids=pos,
                           logits_to_keep=cols, **kwargs).logits
        else:
            logits = model(input_ids=resp, attention_mask=attn, position_ids=pos,
                           **kwargs).logits[:, cols]
        values.append(token_logprobs(logits, resp[:, 1:][:, cols], temperature))
        where.append(cols + 1)
    logp = torch.cat(values, dim=1)
    return logp.new_zeros((n, width)).index_copy(1, torch.cat(where), logp)


def shares_prompts(model) -> bool:
    """Whether ``shared_prompt_logprobs`` can run ``model``: its forward takes
    ``position_ids`` and a KV cache it returns (a Hugging Face causal LM)."""
    takes_cache, _, cache_arg = _forward_takes(type(model))
    return takes_cache and cache_arg is not None and _takes_positions(type(model))


@functools.lru_cache(maxsize=None)
def _takes_positions(cls) -> bool:
    return "position_ids" in inspect.signature(cls.forward).parameters


@functools.lru_cache(maxsize=None)
def _forward_takes(cls) -> tuple[bool, bool, str | None]:
    """Whether ``cls.forward`` takes ``use_cache`` and ``logits_to_keep``, and the name
    of its KV-cache argument (``cache`` in transformers 5, ``past_key_values`` in 4)."""
    params = inspect.signature(cls.forward).parameters
    arg = next((a for a in ("cache", "past_key_values") if a in params), None)
    return "use_cache" in params, "logits_to_keep" in params, arg


def grpo_loss(logp, behaviour_logp, advantages, mask, *, clip_eps: float = 0.2,
              ref_logp=None, kl_coef: float = 0.0, off_policy: str = DEFAULT_OFF_POLICY,
              is_cap: float = 2.0, prox_logp=None):
    """Token-mean policy loss; see the module docstring for the three corrections.

    All inputs are ``[batch, tokens]`` except ``advantages`` (``[batch]`` or same shape).
    ``prox_logp`` defaults to ``logp`` detached (one update per batch: the proximal
    policy is the current one). With ``kl_coef > 0`` a k3 estimate of KL(π‖π_ref) is
    added.
    """
    if off_policy not in OFF_POLICY:
        raise ValueError(f"off_policy must be one of {OFF_POLICY}, got {off_policy!r}")
    mask = mask.to(logp.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    prox = logp.detach() if prox_logp is None else prox_logp
    rescored = torch.isposinf(behaviour_logp)  # RESCORE: μ = π_prox (module docstring)
    behaviour_logp = torch.where(rescored, prox, behaviour_logp)
    behaviour_gap = (prox - behaviour_logp).clamp(-20, 20)  # log(π_prox / μ)
    if off_policy == "ppo":
        weight, log_ratio = torch.ones_like(logp), (logp - behaviour_logp).clamp(-20, 20)
    else:
        weight = torch.exp(behaviour_gap).clamp(max=is_cap)
        log_ratio = (logp - prox).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    if off_policy == "tis":
        per_token = -weight * logp * advantages
    else:
        clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
        per_token = -weight * torch.minimum(ratio * advantages, clipped)
    n = mask.sum().clamp(min=1)
    stats = {}
    if ref_logp is not None and kl_coef > 0:
        d = (ref_logp - logp).clamp(-20, 20)
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
        stats["trainer/kl"] = float((kl.detach() * mask).sum() / n)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        behaviour_ratio = torch.exp(behaviour_gap)
        stats["trainer/clip_frac"] = float(
            (((ratio - 1).abs() > clip_eps).float() * mask).sum() / n)
        stats["trainer/behaviour_ratio_mean"] = float((behaviour_ratio * mask).sum() / n)
        stats["trainer/is_truncated_frac"] = float(
            ((behaviour_ratio > is_cap).float() * mask).sum() / n)
        stats["trainer/approx_kl_behaviour"] = float((behaviour_gap * mask).sum() / n)
    return loss, stats
