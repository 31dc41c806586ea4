"""InferenceWorker's request log (rollart.rollout.request_log): off by default, records
what it served while on (arrival, prompt, the prefix cache's part, tokens, sampling),
and PrefixCache.peek says what a lookup would find without touching the cache."""

import time

import pytest

from rollart.rollout import InferenceWorker
from rollart.rollout.pd import PrefixCache
from rollart.rollout.request_log import RequestLog
from rollart.testing import cluster_fixture
from rollart.types import GenRequest, GenResult

client = cluster_fixture("H800", scope="module")


@pytest.fixture(scope="module")
def worker(client, model_dir, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store") / "weights")
    fut = client.submit(InferenceWorker, model_dir, store, pool="H800", max_batch=16,
                        threads=1, actor=True, resources={"H800": 1})
    actor = fut.result()
    yield actor
    actor.close().result()


def _turn(prompts, keys, tokens=5, stop=()):
    return [GenRequest(p, max_new_tokens=tokens, temperature=1.0, seed=7 + i, cache_key=k,
                       stop_strings=stop) for i, (p, k) in enumerate(zip(prompts, keys))]


def test_the_log_records_what_arrived_while_on_and_nothing_else(worker):
    first = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]
    keys = ["a", "b", None]
    with pytest.raises(RuntimeError, match="start_request_log"):
        worker.take_request_log().result()
    worker.generate(_turn([[12, 13]], ["x"])[0]).result()  # before the log: left out
    worker.start_request_log(limit=100).result()
    t0 = time.perf_counter()
    one = [worker.generate(r) for r in _turn(first, keys, stop=("zz",))]
    one = [f.result() for f in one]
    # second turns: the prompt grows by the answer and one token; the cache holds the
    # first turn's prompt and every answer token but the last (keyed rows only)
    second = [p + r.token_ids + [14] for p, r in zip(first, one)]
    two = [f.result() for f in [worker.generate(r) for r in _turn(second, keys, tokens=3)]]
    took = time.perf_counter() - t0
    log = worker.take_request_log().result()
    with pytest.raises(RuntimeError, match="start_request_log"):  # off again
        worker.take_request_log().result()
    recs = log["requests"]
    assert len(recs) == 6 and log["dropped"] == 0 and log["pool"] == "H800"
    assert [r["arrival"] for r in recs] == sorted(r["arrival"] for r in recs)
    assert all(0 <= r["arrival"] <= took for r in recs)
    by_prompt = {tuple(r["prompt_ids"]): r for r in recs}
    for p, k, res in zip(first + second, keys + keys, one + two):
        rec = by_prompt[tuple(p)]
        assert rec["generated"] == len(res.token_ids) and rec["keyed"] == (k is not None)
        assert rec["temperature"] == 1.0 and rec["seed"] is not None
    for p in first:
        assert by_prompt[tuple(p)]["cached"] == 0
        assert by_prompt[tuple(p)]["stop_strings"] == ("zz",)
    for p, k in zip(second, keys):
        assert by_prompt[tuple(p)]["cached"] == (len(p) - 2 if k is not None else 0), (p, k)


def test_client_run_starts_and_takes_every_inference_workers_log(client, worker):
    from rollart.rollout.request_log import start_request_logs, take_request_logs

    assert list(client.run(take_request_logs).values()) == [[]]  # none on
    assert list(client.run(start_request_logs).values()) == [1]
    worker.generate(_turn([[5, 6, 7]], ["k"])[0]).result()
    (logs,) = client.run(take_request_logs).values()
    assert [r["prompt_ids"] for r in logs[0]["requests"]] == [[5, 6, 7]]
    assert list(client.run(take_request_logs).values()) == [[]]  # taking stopped it


def test_the_log_is_bounded_and_leaves_out_aborted_requests():
    log = RequestLog(limit=2)
    ok = GenResult([1, 2], [0.0, 0.0], [3, 3], "length")
    for i in range(3):
        log.record(GenRequest([i + 1]), time.perf_counter(), 0, ok)
    log.record(GenRequest([9]), time.perf_counter(), 0, GenResult([], [], [], "abort"))
    log.record(GenRequest([8]), log.t0 - 1, 0, ok)  # arrived before the log
    out = log.take()
    assert [r["prompt_ids"] for r in out["requests"]] == [[2], [3]]
    assert out["dropped"] == 1 and out["requests"][0]["version"] == 3
    assert log.take()["requests"] == []
    with pytest.raises(ValueError):
        RequestLog(limit=0)


def test_peek_finds_what_lookup_finds_without_touching_the_cache():
    import torch

    pc = PrefixCache(2)
    kv = torch.zeros(1, 1, 1, 3)
    pc.store("a", [1, 2, 3], kv, version=1)
    pc.store("b", [4, 5, 6], kv, version=1)
    req = GenRequest([1, 2, 3, 9], cache_key="a")
    assert pc.peek(req, 1) == 3 and pc.peek(req, 2) == 0
    assert pc.peek(GenRequest([1, 2, 3], cache_key="a"), 1) == 0  # not a strict prefix
    assert pc.peek(GenRequest([1, 7, 3, 9], cache_key="a"), 1) == 0
    assert pc.peek(GenRequest([1, 2, 3, 9]), 1) == 0
    assert pc.peek(req, 2) == 0 and len(pc) == 2  # a stale version is not evicted by a peek
    pc.store("c", [7, 8], kv[..., :2], version=1)  # LRU: "a" went first, peeks moved nothing
    assert pc.peek(req, 1) == 0 and pc.lookup(GenRequest([4, 5, 6, 1], cache_key="b"), 1)
