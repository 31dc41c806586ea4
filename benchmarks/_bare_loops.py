"""The bare PyTorch loops ``benchmarks/limits.py`` holds a run against: the simplest
strong loop for each of rollout and training, in this process, on a given number of
torch threads, with nothing of rollart's runtime around them.

``bare_generate``: a static batch of ``batch`` rows, each with a KV cache already
holding ``context - prefill`` tokens (as a prefix-cache hit would: built before the
clock starts), then one forward of the ``prefill`` new prompt tokens and ``new`` decode
steps: sample every row from softmax(logits / temperature) in one ``multinomial`` and
keep its log-prob (RL needs the behaviour log-probs), feed the tokens back. The forward
is the engine's own kind: ``rollart.rollout.lean.LeanForward`` on its ``LeanCache``
where the model allows it, else the ``transformers`` forward on a ``DynamicCache``.
No stopping, no continuous batching, no admission: every row lives for the whole batch.

``bare_train``: per batch, group-normalised advantages, the trainer's micro-batches (a
group's members, whose prompt is the same, together; the rest length-sorted, each part
within ``micro_batch_tokens``: ``Trainer._parts``), the trainer's forwards at full
strength (a shared prompt computed once and its KV cache repeated for the members'
responses, ``shared_prompt_logprobs``; only the loss's columns through the head,
``logits_to_keep``: ``target_logprobs``), the clipped policy-gradient loss against the
behaviour log-probs (plus the k3 KL to a frozen copy when ``kl_coef > 0``, as the run
computes), backward, gradient clipping and AdamW. No actor, no buffer, no publishing;
``shared=False`` is the textbook loop (whole sequences, every logit) that earlier
records compared against.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F


def _forward_fn(model):
    """``forward(ids, mask, positions, cache) -> last-position logits`` and a cache
    factory, of the kind ``TorchEngine`` would use for ``model``; and that kind's name."""
    from rollart.rollout.lean import LeanForward, unsupported

    if unsupported(model) is None:
        lean = LeanForward(model)
        return lean, lean.new_cache, "lean"
    from transformers import DynamicCache

    from rollart.rollout.engine import _cache_kwarg

    kwarg = _cache_kwarg(model)

    def forward(ids, mask, positions, cache):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    use_cache=True, **{kwarg: cache})
        return out.logits[:, -1, :].float()

    return forward, (lambda: DynamicCache(config=model.config)), "dynamic"


@torch.inference_mode()
def bare_generate(model_path: str, *, batch: int, context: int, prefill: int, new: int,
                  threads: int, tokens: int, temperature: float = 1.0, seed: int = 0) -> dict:
    """Tokens/s of the bare loop (module doc) over batches until ``tokens`` tokens were
    generated (one more batch first, untimed); ``context`` ≥ ``prefill`` ≥ 1."""
    from rollart.model import load_model

    torch.set_num_threads(threads)
    model = load_model(model_path)
    forward, new_cache, kind = _forward_fn(model)
    vocab = int(model.config.vocab_size)
    rng = torch.Generator().manual_seed(seed)
    past = context - prefill
    reps = max(1, -(-tokens // (batch * new)))
    times = []
    for rep in range(reps + 1):
        ids = torch.randint(vocab, (batch, context), generator=rng)
        cache = new_cache()
        if past:  # the cached prefix: not timed
            pos = torch.arange(past).expand(batch, past)
            forward(ids[:, :past], torch.ones(batch, past, dtype=torch.long), pos, cache)
        t0 = time.perf_counter()
        mask = torch.ones(batch, context, dtype=torch.long)
        pos = torch.arange(past, context).expand(batch, prefill)
        logits = forward(ids[:, past:], mask, pos, cache)
        out, logps = [], []
        for i in range(new):
            logp = torch.log_softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=rng)
            out.append(tok)
            logps.append(logp.gather(1, tok))
            if i + 1 == new:
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
            logits = forward(tok, mask, pos, cache)
        torch.cat(out, 1).tolist(), torch.cat(logps, 1).tolist()  # handed out, as a loop would
        if rep:
            times.append(time.perf_counter() - t0)
    return {"tok_s": batch * new * reps / sum(times), "kind": kind, "batches": reps,
            "seconds": sum(times)}


def bare_train(model_path: str, batches: list, algo, *, threads: int,
               temperature: float = 1.0, shared: bool = True) -> dict:
    """Seconds per batch of the bare training step (module doc) on ``batches`` (lists of
    ``rollart.types.Trajectory``), after one untimed step on the first; ``shared``: at
    the trainer's full strength (prompt sharing, ``logits_to_keep``)."""
    from rollart.model import load_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_model(model_path)
    model.train()
    ref = copy.deepcopy(model).eval() if algo.kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay,
                            betas=(0.9, 0.99))
    times = []
    for i, batch in enumerate([batches[0], *batches]):
        t0 = time.perf_counter()
        _train_step(model, ref, opt, batch, algo, temperature, full=shared)
        if i:
            times.append(time.perf_counter() - t0)
    return {"seconds": times}


