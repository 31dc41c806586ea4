"""Serverless rewards without a cluster: the decorator, the JSON wire format, the
shipped function server on 127.0.0.1, batching/time-out/retry/failure policy of the
HTTP backend, and the LLM judge on the tiny model."""

from __future__ import annotations

import asyncio
import doctest
import json
import pickle
import threading
import time
import urllib.error
import urllib.request

import pytest

import rollart
import rollart.reward.offload as offload
from rollart.reward import (
    FunctionServer,
    LLMJudge,
    RewardFailed,
    ServerlessConfig,
    http_reward,
    serverless,
)
from rollart.reward.dispatch import Dispatchers, RewardDispatcher
from rollart.reward.offload import decode_inputs, encode_request, run_batch, score_batch
from rollart.types import Episode


@serverless(max_workers=3, timeout=5)
def n_actions(ep):
    """Module-level decorated reward: pickles by reference."""
    return float(len(ep.actions))


def plain_len(ep):
    return float(len(ep.observations))


def _ep(i: int = 0, success: bool = False) -> Episode:
    return Episode("t", i, ["go :"] * (i + 1), ["up"] * i, [0.0] * i, {"success": success})


class Flaky:
    """Fails its first ``n`` calls, then returns 1.0 (server-side state)."""

    def __init__(self, n):
        self.n, self.calls = n, 0
        self.lock = threading.Lock()

    def __call__(self, ep):
        with self.lock:
            self.calls += 1
            if self.calls <= self.n:
                raise RuntimeError(f"cold judge (call {self.calls})")
        return 1.0


def sleepy(ep):
    time.sleep(1.5)
    return 1.0


def garbage(ep):
    return "very good"


def per_item(ep):
    if ep.seed == 2:
        raise ValueError("bad input 2")
    return float(ep.seed)


class Counting:
    """A batched reward: records the size of each batch it gets."""

    def __init__(self):
        self.sizes = []

    def __call__(self, ep):
        return self.batch([ep])[0]

    def batch(self, eps):
        self.sizes.append(len(eps))
        return [float(e.seed) for e in eps]


# -- the decorator ----------------------------------------------------------------------
def test_doctests():
    result = doctest.testmod(offload)
    assert result.attempted >= 4 and result.failed == 0


def test_decorator_keeps_a_plain_reward_function():
    assert n_actions(_ep(3)) == 3.0 and n_actions.name == "n_actions"
    assert n_actions.config == ServerlessConfig(max_workers=3, timeout=5)
    assert rollart.serverless is serverless and rollart.http_reward is http_reward
    bare = serverless(plain_len)
    assert bare.config.backend == "pool" and bare(_ep(1)) == 2.0


def test_serverless_rewards_pickle():
    by_ref = pickle.loads(pickle.dumps(n_actions))
    assert by_ref is n_actions  # a module attribute: pickled by reference
    inline = serverless(plain_len, backend="http", url="http://127.0.0.1:1/x")
    copy = pickle.loads(pickle.dumps(inline))
    assert copy.fn is plain_len and copy.config == inline.config and copy.name == "plain_len"
    judge = pickle.loads(pickle.dumps(serverless(LLMJudge("/m"))))
    assert judge.fn.model_path == "/m" and judge.name.startswith("LLMJudge")


@pytest.mark.parametrize("kwargs, needle", [
    ({"backend": "lambda"}, "backend must be one of"),
    ({"backend": "http"}, "needs url="),
    ({"max_workers": 0}, "max_workers must be an int >= 1"),
    ({"retries": -1}, "retries"),
    ({"timeout": 0}, "timeout must be > 0"),
    ({"on_failure": "zero"}, "on_failure must be 'fail' or a fallback"),
    ({"on_failure": float("nan")}, "finite"),
])
def test_config_errors_say_what_to_change(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ServerlessConfig(**kwargs)


def test_backoff_doubles_and_is_capped():
    cfg = ServerlessConfig(backoff=0.5, max_backoff=1.5)
    assert [cfg.delay(i) for i in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, 1.5]


def test_run_batch_keeps_errors_per_item():
    outputs, errors = score_batch(per_item, [_ep(i) for i in range(4)])
    assert outputs == [0.0, 1.0, None, 3.0]
    assert errors[2] == "ValueError: bad input 2" and errors.count(None) == 3
    outputs, errors = score_batch(garbage, [_ep(0)])
    assert outputs == [None] and "returned str" in errors[0]
    assert run_batch(str.upper, ["a", "b"]) == (["A", "B"], [None, None])


def test_wire_format_is_json_and_round_trips_episodes():
    eps = [_ep(2, success=True), _ep(0)]
    body = json.loads(encode_request(eps))
    assert body["kind"] == "episode" and body["inputs"][0]["info"] == {"success": True}
    assert decode_inputs(body) == eps
    assert decode_inputs(json.loads(encode_request([{"a": 1}]))) == [{"a": 1}]


# -- the function server ----------------------------------------------------------------
def _post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers["Content-Type"], json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], json.loads(e.read())


