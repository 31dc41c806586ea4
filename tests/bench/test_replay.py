"""benchmarks/_replay.py: a request log replayed into a bare TorchEngine does the
recorded work: the same requests, each forwarding the prompt tokens the run forwarded
(its cached prefix primed beforehand) and generating exactly the recorded number of
tokens whatever its stop ids and strings, admitted no earlier than it arrived."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def replay_mod(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _replay

    return _replay


def _rec(arrival, prompt, generated, cached=0, keyed=True, **kw):
    return {"arrival": arrival, "prompt_ids": prompt, "cached": cached, "keyed": keyed,
            "generated": generated, "finish_reason": "stop", "temperature": 1.0,
            "top_p": 1.0, "seed": None, "stop_ids": (), "stop_strings": (), "version": 0,
            **kw}


def test_the_replay_serves_exactly_the_recorded_work(replay_mod, model_dir):
    from rollart.model import load_tokenizer

    vocab = len(load_tokenizer(model_dir))
    records = [
        _rec(0.0, [3, 4, 5, 6], 4, seed=1, stop_strings=(" ", "a")),
        # a later turn: 6 of its 10 prompt tokens came from the run's prefix cache
        _rec(0.05, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 3, cached=6, top_p=0.9),
        # greedy, and every token a stop id: the run's engine would have stopped at once
        _rec(0.1, [13, 14, 15], 7, keyed=False, temperature=0.0,
             stop_ids=tuple(range(vocab))),
        _rec(0.1, [16, 17], 0),
    ]
    log = {"requests": records[::-1], "dropped": 0}  # replay sorts by arrival
    out = replay_mod.replay(model_dir, log, threads=1, max_batch=4, warmup=2)
    assert out["requests"] == len(records) and out["mismatched"] == 0
    assert out["tokens"] == out["recorded_tokens"] == 4 + 3 + 7
    assert out["primed_tokens"] == 6
    # forwarded on the clock: every prompt less its cached part (distinct prompts)
    assert out["prefill_tokens"] == sum(len(r["prompt_ids"]) - r["cached"]
                                        for r in records if r["generated"])
    assert out["wall_s"] >= 0.1  # paced: the last arrivals came 0.1 s in
    assert 0 < out["busy_s"] <= out["wall_s"] and out["cpu_s"] > 0
    assert out["tok_s"] > 0 and out["tok_s_cpu"] > 0 and out["lag_s"] >= 0


def test_replay_window_runs_paced_and_free_on_the_same_log(replay_mod, model_dir):
    records = [_rec(0.02 * i, [3 + i, 4, 5, 6 + i], 3 + i % 2, seed=i) for i in range(6)]
    infer = {"threads": 1, "max_batch": 4, "engine": "torch", "engine_options": {}}
    out = replay_mod.replay_window(model_dir, [{"requests": records, "dropped": 0}], infer)
    assert out["requests"] == out["free_requests"] == out["logged_requests"] == 6
    assert out["tokens"] == out["free_tokens"] == out["logged_tokens"] == 21
    assert out["wall_s"] >= 0.1 and out["free_tok_s"] > 0
    with pytest.raises(RuntimeError, match="one inference worker"):
        replay_mod.replay_window(model_dir, [], infer)
    with pytest.raises(RuntimeError, match="dropped 2"):
        replay_mod.replay_window(model_dir, [{"requests": records, "dropped": 2}], infer)


def test_forced_requests_keep_the_checks_but_cannot_stop(replay_mod):
    rec = _rec(0.0, [1, 2], 5, stop_ids=(2, 9), stop_strings=("ab", "</s>"), seed=4)
    (req,) = replay_mod.forced_requests([rec])
    assert req.max_new_tokens == 5 and req.seed == 4 and req.cache_key == "replay-0"
    assert len(req.stop_ids) == 2 and all(t < 0 for t in req.stop_ids)
    assert [len(s) for s in req.stop_strings] == [2, 4]
    assert not any(s in "ab</s>" for s in req.stop_strings)
    (plain,) = replay_mod.forced_requests([_rec(0.0, [1], 1, keyed=False)])
    assert plain.cache_key is None


def test_a_vllm_run_is_refused(replay_mod, model_dir):
    with pytest.raises(ValueError, match="torch engine"):
        replay_mod.replay(model_dir, {"requests": [_rec(0.0, [1, 2], 1)]}, threads=1,
                          engine="vllm")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
