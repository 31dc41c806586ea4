"""InferenceWorker actors on an in-process Dask cluster, and LLMProxy routing."""

import asyncio
import time

import pytest
import torch

from rollart.rollout import InferenceWorker, LLMProxy, TorchEngine
from rollart.testing import ProxyHost, cluster_fixture, tagged_cluster
from rollart.types import GenRequest, GenResult
from rollart.weights.store import WeightStore



@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    return str(tmp_path_factory.mktemp("store") / "weights")


client = cluster_fixture("H800", scope="class")


@pytest.fixture(scope="class")
def worker(client, model_dir, store_url):
    fut = client.submit(InferenceWorker, model_dir, store_url, pool="H800", max_batch=16,
                        threads=1, actor=True, resources={"H800": 1})
    actor = fut.result()
    yield actor
    actor.close().result()


def requests(n, tokens=6):
    return [GenRequest([3 + i % 7, 4 + i % 5, 5 + i], max_new_tokens=tokens,
                       temperature=1.0, seed=100 + i) for i in range(n)]


def perturbed(engine, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in engine.state_dict().items()}


class TestInferenceWorker:
    """Class-scoped cluster: two in-process clusters alive at once confuse which client
    an Actor handle binds to (it picks the process' default client)."""

    def test_concurrent_requests_are_batched_and_match_engine(self, worker, model_dir):
        reqs = requests(8)
        before = worker.stats().result()
        futures = [worker.generate(r) for r in reqs]
        results = [f.result() for f in futures]
        after = worker.stats().result()
        assert after["batches"] - before["batches"] < len(reqs)
        assert after["requests"] - before["requests"] == len(reqs)
        engine = TorchEngine(model_dir)
        for req, res, ref in zip(reqs, results, engine.generate(reqs)):
            assert res.token_ids == ref.token_ids
            assert res.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            assert res.worker == after["address"] and res.worker.startswith("inproc://")
            assert res.versions == [0] * len(res.token_ids)


    def test_stats_fields(self, worker):
        stats = worker.stats().result()
        for key in ("address", "pool", "version", "tokens_generated", "batches", "busy_seconds",
                    "queued", "in_flight", "mean_batch_size", "decode_steps", "pending_version",
                    "suspends", "recompute_tokens", "stall_seconds", "prefetch_seconds",
                    "weight_update", "watches", "watch_seconds", "watch_cpu_seconds"):
            assert key in stats
        assert stats["pool"] == "H800" and stats["queued"] == 0 and stats["in_flight"] == 0


    def test_errors_go_to_their_caller_only(self, worker):
        good = requests(3)
        bad = [GenRequest([], 4), GenRequest([3] * 600, 4)]
        futures = [worker.generate(r) for r in [good[0], bad[0], good[1], bad[1], good[2]]]
        for i in (1, 3):
            with pytest.raises(ValueError):
                futures[i].result()
        assert all(len(futures[i].result().token_ids) == 6 for i in (0, 2, 4))
        assert len(worker.generate(good[0]).result().token_ids) == 6


    def test_update_weights(self, worker, model_dir, store_url):
        engine = TorchEngine(model_dir)
        req = GenRequest([5, 6, 7, 8], max_new_tokens=8, temperature=0.0)
        old = worker.generate(req).result()
        WeightStore(store_url).put(1, perturbed(engine))
        assert worker.update_weights(1).result() is None
        assert worker.wait_version(1, timeout=20).result() == 1  # loads with nothing pending
        new = worker.generate(req).result()
        assert new.versions == [1] * len(new.token_ids)
        assert new.token_ids != old.token_ids
        assert worker.stats().result()["version"] == 1
        worker.update_weights(7).result()  # not in the store: reported, worker keeps serving
        with pytest.raises(KeyError, match="7"):
            worker.wait_version(7, timeout=20).result()
        assert worker.generate(req).result().versions[0] == 1


