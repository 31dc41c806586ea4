"""The lean forward (``rollart.rollout.lean``) computes what ``transformers`` computes.

Real ``transformers`` models with random weights (Qwen2 with and without grouped-query
attention, Llama with attention bias), left-padded batches, a cached prefix with padding
in the middle of rows, and long decodes that make the KV cache grow in place.
"""

import pytest
import torch
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from rollart.rollout.engine import TorchEngine, _cache_kwarg
from rollart.rollout.lean import LeanForward, unsupported
from rollart.types import GenRequest


def qwen2(kv_heads=4, **extra):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, **extra)
    return Qwen2ForCausalLM(config).eval()


def llama():
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         attention_bias=True, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=0, rope_theta=500.0)
    return LlamaForCausalLM(config).eval()


def left_padded(lengths, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def hf_logits(model, ids, mask, pos, cache):
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                **{_cache_kwarg(model): cache})
    return out.logits[:, -1].float()


@pytest.mark.parametrize("make", [qwen2, lambda: qwen2(kv_heads=2), llama],
                         ids=["qwen2", "qwen2-gqa", "llama-bias"])
@torch.inference_mode()
def test_prefill_and_a_long_decode_match_transformers(make):
    model = make()
    lean = LeanForward(model)
    ids, mask, pos = left_padded([9, 3, 1, 9, 6])
    ref_cache, cache = DynamicCache(config=model.config), lean.new_cache()
    ref, got = hf_logits(model, ids, mask, pos, ref_cache), lean(ids, mask, pos, cache)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    nxt = pos[:, -1:] + 1
    for _ in range(60):  # well past the cache's first spare room: it grows in place
        tok = ref.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        ref = hf_logits(model, tok, mask, nxt, ref_cache)
        got = lean(tok, mask, nxt, cache)
        nxt = nxt + 1
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(ref_cache.layers, cache.layers):
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.values, a.values, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_new_tokens_on_a_cached_prefix_with_padding_in_the_middle():
    """A prefix-cache hit forwards only the new tokens: rows then have padding between
    their cached prefix and their left-padded suffix (``pd.start_with_prefix``)."""
    model = qwen2(kv_heads=2)
    lean = LeanForward(model)
    ids, mask, pos = left_padded([7, 4, 2])
    ref_cache, cache = DynamicCache(config=model.config), lean.new_cache()
    hf_logits(model, ids, mask, pos, ref_cache)
    lean(ids, mask, pos, cache)
    suffix, smask, _ = left_padded([1, 5, 3], seed=3)
    spos = pos[:, -1:] + 1 + (smask.cumsum(-1) - 1).clamp(min=0)
    mask = torch.cat([mask, smask], dim=1)
    torch.testing.assert_close(lean(suffix, mask, spos, cache),
                               hf_logits(model, suffix, mask, spos, ref_cache),
                               rtol=1e-5, atol=1e-5)


def test_unsupported_models_are_named_and_the_engine_falls_back(tmp_path):
    scaled = qwen2(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert "linear" in unsupported(scaled)
    with pytest.raises(ValueError, match="linear"):
        LeanForward(scaled)
    scaled.save_pretrained(tmp_path / "m")
    from rollart.model import build_tokenizer

    build_tokenizer(["abc def"]).save_pretrained(tmp_path / "m")
    assert TorchEngine(str(tmp_path / "m")).lean is None  # transformers' forward


def test_engine_outputs_equal_with_and_without_the_lean_forward(model_dir):
    """Same greedy tokens and log-probs through the whole engine (continuous batching,
    prefix reuse across turns), lean or not."""
    fast, slow = TorchEngine(model_dir), TorchEngine(model_dir, lean=False)
    assert fast.lean is not None and slow.lean is None
    prompts = [[3, 4, 5], [5, 6, 7, 8, 9, 10, 11], [7], [12, 13, 14, 15, 16]]
    for turn in range(2):  # the second turn reuses each trajectory's cached prefix
        reqs = [GenRequest(p, max_new_tokens=6 + i, temperature=0.0, cache_key=f"t{i}")
                for i, p in enumerate(prompts)]
        a, b = fast.generate(reqs), slow.generate(reqs)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        prompts = [p + r.token_ids + [3] for p, r in zip(prompts, a)]
    assert fast.prefix_cache.hit_tokens > 0


def test_joining_and_leaving_keep_room_to_append_in_place():
    """Rows joining (``pd.concat_starts``) and leaving (``_Layer.keep``) give the same KV
    as padding and slicing would, in buffers with spare columns: the next decode step
    writes its column in place instead of copying the cache to grow it."""
    from rollart.rollout import pd
    from rollart.rollout.lean import LeanCache

    g = torch.Generator().manual_seed(0)

    def start(rows, width):
        cache = LeanCache(1)
        cache.update(torch.randn(rows, 2, width, 4, generator=g),
                     torch.randn(rows, 2, width, 4, generator=g), 0)
        return (torch.zeros(rows, 5), torch.ones(rows, width, dtype=torch.long),
                torch.zeros(rows, 1, dtype=torch.long), cache)

    a, b = start(2, 3), start(1, 5)
    assert a[3].layers[0]._k.shape[2] > 3  # a first append leaves room too
    ka, kb = a[3].layers[0].keys.clone(), b[3].layers[0].keys.clone()
    _, mask, _, cache = pd.concat_starts([a, b])
    layer = cache.layers[0]
    want = torch.cat([torch.cat([torch.zeros(2, 2, 2, 4), ka], dim=2), kb])
    assert torch.equal(layer.keys, want) and mask[:2, :2].sum() == 0
    buffer = layer._k
    assert buffer.shape[2] > 5
    layer.keep(torch.tensor([0, 2]), 1)
    assert torch.equal(layer.keys, want[[0, 2], :, 1:]) and layer._k.shape[2] > 4
    buffer = layer._k
    cache.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0)
    assert layer._k is buffer and torch.equal(layer.keys[:, :, -1], torch.ones(2, 2, 4))
