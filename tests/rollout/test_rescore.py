"""``InferenceWorker.rescore`` on an in-process Dask cluster: a stale member's tokens are
re-scored through the worker's engine thread under the weights it holds, and the answer
is what the model itself computes for those tokens, before and after a weight update."""

import pytest
import torch

from rollart.model import load_model
from rollart.rollout import InferenceWorker, TorchEngine
from rollart.testing import cluster_fixture
from rollart.types import GenRequest, ScoreRequest
from rollart.weights.store import WeightStore

client = cluster_fixture("H800")


def perturbed(engine, seed=5):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g)
            for k, v in engine.state_dict().items()}


def direct_logprobs(model, ids, positions, temperature):
    """The log-probs of ``ids[p]`` given ``ids[:p]``, by one plain forward of ``model``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[p - 1, ids[p]]) for p in positions]


def test_rescore_matches_the_model_and_follows_a_weight_update(client, model_dir, tmp_path):
    store = WeightStore(str(tmp_path / "w"))
    store.put(0, load_model(model_dir).state_dict())
    worker = client.submit(InferenceWorker, model_dir, store.url, pool="H800",
                           threads=1, watch=None, actor=True, resources={"H800": 1}).result()
    try:
        prompt = [5, 6, 7, 8]
        gen = worker.generate(GenRequest(prompt, max_new_tokens=10, temperature=0.7,
                                         seed=3)).result()
        assert len(gen.token_ids) >= 2
        ids = prompt + gen.token_ids + [9, 10] + [11]  # turn 1, an observation, turn 2
        positions = [len(prompt) + i for i in range(len(gen.token_ids))] + [len(ids) - 1]
        req = ScoreRequest(ids, positions, temperature=0.7)

        v0 = worker.rescore(req).result()
        assert v0.version == 0 and v0.worker.startswith("inproc://")
        model0 = load_model(model_dir)
        assert v0.logprobs == pytest.approx(direct_logprobs(model0, ids, positions, 0.7),
                                            abs=1e-4)
        # the generation's own behaviour log-probs are the same numbers
        assert v0.logprobs[:len(gen.token_ids)] == pytest.approx(gen.logprobs, abs=1e-4)

        reference = TorchEngine(model_dir)  # its model gets v1 as the worker's does
        new = perturbed(reference)  # (a tied head: one tensor, as the engine loads it)
        reference.load_state_dict(new, 1)
        store.put(1, new)
        worker.update_weights(1).result()
        v1 = worker.rescore(ScoreRequest(ids, positions, 0.7, min_version=1),
                            wait=20).result()
        assert v1.version == 1
        expected = direct_logprobs(reference.model, ids, positions, 0.7)
        assert v1.logprobs == pytest.approx(expected, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(v1.logprobs, v0.logprobs)) > 1e-2

        # a version nobody published: the worker waits briefly, answers with what it has
        late = worker.rescore(ScoreRequest(ids, positions, 0.7, min_version=2),
                              wait=0.3).result()
        assert late.version == 1
        with pytest.raises(ValueError, match="outside"):
            worker.rescore(ScoreRequest(ids, [0])).result()
        stats = worker.stats().result()
        assert stats["scored_tokens"] == 3 * len(positions)
    finally:
        worker.close().result()


def test_vllm_engine_refuses_to_rescore_with_the_option_to_change():
    from rollart.rollout.serving import BatchingEngine

    class NoScore(BatchingEngine):  # the skeleton's answer, which the vLLM engine keeps
        _new_batch = _stage = _copy_in = lambda *a: None

    eng = NoScore(vocab_size=10, max_positions=8)
    with pytest.raises(NotImplementedError, match="stale_members='abort'"):
        eng.score([ScoreRequest([1, 2], [1])])