def _train_step(model, ref, opt, batch, algo, temperature: float, full: bool = False
                ) -> None:
    """One bare optimizer step on ``batch``: the textbook loop (length-sorted parts, whole
    sequences, every logit) or, ``full``, the trainer's parts and forwards (module doc)."""
    from types import SimpleNamespace

    from rollart.trainer.advantages import compute_advantages
    from rollart.trainer.trainer import Trainer, micro_batches

    adv = compute_advantages([t.reward for t in batch], [t.group_id for t in batch],
                             scale=algo.scale_rewards)
    if full:
        parts = Trainer._parts(SimpleNamespace(algo=algo, share_prompts=True, model=model,
                                               ref_model=ref), batch)
    else:
        parts = [(part, None) for part in micro_batches(
            [len(t.prompt_ids) + len(t.response_ids) for t in batch], algo.micro_batch_tokens)]
    total = max(float(sum(sum(t.loss_mask) for t in batch)), 1.0)
    opt.zero_grad(set_to_none=True)
    for rows, shared in parts:
        logprobs, mask, behaviour = _forward([batch[i] for i in rows], shared, temperature)
        logp = logprobs(model)
        ratio = torch.exp(logp - behaviour)
        a = adv[rows][:, None]
        loss = -torch.min(ratio * a, ratio.clamp(1 - algo.clip_eps, 1 + algo.clip_eps) * a)
        if ref is not None:
            with torch.no_grad():
                diff = logprobs(ref) - logp
            loss = loss + algo.kl_coef * (torch.exp(diff) - diff - 1)
        ((loss * mask).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), algo.max_grad_norm)
    opt.step()


def _full_step(model, ref, opt, batch, algo, temperature: float) -> None:
    """``_train_step`` at the trainer's full strength (module doc)."""
    _train_step(model, ref, opt, batch, algo, temperature, full=True)


def _forward(rows, shared: bool | None, temperature: float):
    """``(logprobs(model), loss mask, behaviour log-probs)`` of one micro-batch: the
    textbook forward (``shared`` None), a group sharing its prompt (True:
    ``shared_prompt_logprobs``), or rows apart with only the loss's columns through the
    head (False: ``target_logprobs``)."""
    from rollart.trainer.losses import shared_prompt_logprobs, target_logprobs
    from rollart.trainer.trainer import collate, collate_shared

    if shared is None:
        ids, attn, mask, behaviour = _collate(rows)
        return (lambda m: _logprobs(m, ids, attn, temperature)), mask, behaviour
    if shared:
        prompt, resp, attn, mask, behaviour = collate_shared(rows, 0)
        need = mask > 0
        return (lambda m: shared_prompt_logprobs(m, prompt, resp, attn, need, temperature),
                mask, behaviour)
    ids, attn, mask, behaviour = collate(rows, 0)
    mask, behaviour, need = mask[:, 1:], behaviour[:, 1:], mask[:, 1:] > 0
    return (lambda m: target_logprobs(m, ids, attn, need, temperature)), mask, behaviour


def _logprobs(model, ids, attn, temperature: float) -> torch.Tensor:
    """``[B, T-1]``: log-prob of ``ids[:, t + 1]`` after ``ids[:, :t + 1]``."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    return -F.cross_entropy((logits / temperature).transpose(1, 2), ids[:, 1:],
                            reduction="none")


def _collate(rows):
    """Right-padded ``(ids, attention, loss mask, behaviour log-probs)``; the last two
    shifted to the predicted positions (``[B, T-1]``)."""
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(rows), width))
    behaviour = torch.zeros((len(rows), width))
    for i, t in enumerate(rows):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[i, :p + r] = torch.tensor(list(t.prompt_ids) + list(t.response_ids))
        attn[i, :p + r] = 1
        mask[i, p:p + r] = torch.tensor(t.loss_mask, dtype=torch.float)
        behaviour[i, p:p + r] = torch.tensor(t.logprobs, dtype=torch.float)
    return ids, attn, mask[:, 1:], behaviour[:, 1:]
