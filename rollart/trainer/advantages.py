"""Group-relative advantages for GRPO (pure functions, no Dask, no model).

Consumes per-trajectory rewards and group ids; produces one advantage per trajectory,
which the loss spreads over that trajectory's generated tokens.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def compute_advantages(rewards, group_ids, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """``(r - mean(group)) / (std(group) + eps)`` for each trajectory.

    A group whose rewards are all equal gets zero advantage (no signal, no noise).

    >>> adv = compute_advantages([1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b"])
    >>> [round(x, 3) for x in adv.tolist()]
    [1.0, -1.0, 0.0, 0.0]
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    members: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = torch.zeros_like(r)
    for idx in members.values():
        rg = r[idx]
        centered = rg - rg.mean()
        if scale and len(idx) > 1:
            centered = centered / (rg.std(unbiased=False) + eps)
        adv[idx] = centered
    return adv.to(torch.float32)
