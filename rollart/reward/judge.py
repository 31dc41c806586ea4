"""``LLMJudge``: a model-based reward — a causal LM reads the episode and gives a verdict.

The judge turns an ``Episode`` into text (observations and actions in turn order, then
``question``) and returns P(``yes``) / (P(``yes``) + P(``no``)) for the next token:
a reward in (0, 1). ``batch(episodes)`` scores many episodes with one padded forward
pass, which is what both serverless backends call with a batch of requests. The
judge pickles as its settings only; each process loads the model folder once (the
first call on a fresh pool worker pays that load, part of its cold start).

>>> # judge = serverless(LLMJudge(model_dir), backend="pool", max_batch=16)
>>> # Task("mytask", MyEnv, reward_fn=judge, max_turns=4)
"""

from __future__ import annotations

import threading

from rollart.types import Episode

_MODELS: dict[str, tuple] = {}
_LOCK = threading.Lock()


class LLMJudge:
    """Scores episodes with the causal LM in ``model_path`` (any HF model folder)."""

    def __init__(self, model_path: str, *, yes: str = "success", no: str = "invalid",
                 question: str = ":", max_tokens: int = 256):
        if not yes or not no or yes == no:
            raise ValueError(f"LLMJudge: yes and no must be two different words, "
                             f"got {yes!r} / {no!r}")
        self.model_path, self.yes, self.no = str(model_path), yes, no
        self.question, self.max_tokens = question, int(max_tokens)
        self.__name__ = f"LLMJudge({yes}/{no})"

    def __call__(self, episode: Episode) -> float:
        return self.batch([episode])[0]

    def prompt(self, ep: Episode) -> str:
        """The text the judge reads.

        >>> LLMJudge("m").prompt(Episode("t", 0, ["go :", "done ."], ["up"], [1.0], {}))
        'go : up done . :'
        """
        parts = []
        for i, obs in enumerate(ep.observations):
            parts.append(obs)
            if i < len(ep.actions):
                parts.append(ep.actions[i])
        parts.append(self.question)
        return " ".join(p for p in parts if p)

    def batch(self, episodes: list[Episode]) -> list[float]:
        import torch

        from rollart.model import encode

        model, tok, yes_id, no_id = self._load()
        seqs = [encode(tok, self.prompt(ep))[-self.max_tokens:] or [tok.eos_token_id]
                for ep in episodes]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits
        last = torch.tensor([len(s) - 1 for s in seqs])
        pick = logits[torch.arange(len(seqs)), last][:, [yes_id, no_id]]
        return [float(p) for p in torch.softmax(pick.float(), dim=-1)[:, 0]]

    def _load(self):
        """The model and tokenizer (loaded once per process) and the verdict token ids."""
        with _LOCK:
            if self.model_path not in _MODELS:
                from rollart.model import load_model, load_tokenizer

                _MODELS[self.model_path] = (load_model(self.model_path),
                                            load_tokenizer(self.model_path))
            model, tok = _MODELS[self.model_path]
        ids = []
        for word in (self.yes, self.no):
            tid = tok.convert_tokens_to_ids(word)
            if tid is None or tid == tok.unk_token_id:
                raise ValueError(f"LLMJudge: {word!r} is not a token of {self.model_path}; "
                                 "pick verdict words the tokenizer knows")
            ids.append(tid)
        return model, tok, *ids

    def __repr__(self) -> str:
        return f"LLMJudge({self.model_path!r}, yes={self.yes!r}, no={self.no!r})"
