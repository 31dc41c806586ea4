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
"""

from __future__ import annotations

import torch

from rollart.types import DEFAULT_OFF_POLICY, OFF_POLICY


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """Log-prob of each target token: ``logits[b, t]`` predicts ``targets[b, t]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


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