def test_function_server_json_in_json_out():
    with FunctionServer({"len": plain_len, "item": per_item, "upper": str.upper}) as srv:
        assert srv.address.startswith("http://127.0.0.1:")
        status, ctype, out = _post(srv.url("item"),
                                   json.loads(encode_request([_ep(1), _ep(2)])))
        assert status == 200 and ctype == "application/json"
        assert out == {"outputs": [1.0, None], "errors": [None, "ValueError: bad input 2"]}
        # any stateless step, called by any HTTP client: plain JSON inputs
        assert _post(srv.url("upper"), {"inputs": ["ab"]})[2]["outputs"] == ["AB"]
        assert _post(srv.address + "/nope", {"inputs": []})[0] == 404
        assert _post(srv.url("len"), None, raw=b"{not json")[0] == 400
        assert _post(srv.url("len"), {"items": []})[0] == 400
        with urllib.request.urlopen(srv.address + "/health", timeout=10) as r:
            assert json.loads(r.read())["functions"] == ["item", "len", "upper"]
        with urllib.request.urlopen(srv.address + "/metrics", timeout=10) as r:
            m = json.loads(r.read())
        assert m["requests"] == 2 and m["items"] == 3 and m["errors"] == 1
        # a reward that only has a URL runs by calling the endpoint
        assert http_reward(srv.url("len"))(_ep(2)) == 3.0


def _score_all(reward, episodes):
    """Score concurrently through one dispatcher, as a runner does."""
    async def go():
        d = RewardDispatcher(reward)
        res = await asyncio.gather(*(d.score(e) for e in episodes), return_exceptions=True)
        return res, d

    return asyncio.run(go())


def test_http_backend_batches_concurrent_requests():
    fn = Counting()
    with FunctionServer({"count": fn}) as srv:
        reward = http_reward(srv.url("count"), max_batch=8, batch_wait=0.05)
        res, d = _score_all(reward, [_ep(i) for i in range(20)])
        assert res == [float(i) for i in range(20)]
        assert sum(fn.sizes) == 20 and max(fn.sizes) == 8 and len(fn.sizes) == 3
        assert d.counts["batches"] == 3 and d.counts["done"] == 20 and d.in_flight == 0


