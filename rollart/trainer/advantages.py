"""Group-relative advantages for GRPO (pure functions, no Dask, no model).

Consumes per-trajectory rewards and group ids; produces one advantage per trajectory,
which the loss spreads over that trajectory's generated tokens.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from rollart.types import SCALE_REWARDS


def compute_advantages(rewards, group_ids, eps: float = 1e-6,
                       scale: str | bool = "group") -> torch.Tensor:
    """``r - mean(group)``, scaled: ``"group"`` (``True``) divides by the group's std
    (GRPO), ``"batch"`` by the std of every reward in the batch, ``"none"`` (``False``)
    not at all (Dr. GRPO). With ``"group"`` every group that has any spread gets
    advantages of unit size, so a group whose rewards differ only by a small penalty
    (0 and -0.1) weighs as much as one where a member succeeded (0 and 1); the other two
    keep rewards' own scale between groups.

    A group whose rewards are all equal gets zero advantage (no signal, no noise).

    >>> adv = compute_advantages([1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b"])
    >>> [round(x, 3) for x in adv.tolist()]
    [1.0, -1.0, 0.0, 0.0]
    >>> adv = compute_advantages([1.0, 0.0, 0.0, -0.1], ["a", "a", "b", "b"], scale="none")
    >>> [round(x, 3) for x in adv.tolist()]
    [0.5, -0.5, 0.05, -0.05]
    """
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {SCALE_REWARDS}, got {scale!r}")
    r = torch.as_tensor(rewards, dtype=torch.float64)
    members: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = torch.zeros_like(r)
    for idx in members.values():
        rg = r[idx]
        centered = rg - rg.mean()
        if scale == "group" and len(idx) > 1:
            centered = centered / (rg.std(unbiased=False) + eps)
        adv[idx] = centered
    if scale == "batch" and len(r) > 1:
        adv = adv / (r.std(unbiased=False) + eps)
    return adv.to(torch.float32)