# -- LLMProxy ---------------------------------------------------------------------------
@pytest.fixture(scope="class")
def two_pools(model_dir, store_url):
    tags = ("H800", "H20")
    with tagged_cluster(*tags) as c:
        actors = [c.submit(InferenceWorker, model_dir, store_url, pool=t, max_batch=8,
                           actor=True, resources={t: 1}).result() for t in tags]
        proxy = LLMProxy(list(zip(actors, tags)))
        host = c.submit(ProxyHost, proxy, actor=True, resources={"H20": 1}).result()
        yield host, actors
        for a in actors:
            a.close().result()


class TestProxyOnCluster:
    def test_proxy_sticky_pools_and_balance(self, two_pools):
        host, actors = two_pools
        addrs = {a.stats().result()["pool"]: a.stats().result()["address"] for a in actors}
        req = requests(1, tokens=3)[0]
        first = host.generate("t1", req).result().worker
        assert all(host.generate("t1", req).result().worker == first for _ in range(3))
        a, b = host.concurrent([("c1", req), ("c2", req)]).result()
        assert a.worker != b.worker
        for _ in range(2):
            assert host.generate(f"p-{_}", req, pools=("H20",)).result().worker == addrs["H20"]
        with pytest.raises(ValueError, match="A100.*available.*H20"):
            host.generate("t2", req, pools=("A100",)).result()
        stats = host.stats().result()
        assert sum(w["routed"] for w in stats["workers"]) == 8
        assert {w["pool"] for w in stats["workers"]} == {"H800", "H20"}
        host.release("t1").result()
        assert host.stats().result()["trajectories"] == 4  # c1 c2 p-0 p-1


class FakeWorker:
    """An actor-like handle whose generate waits until released."""

    def __init__(self, name):
        self.name, self.gate = name, None

    async def generate(self, req):
        await self.gate.wait()
        return GenResult([1], [0.0], [0], "length", worker=self.name)


def test_proxy_routing_least_loaded_then_round_robin():
    async def scenario():
        fakes = [FakeWorker("w0"), FakeWorker("w1"), FakeWorker("w2")]
        for f in fakes:
            f.gate = asyncio.Event()
        proxy = LLMProxy([(fakes[0], "H800"), (fakes[1], "H800"), (fakes[2], "H20")])
        req = GenRequest([1, 2, 3], 2)
        long = asyncio.ensure_future(proxy.generate("long", req, ("H800",)))
        await asyncio.sleep(0)
        assert proxy.route("a", ("H800",)) == 1  # w0 busy -> least loaded
        assert proxy.route("b") == 2  # w1 and w0 busy -> w2
        assert proxy.route("a", ("H800",)) == 1  # sticky
        assert proxy.route("c") in (0, 1, 2)
        for f in fakes:
            f.gate.set()
        assert (await long).worker == "w0"
        with pytest.raises(ValueError, match="'GPU'.*available pools: \\['H20', 'H800'\\]"):
            await proxy.generate("d", req, ("GPU",))
        return proxy.stats()

    stats = asyncio.run(scenario())
    assert [w["routed"] for w in stats["workers"]][0] >= 1


def test_proxy_pickles_without_in_flight_state():
    import pickle

    proxy = LLMProxy([("w0", "H800"), ("w1", "H20")])
    proxy.route("x")
    proxy._guard()
    copy = pickle.loads(pickle.dumps(proxy))
    assert copy.stats()["workers"][0]["in_flight"] == 0
    assert copy.route("x") == proxy.route("x")
    with pytest.raises(ValueError):
        LLMProxy([])
    with pytest.raises(ValueError, match="empty"):
        proxy.route("y", ())


