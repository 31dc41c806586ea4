"""Format-only supervised warm-up for the built-in tiny model.

A randomly initialised tiny model cannot emit valid actions, so RL would have no signal.
The warm-up plays each task with its ``warmup_action`` — a *uniformly random valid*
action — and trains the model to imitate those actions. It learns the format (which words
are actions), not good play: its success rate is the random policy's, the baseline that
RL must beat. Consumes ``Task`` s and a tokenizer; produces padded token batches.
"""

from __future__ import annotations

import random

import torch

from rollart.env.faults import without_faults
from rollart.env.trajectory import TokenLog
from rollart.model import encode


def play_random(task, tokenizer, seed: int, rng: random.Random) -> TokenLog:
    """One episode of ``task`` under its random valid-action policy, as token ids."""
    if task.warmup_action is None:
        raise ValueError(f"task {task.name!r} has no warmup_action; give the graph a model "
                         "folder (Policy.model) or set Policy.warmup_steps=0")
    env = without_faults(task).env_factory()
    log = TokenLog()
    try:
        obs = env.reset(seed)
        log.add_observation(encode(tokenizer, obs))
        for _ in range(task.max_turns):
            action = task.warmup_action(rng, obs)
            log.add_generation(encode(tokenizer, action) + [tokenizer.eos_token_id])
            step = env.step(action)
            if step.done:
                break
            obs = step.observation
            log.add_observation(encode(tokenizer, obs))
    finally:
        env.close()
    return log


def warmup_batch(tasks, tokenizer, batch_size: int, rng: random.Random):
    """``(input_ids, attention_mask, loss_mask)`` for ``batch_size`` random episodes."""
    logs = []
    for _ in range(batch_size):
        task = rng.choice(tasks)
        logs.append(play_random(task, tokenizer, rng.randrange(1_000_000, 2_000_000), rng))
    return pad_logs(logs, tokenizer.pad_token_id)


def pad_logs(logs, pad_id: int):
    """Right-pad token logs; ``loss_mask[b, t]`` marks tokens the policy generated."""
    length = max(len(l.ids) for l in logs)
    ids = torch.full((len(logs), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(logs), length), dtype=torch.long)
    mask = torch.zeros((len(logs), length), dtype=torch.float32)
    for i, l in enumerate(logs):
        n, p = len(l.ids), len(l.prompt_ids)
        ids[i, :n] = torch.tensor(l.ids)
        attn[i, :n] = 1
        mask[i, p:n] = torch.tensor(l.loss_mask, dtype=torch.float32)
    return ids, attn, mask


def run_warmup(model, tokenizer, tasks, *, steps: int, batch_size: int, lr: float,
               seed: int = 0, obs_weight: float = 1.0) -> list[float]:
    """Supervised steps on random valid actions; returns the loss curve."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        ids, attn, mask = warmup_batch(tasks, tokenizer, batch_size, rng)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1),
            reduction="none").view(ids.size(0), -1)
        # Actions carry full weight; every other token (the env's text) is language-
        # modelled too, so the model learns to read observations instead of learning
        # that its output may ignore them (the random actions are context-free).
        target_mask = mask[:, 1:] + obs_weight * (attn[:, 1:] - mask[:, 1:]).clamp(min=0)
        loss = (nll * target_mask).sum() / target_mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses
