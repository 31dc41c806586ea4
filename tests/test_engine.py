"""TorchEngine: batching with left padding, behaviour log-probs, sampling, weights."""

import pytest
import torch

from rollart.model import build_tiny_model
from rollart.rollout.engine import TorchEngine
from rollart.types import GenRequest

CORPUS = ["gridnav : goal 3 right 1 up ; act ? left down , stop ."]
PROMPTS = [[3, 4, 5], [5, 6, 7, 8, 9, 10, 11], [7], [12, 13, 14, 15, 16]]


def scrambled(engine: TorchEngine, seed: int) -> dict:
    """Large random weights: outputs then depend strongly on the whole context."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in engine.state_dict().items():
        noise = torch.randn(v.shape, generator=g)
        out[k] = 1.0 + 0.1 * noise if "norm" in k else noise * (0.3 if v.dim() > 1 else 0.1)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", CORPUS, hidden_size=64)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = TorchEngine(model_dir, max_batch=3)  # 4 prompts -> two chunks
    eng.load_state_dict(scrambled(eng, 1), version=0)
    return eng


def test_batched_greedy_equals_one_at_a_time(engine):
    reqs = [GenRequest(p, max_new_tokens=10, temperature=0.0) for p in PROMPTS]
    batches = engine.batches
    together = engine.generate(reqs)
    assert engine.batches == batches + 2
    alone = [engine.generate([r])[0] for r in reqs]
    assert len({tuple(r.token_ids) for r in together}) > 1
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.finish_reason == "length" and len(a.token_ids) == 10
        assert a.versions == [0] * 10


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_teacher_forcing(engine, temperature):
    reqs = [GenRequest(p, max_new_tokens=6, temperature=temperature, seed=i)
            for i, p in enumerate(PROMPTS)]
    scale = temperature if temperature > 0 else 1.0
    for req, res in zip(reqs, engine.generate(reqs)):
        ids = torch.tensor([req.prompt_ids + res.token_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0].float()
        n = len(req.prompt_ids)
        logp = torch.log_softmax(logits[n - 1 : -1] / scale, dim=-1)
        expected = logp[torch.arange(len(res.token_ids)), torch.tensor(res.token_ids)]
        assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)


def test_seeded_sampling_is_reproducible_and_independent_of_companions(engine):
    req = GenRequest(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=42)
    alone = engine.generate([req])[0]
    others = [GenRequest(p, max_new_tokens=12, temperature=1.0) for p in PROMPTS]
    mixed = engine.generate([others[0], req, others[2]])[1]
    assert alone.token_ids == mixed.token_ids
    assert alone.logprobs == pytest.approx(mixed.logprobs, abs=1e-4)
    other_seed = engine.generate([GenRequest(PROMPTS[1], 12, 1.0, seed=43)])[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_ids(engine):
    free = engine.generate([GenRequest(PROMPTS[0], max_new_tokens=10, temperature=0.0)])[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    req = GenRequest(PROMPTS[0], max_new_tokens=10, temperature=0.0, stop_ids=(stop, 999))
    res = engine.generate([req, GenRequest(PROMPTS[1], 10, 0.0)])
    assert res[0].token_ids == free.token_ids[: first + 1]
    assert res[0].finish_reason == "stop"
    assert res[1].finish_reason == "length" and len(res[1].token_ids) == 10
    assert engine.generate([GenRequest(PROMPTS[0], max_new_tokens=0)])[0].token_ids == []


def test_tiny_top_p_equals_greedy(engine):
    greedy = engine.generate([GenRequest(p, 8, temperature=0.0) for p in PROMPTS])
    nucleus = engine.generate([GenRequest(p, 8, temperature=0.8, top_p=1e-6, seed=i)
                               for i, p in enumerate(PROMPTS)])
    for g, n in zip(greedy, nucleus):
        assert g.token_ids == n.token_ids


def test_invalid_requests(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([GenRequest([], 4)])
    with pytest.raises(ValueError, match="positions"):
        engine.generate([GenRequest([3] * 510, 4)])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([GenRequest([10_000], 4)])


def test_load_state_dict_changes_outputs_and_version(model_dir):
    eng = TorchEngine(model_dir)
    req = GenRequest(PROMPTS[1], max_new_tokens=8, temperature=0.0)
    before = eng.generate([req])[0]
    new = scrambled(eng, 7)
    new.pop("lm_head.weight", None)  # tied embeddings: the head may be absent
    eng.load_state_dict(new, version=3)
    after = eng.generate([req])[0]
    assert eng.version == 3 and after.versions == [3] * len(after.token_ids)
    assert after.token_ids != before.token_ids
    assert torch.equal(eng.model.lm_head.weight, new["model.embed_tokens.weight"])
    with pytest.raises(KeyError, match="missing"):
        eng.load_state_dict({"model.norm.weight": new["model.norm.weight"]}, version=4)
    assert eng.version == 3
    assert eng.tokens_generated == 16 and eng.batches == 2 and eng.busy_seconds > 0