def test_worker_without_dask_batches_times_out_and_closes(model_dir, tmp_path):
    async def scenario():
        w = InferenceWorker(model_dir, str(tmp_path / "w"), pool="H20", max_batch=4)
        results = await asyncio.gather(*[w.generate(r) for r in requests(6)])
        stats = await w.stats()
        with pytest.raises(TimeoutError, match=r"not loaded within .*the store .* has -1"):
            await w.wait_version(5, timeout=0.2)
        assert await w.wait_version(0) == 0
        await w.close()
        with pytest.raises(RuntimeError, match="closed"):
            await w.generate(requests(1)[0])
        return results, stats

    results, stats = asyncio.run(scenario())
    assert [len(r.token_ids) for r in results] == [6] * 6
    assert stats["requests"] == 6 and 2 <= stats["batches"] < 6 and stats["address"] == ""
    assert stats["mean_batch_size"] == pytest.approx(6 / stats["batches"])


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_update_lands_mid_batch_at_a_step_boundary(model_dir, tmp_path, mode):
    """Long concurrent generations: update_weights(1) must not wait for the batch. The
    engine options come from Policy.weight_update: "keep" re-prefills nothing."""
    from rollart.config.graph import Policy

    options = Policy(weight_update=mode).worker_options()["engine_options"]
    store = WeightStore(str(tmp_path / "w"))
    store.put(1, perturbed(TorchEngine(model_dir)))
    long = [GenRequest([3 + i, 4, 5 + i], max_new_tokens=300, temperature=1.0, seed=i)
            for i in range(4)]

    async def scenario():  # watch=None: only update_weights asks (v1 is there already)
        w = InferenceWorker(model_dir, store.url, pool="H20", max_batch=8, watch=None,
                            engine_options=options)
        tasks = [asyncio.ensure_future(w.generate(r)) for r in long]
        for _ in range(2000):  # wait until the batch is decoding
            if (await w.stats())["decode_steps"] >= 5:
                break
            await asyncio.sleep(0.005)
        await w.update_weights(1)
        assert await w.wait_version(1, timeout=20) == 1
        resolved_mid_batch = not all(t.done() for t in tasks)
        results = await asyncio.gather(*tasks)
        stats = await w.stats()
        await w.close()
        return results, stats, resolved_mid_batch

    results, stats, resolved_mid_batch = asyncio.run(scenario())
    assert resolved_mid_batch  # wait_version did not wait for the batch to end
    assert stats["batches"] == 1 and stats["suspends"] >= 1 and stats["version"] == 1
    assert stats["weight_update"] == mode
    if mode == "keep":
        assert stats["recompute_tokens"] == 0
    else:
        assert stats["recompute_tokens"] >= 4 * (3 + 5)
    assert stats["stall_seconds"] > 0 and stats["prefetch_seconds"] > 0
    for res in results:
        assert len(res.token_ids) == 300 and len(res.logprobs) == 300
        swap = res.versions.index(1)
        assert 5 <= swap < 300 and res.versions == [0] * swap + [1] * (300 - swap)


