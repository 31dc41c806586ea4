"""The GRPO policy loss with a clipped ratio against behaviour log-probs (pure torch).

Consumes new-policy token log-probs, the behaviour log-probs recorded at generation
time, per-token advantages and the loss mask; produces a scalar loss and statistics.
Called by ``Trainer.train_step``.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """Log-prob of each target token: ``logits[b, t]`` predicts ``targets[b, t]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def grpo_loss(logp, behaviour_logp, advantages, mask, *, clip_eps: float = 0.2,
              ref_logp=None, kl_coef: float = 0.0):
    """Clipped surrogate ``-min(ρA, clip(ρ, 1±ε)A)`` averaged over generated tokens.

    ``ρ = exp(logp - behaviour_logp)``: the ratio is taken against the policy that
    actually generated each token, so stale (off-policy) tokens are corrected and
    clipped. With ``kl_coef > 0`` a k3 estimate of KL(π‖π_ref) is added.
    All inputs are ``[batch, tokens]`` except ``advantages`` (``[batch]`` or same shape).
    """
    mask = mask.to(logp.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    log_ratio = (logp - behaviour_logp).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    stats = {}
    if ref_logp is not None and kl_coef > 0:
        d = (ref_logp - logp).clamp(-20, 20)
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
        stats["trainer/kl"] = float((kl * mask).sum() / n)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        stats["trainer/clip_frac"] = float((((ratio - 1).abs() > clip_eps).float() * mask).sum() / n)
        stats["trainer/ratio_mean"] = float((ratio * mask).sum() / n)
        stats["trainer/approx_kl_behaviour"] = float(((-log_ratio) * mask).sum() / n)
    return loss, stats