class SlowBatched(Counting):
    """Records how many batches run at once."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def batch(self, eps):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(0.1)
        with self.lock:
            self.now -= 1
        return super().batch(eps)


def test_in_flight_window_queues_and_grows_batches():
    fn = SlowBatched()
    with FunctionServer({"slow": fn}) as srv:
        reward = http_reward(srv.url("slow"), max_batch=16, batch_wait=0.0,
                             max_in_flight=1)

        async def go():
            d = RewardDispatcher(reward)
            first = [asyncio.ensure_future(d.score(_ep(i))) for i in range(2)]
            await asyncio.sleep(0.02)  # the first batch is out; the rest must wait
            rest = [asyncio.ensure_future(d.score(_ep(i))) for i in range(2, 12)]
            return await asyncio.gather(*first, *rest)

        assert asyncio.run(go()) == [float(i) for i in range(12)]
        assert fn.peak == 1 and fn.sizes[0] <= 2 and max(fn.sizes[1:]) == 10


def test_http_backend_retries_with_backoff_then_succeeds():
    flaky = Flaky(2)
    with FunctionServer({"flaky": flaky}) as srv:
        reward = http_reward(srv.url("flaky"), retries=2, backoff=0.1, max_batch=1)
        t0 = time.perf_counter()
        res, d = _score_all(reward, [_ep(0)])
        assert res == [1.0] and flaky.calls == 3
        assert d.counts["retries"] == 2 and d.counts["failed"] == 0
        assert time.perf_counter() - t0 >= 0.1 + 0.2  # waited out the back-off


def test_http_backend_failure_policy():
    with FunctionServer({"flaky": Flaky(100), "garbage": garbage}) as srv:
        failing = http_reward(srv.url("flaky"), retries=1, backoff=0.01)
        res, d = _score_all(failing, [_ep(0), _ep(1)])
        assert all(isinstance(r, RewardFailed) for r in res)
        assert "after 2 attempt(s)" in str(res[0]) and "cold judge" in str(res[0])
        assert d.counts["failed"] == 2 and d.counts["attempts"] == 2
        fallback = http_reward(srv.url("garbage"), retries=0, on_failure=-1.0)
        res, d = _score_all(fallback, [_ep(0)])
        assert res == [-1.0] and d.counts["fallbacks"] == 1 and d.counts["failed"] == 0
        assert "returned str" in d.last_error and d.counts["item_errors"] == 1


def test_http_backend_times_out():
    with FunctionServer({"sleepy": sleepy}) as srv:
        reward = http_reward(srv.url("sleepy"), timeout=0.3, retries=1, backoff=0.01)
        res, d = _score_all(reward, [_ep(0)])
        assert isinstance(res[0], RewardFailed) and "timeout=0.3" in str(res[0])
        assert d.counts["timeouts"] == 2


def test_unreachable_endpoint_fails_cleanly():
    reward = http_reward("http://127.0.0.1:9/none", timeout=1, retries=1, backoff=0.01)
    res, d = _score_all(reward, [_ep(0)])
    assert isinstance(res[0], RewardFailed) and d.counts["errors"] == 2


def test_cancelled_wait_does_not_cancel_the_batch():
    fn = Counting()
    with FunctionServer({"count": fn}) as srv:
        reward = http_reward(srv.url("count"), max_batch=4, batch_wait=0.05)

        async def go():
            d = RewardDispatcher(reward)
            tasks = [asyncio.ensure_future(d.score(_ep(i))) for i in range(4)]
            await asyncio.sleep(0)
            tasks[0].cancel()  # a redundant trajectory goes away while it waits
            return await asyncio.gather(*tasks[1:]), d

        res, d = asyncio.run(go())
        assert res == [1.0, 2.0, 3.0] and sum(fn.sizes) <= 4


def test_dispatchers_sum_figures():
    with FunctionServer({"len": plain_len}) as srv:
        ds = Dispatchers()
        reward = http_reward(srv.url("len"))

        async def go():
            return await asyncio.gather(*(ds.get(reward).score(_ep(i)) for i in range(3)))

        assert asyncio.run(go()) == [1.0, 2.0, 3.0]
        s = ds.stats()
        assert s["reward/requests"] == 3 and s["reward/done"] == 3
        assert s["reward/latency_p50"] > 0 and s["reward/failed"] == 0


# -- the LLM judge ----------------------------------------------------------------------
def test_llm_judge_batches_and_matches_single_calls(tiny_model):
    judge = LLMJudge(tiny_model)
    eps = [_ep(i, success=i % 2 == 0) for i in range(5)]
    batched = judge.batch(eps)
    single = [judge(e) for e in eps]
    assert batched == pytest.approx(single, abs=1e-5)
    assert all(0.0 < v < 1.0 for v in batched) and len(set(round(v, 6) for v in batched)) > 1
    with pytest.raises(ValueError, match="not a token"):
        LLMJudge(tiny_model, yes="zebra").batch(eps)


def test_llm_judge_over_http_with_batching(tiny_model):
    judge = LLMJudge(tiny_model)
    eps = [_ep(i) for i in range(6)]
    with FunctionServer({"judge": judge}) as srv:
        reward = http_reward(srv.url("judge"), max_batch=6, batch_wait=0.05, timeout=20)
        res, d = _score_all(reward, eps)
        assert res == pytest.approx(judge.batch(eps), abs=1e-5)
        assert srv.stats["requests"] == 1 and srv.stats["items"] == 6