def test_worker_finds_new_versions_in_the_store_and_reports_one_it_cannot_load(model_dir,
                                                                               tmp_path):
    """Nobody calls update_weights: the worker watches the store. A corrupt version is
    reported in stats()["load_error"] (and to wait_version), the worker keeps serving
    its weights, and it goes on to the next version the trainer publishes."""
    store = WeightStore(str(tmp_path / "w"))
    engine = TorchEngine(model_dir)

    async def until(w, pred, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not pred(st := await w.stats()):
            assert time.monotonic() < deadline, st
            await asyncio.sleep(0.02)
        return st

    async def scenario():
        w = InferenceWorker(model_dir, store.url, pool="H20", watch=0.05, retry_after=0.2)
        store.put(1, perturbed(engine, seed=1))
        st = await until(w, lambda s: s["version"] == 1)
        assert st["load_error"] is None and st["prefetches"] == 1
        store.put_bytes(2, b"not a safetensors file")  # corrupt: the trainer died mid-write
        st = await until(w, lambda s: s["load_error"] is not None)
        assert st["version"] == 1 and "v2: UnreadableWeightsError" in st["load_error"]
        with pytest.raises(Exception, match="unreadable"):
            await w.wait_version(2, timeout=5)
        assert len((await w.generate(requests(1)[0])).token_ids) == 6  # still serving
        store.put(3, perturbed(engine, seed=3))
        st = await until(w, lambda s: s["version"] == 3)
        # each of the three versions was found by a look, each look timed
        assert st["watches"] >= 3 and st["watch_seconds"] > 0, st
        await w.close()
        # without a watch, one who waits for a version makes the worker look for it
        lazy = InferenceWorker(model_dir, store.url, pool="H20", watch=None)
        assert (await lazy.stats())["watches"] == 0
        assert await lazy.wait_version(3, timeout=30) == 3
        assert (await lazy.stats())["watches"] >= 1
        await lazy.close()
        return st

    assert asyncio.run(scenario())["prefetches"] == 2


def test_the_watch_looks_at_its_interval_however_many_requests_come(model_dir, tmp_path):
    """However many requests are submitted, the watch reads the store once per ``watch``
    seconds (it once read it at each wake-up, and every request woke the prefetch
    thread: as many store reads as requests, on Mooncake each a master round trip and a
    read from the trainer's segment; the prefetch has its own condition now)."""
    store = WeightStore(str(tmp_path / "w"))

    async def scenario():
        w = InferenceWorker(model_dir, store.url, pool="H20", watch=0.2)
        t0, sent = time.monotonic(), 0
        while time.monotonic() - t0 < 1.5 or (await w.stats())["watches"] < 2:
            assert time.monotonic() - t0 < 60, "the watch did not look twice in 60 s"
            await asyncio.gather(*(w.generate(r) for r in requests(4, tokens=2)))
            sent += 4
        st = await w.stats()
        elapsed = time.monotonic() - t0
        await w.close()
        return st, sent, elapsed

    st, sent, elapsed = asyncio.run(scenario())
    # at most one look per 0.2 s (and the first at once), far fewer than the requests
    assert 2 <= st["watches"] <= elapsed / 0.2 + 2 < sent, (st["watches"], sent, elapsed)


def test_abort_frees_the_row_and_short_requests_do_not_wait_for_long_ones(model_dir, tmp_path):
    """Continuous batching on the actor: a short request joining a long batch returns
    while the long ones still decode; an aborted request (queued or generating) returns
    an empty ``abort`` result at once and frees its row."""
    long = [GenRequest([3 + i, 4, 5], max_new_tokens=400, temperature=1.0, seed=i,
                       request_id=f"long/{i}") for i in range(3)]

    async def scenario():
        w = InferenceWorker(model_dir, str(tmp_path / "w"), pool="H20", max_batch=3)
        tasks = [asyncio.ensure_future(w.generate(r)) for r in long]
        for _ in range(2000):  # wait until the long batch is decoding
            if (await w.stats())["decode_steps"] >= 3:
                break
            await asyncio.sleep(0.005)
        queued = asyncio.ensure_future(w.generate(
            GenRequest([9, 9], 5, 1.0, seed=7, request_id="queued")))
        await asyncio.sleep(0.05)
        assert await w.abort("queued")  # batch full: it was still waiting
        assert (await queued).finish_reason == "abort"
        assert await w.abort("long/1")  # generating: its row leaves at the next boundary
        aborted = await tasks[1]
        short = await w.generate(GenRequest([7, 8], 4, 1.0, seed=8))  # takes the free row
        still_running = not tasks[0].done() and not tasks[2].done()
        assert not await w.abort("long/1") and not await w.abort("nobody")
        rest = await asyncio.gather(tasks[0], tasks[2])
        stats = await w.stats()
        await w.close()
        return aborted, short, still_running, rest, stats

    aborted, short, still_running, rest, stats = asyncio.run(scenario())
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    assert len(short.token_ids) == 4 and still_running
    assert [len(r.token_ids) for r in rest] == [400, 400]
    assert stats["abandoned"] == 2 and stats["in_flight"] == 0 and stats["queued"] == 0
