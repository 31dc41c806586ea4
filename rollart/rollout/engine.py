"""``TorchEngine``: batched autoregressive generation with plain PyTorch + a KV cache.

Consumes ``GenRequest`` lists (token ids in, sampling settings, stop ids, seed) and
produces ``GenResult`` lists (token ids, behaviour log-probs, policy version per token).
Weights come from a model folder (``rollart.model``) and are replaced in place by
``load_state_dict`` when the trainer publishes a new version. No Dask here: the
``InferenceWorker`` actor owns one engine and calls it from its engine thread.
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers import DynamicCache

from rollart.model import load_model, load_tokenizer
from rollart.types import GenRequest, GenResult


class TorchEngine:
    """One model + tokenizer that turns batches of ``GenRequest`` into ``GenResult``."""

    def __init__(
        self,
        model_path: str,
        *,
        version: int = 0,
        max_batch: int = 64,
        dtype: torch.dtype = torch.float32,
    ):
        self.model_path = str(model_path)
        self.version = int(version)
        self.max_batch = max(1, int(max_batch))
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype=dtype)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self._cache_kwarg = _cache_kwarg(self.model)
        self._rng = torch.Generator()
        self._rng.seed()  # unseeded requests differ between engines
        self.tokens_generated = 0
        self.requests = 0
        self.batches = 0
        self.busy_seconds = 0.0

    # -- public API --------------------------------------------------------------------
    def validate(self, req: GenRequest) -> None:
        """Raise ``ValueError`` if ``req`` cannot be served by this model."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("GenRequest.prompt_ids is empty: a prompt needs at least one token")
        if req.max_new_tokens < 0:
            raise ValueError(f"GenRequest.max_new_tokens must be >= 0, got {req.max_new_tokens}")
        if n + req.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the "
                f"model's {self.max_positions} positions: shorten the prompt or the budget"
            )
        bad = [t for t in req.prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"(size {self.vocab_size})")

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Generate for every request, in chunks of ``max_batch`` (order preserved)."""
        for req in requests:
            self.validate(req)
        results: list[GenResult] = []
        for i in range(0, len(requests), self.max_batch):
            t0 = time.perf_counter()
            chunk = requests[i : i + self.max_batch]
            out = self._generate_chunk(chunk)
            self.busy_seconds += time.perf_counter() - t0
            self.batches += 1
            self.requests += len(chunk)
            self.tokens_generated += sum(len(r.token_ids) for r in out)
            results.extend(out)
        return results

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place (all keys must match) and set ``version``."""
        own = self.model.state_dict()
        tied = _tied(self.model)
        sd = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
        expected = {k for k in own if not (tied and k == "lm_head.weight")}
        missing, unexpected = sorted(expected - sd.keys()), sorted(sd.keys() - own.keys())
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
        wrong = [k for k, v in sd.items() if tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            raise ValueError(f"state dict shapes do not match the model for {wrong[:5]}")
        with torch.no_grad():
            self.model.load_state_dict(sd, strict=False)
        self.version = int(version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the current weights."""
        return {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}

    # -- internals ---------------------------------------------------------------------
    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float()

    def _new_cache(self):
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    @torch.inference_mode()
    def _generate_chunk(self, reqs: list[GenRequest]) -> list[GenResult]:
        batch = len(reqs)
        width = max(len(r.prompt_ids) for r in reqs)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding
            n = len(r.prompt_ids)
            input_ids[i, width - n :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(input_ids, mask, positions, cache)
        next_pos = positions[:, -1:] + 1

        rngs = [_request_rng(r, self._rng) for r in reqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        logps: list[list[float]] = [[] for _ in reqs]
        reasons: list[str | None] = ["length" if r.max_new_tokens == 0 else None for r in reqs]
        while any(x is None for x in reasons):
            step = [self.pad_id] * batch
            active = [i for i in range(batch) if reasons[i] is None]
            for i, (tok, lp) in zip(active, _pick(logits, reqs, rngs, active)):
                r = reqs[i]
                tokens[i].append(tok)
                logps[i].append(lp)
                step[i] = tok
                if tok in r.stop_ids:
                    reasons[i] = "stop"
                elif len(tokens[i]) >= r.max_new_tokens:
                    reasons[i] = "length"
            if all(x is not None for x in reasons):
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            logits = self._forward(torch.tensor(step)[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1
        return [
            GenResult(
                token_ids=tokens[i],
                logprobs=logps[i],
                versions=[self.version] * len(tokens[i]),
                finish_reason=reasons[i] or "length",
            )
            for i in range(batch)
        ]


def _pick(
    logits: torch.Tensor, reqs: list[GenRequest], rngs: list[torch.Generator], rows: list[int]
) -> list[tuple[int, float]]:
    """Choose the next token of each row in ``rows``, with its behaviour log-prob.

    Greedy when ``temperature <= 0`` (log-prob under temperature 1); otherwise sample
    from the ``top_p`` nucleus of softmax(logits / temperature) with the row's own
    generator. The log-prob is always taken over the full, untruncated distribution.
    """
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in reqs])
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    greedy = torch.argmax(logits, dim=-1).tolist()
    picks = []
    for i in rows:
        r = reqs[i]
        tok = greedy[i] if r.temperature <= 0 else _sample(logp[i], r.top_p, rngs[i])
        picks.append(tok)
    lps = logp[torch.tensor(rows), torch.tensor(picks)].tolist()
    return list(zip(picks, lps))


def _sample(logp: torch.Tensor, top_p: float, rng: torch.Generator) -> int:
    """Sample from exp(logp) restricted to its ``top_p`` nucleus (top token always kept)."""
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p
        keep[0] = True
        trunc = torch.zeros_like(probs)
        trunc[order[keep]] = sorted_p[keep]
        probs = trunc
    return int(torch.multinomial(probs, 1, generator=rng))


def _request_rng(req: GenRequest, default: torch.Generator) -> torch.Generator:
    if req.seed is None:
        return default
    rng = torch.Generator()
    rng.manual_seed(int(req.seed))
    return rng


def _tied(model) -> bool:
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    return head is not None and head.weight is emb.weight


def _cache_kwarg(model) -> str:
    """transformers 5.x names the KV cache argument ``cache``; 4.x ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
