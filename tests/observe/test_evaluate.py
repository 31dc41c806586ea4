"""Held-out evaluation (rollart.observe.evaluate) samples each episode by its held-out
seed: the warm-up policy and the trained one, or any two evaluations of the same seeds,
are paired per seed, whatever else is in the list and whichever episodes end first."""

from collections import defaultdict


def test_an_episode_samples_by_its_held_out_seed_not_its_place(tiny_model, monkeypatch):
    from rollart.observe.evaluate import evaluate
    from rollart.rollout.engine import TorchEngine

    seen = defaultdict(list)  # cache key (task, held-out seed) -> request seeds, in turns
    real = TorchEngine.generate

    def recording(self, requests):
        for r in requests:
            seen[r.cache_key].append(r.seed)
        return real(self, requests)

    monkeypatch.setattr(TorchEngine, "generate", recording)
    evaluate(tiny_model, ["guess"], seeds=range(6))  # episodes end at different turns
    alone = dict(seen)
    seen.clear()
    evaluate(tiny_model, ["guess"], seeds=[3, 5])
    for key in ("eval-guess-3", "eval-guess-5"):
        n = min(len(seen[key]), len(alone[key]))
        assert n >= 1 and seen[key][:n] == alone[key][:n], key
    assert seen["eval-guess-3"][:1] != seen["eval-guess-5"][:1]
