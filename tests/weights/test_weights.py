"""The weight store: both backends behind one interface (round trip, holds, garbage
collection), a real ``mooncake_master`` on loopback (start-up, port in use, errors,
another process reading), and an inference worker that prefetches from it under load and
swaps at a decode-step boundary."""

import asyncio
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch

from rollart.rollout import InferenceWorker, TorchEngine
from rollart.types import GenRequest
from rollart.weights import FsspecWeightStore, WeightStore
from rollart.weights import mooncake as mc
from stores import LEASE_MS, backend_store, mooncake_or_skip  # tests/weights/

@pytest.fixture(params=["fsspec", "mooncake"])
def store(request, tmp_path):
    return backend_store(request, tmp_path, "test", segment_mb=64)


def weights(v: float) -> dict:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 8, generator=g) + v
    return {"emb": emb, "head": emb, "bias": torch.full((8,), v)}  # tied, like the LM


def test_round_trip_versions_and_pickle(store):
    assert store.latest() == -1 and store.versions() == []
    for v in range(3):
        store.put(v, weights(v))
    assert store.latest() == 2 and store.versions() == [0, 1, 2]
    got = store.get(1)
    assert set(got) == {"emb", "head", "bias"}
    assert torch.equal(got["emb"], weights(1)["emb"]) and torch.equal(got["head"], got["emb"])
    again = pickle.loads(pickle.dumps(store))
    assert type(again) is type(store) and again.latest() == 2
    with pytest.raises(KeyError, match="version 7"):
        store.get(7)


def test_gc_keeps_newest_and_held_versions(store):
    for v in range(5):
        store.put(v, weights(v))
    store.hold("worker-a", 1)  # worker-a is fetching version 1
    time.sleep(LEASE_MS / 1000 + 0.2)  # reads above hold Mooncake leases briefly
    assert store.gc(keep=2) == [0, 2]
    assert store.versions() == [1, 3, 4] and store.holds() == {"worker-a": 1}
    assert torch.equal(store.get(1)["bias"], weights(1)["bias"])
    store.release("worker-a")
    time.sleep(LEASE_MS / 1000 + 0.2)
    assert store.holds() == {} and store.gc(keep=2) == [1]
    assert store.versions() == [3, 4] and store.latest() == 4
    assert store.truncate(3) == [4] and store.latest() == 3 and store.versions() == [3]


def test_bucketed_versions_are_whole_or_absent(store):
    """A trainer gang's version: buckets from several publishers, then the manifest that
    makes them a version. Before it there is no version 1 (a reader racing the publish
    sees version 0); after it, the whole dict; gc takes the buckets with it; a manifest
    whose bucket is gone is unreadable and the previous version is used."""
    from rollart.weights.store import UnreadableWeightsError

    store.put(0, weights(0))
    w = weights(1)
    other = pickle.loads(pickle.dumps(store))  # another rank's handle on the same store
    names = [store.put_bucket(1, 0, {"emb": w["emb"], "head": w["head"]})[0],
             other.put_bucket(1, 1, {"bias": w["bias"]})[0]]
    assert store.latest() == 0 and store.versions() == [0]
    with pytest.raises(KeyError, match="version 1"):
        store.get(1)
    store.put_manifest(1, names, {"rollart.test": "yes"})
    got, meta = store.get(1, meta=True)
    assert meta == {"rollart.test": "yes"} and set(got) == set(w)
    assert all(torch.equal(got[k], w[k]) for k in w)
    assert store.latest() == 1 and store.versions() == [0, 1]
    store.put(2, weights(2))
    time.sleep(LEASE_MS / 1000 + 0.2)  # reads above hold Mooncake leases briefly
    assert store.gc(keep=1) == [0, 1] and store.versions() == [2]
    assert store._read(names[0]) is None and store._read(names[1]) is None
    names = [store.put_bucket(3, 0, w)[0]]
    store.put_manifest(3, names + [store._bucket_name(3, 1)])  # bucket 1 never written
    with pytest.raises(UnreadableWeightsError, match="missing"):
        store.get(3)
    assert store.get_newest_readable()[0] == 2


@pytest.mark.mooncake
def test_mooncake_version_being_read_survives_gc_until_its_lease_ends(master):
    store = WeightStore(master.url("lease", segment_mb=64, buffer_mb=32))
    for v in range(3):
        store.put(v, weights(v))
    store.get(0)  # a read leases the object for LEASE_MS
    assert store.gc(keep=1) == [1] and store.versions() == [0, 2]  # 0 is being read
    time.sleep(LEASE_MS / 1000 + 0.2)
    assert store.gc(keep=1) == [0] and store.versions() == [2]


READER = """
import sys, torch
from rollart.weights import WeightStore
store = WeightStore(sys.argv[1])
sd = store.get(store.latest())
print(store.latest(), float(sd["bias"][0]), tuple(sd["emb"].shape))
"""


@pytest.mark.mooncake
def test_mooncake_another_process_reads_what_the_trainer_published(master):
    store = WeightStore(master.url("xproc", segment_mb=64, buffer_mb=32))
    assert isinstance(store, mc.MooncakeWeightStore)
    store.put(5, weights(5.0))
    out = subprocess.run([sys.executable, "-c", READER, store.url], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "5 5.0 (50, 8)"


@pytest.mark.mooncake
def test_master_retries_when_its_port_is_taken(monkeypatch):
    mooncake_or_skip()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([port])  # the first attempt picks a port that is in use by now
    real = mc._free_port
    monkeypatch.setattr(mc, "_free_port", lambda host: next(picks, None) or real(host))
    try:
        with mc.MooncakeMaster() as m:
            assert m.rpc_port != port and m.proc.poll() is None
            store = WeightStore(m.url("retry", segment_mb=16, buffer_mb=8))
            store.put(0, weights(0))
            assert store.latest() == 0
        assert m.proc is None
    finally:
        taken.close()


@pytest.mark.mooncake
def test_stopping_the_master_closes_this_process_s_clients():
    """Their teardown needs the master: left open, a process hung 8-17 s at exit."""
    mooncake_or_skip()
    with mc.MooncakeMaster() as m:
        store = WeightStore(m.url("closing", segment_mb=16, buffer_mb=8))
        store.put(0, weights(0))
        assert store.latest() == 0
        addr = f"{m.host}:{m.rpc_port}"
        assert [k for k in mc._clients if k[0] == addr]
    assert not [k for k in mc._clients if k[0] == addr]


def test_clear_errors():
    with pytest.raises(mc.MooncakeError, match="no mooncake_master executable"):
        mc.MooncakeMaster(binary="/no/such/mooncake_master").start()
    with pytest.raises(mc.MooncakeError, match="bad Mooncake store URL"):
        WeightStore("mooncake://127.0.0.1/x")
    mooncake_or_skip()
    t0 = time.perf_counter()
    with pytest.raises(mc.MooncakeError, match="does not accept connections"):
        WeightStore("mooncake://127.0.0.1:1/x?metadata=http://127.0.0.1:2/metadata").latest()
    assert time.perf_counter() - t0 < 10
    with pytest.raises(mc.MooncakeError, match="not running"):
        mc.MooncakeMaster().url()


def test_fsspec_is_the_default_backend(tmp_path):
    assert isinstance(WeightStore(str(tmp_path)), FsspecWeightStore)
    assert isinstance(WeightStore("memory://rollart-w"), FsspecWeightStore)


def perturbed(engine, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g)
            for k, v in engine.state_dict().items()}


def test_prefetch_then_swap_under_load(store, model_dir):
    """Generation keeps running while v1 and v2 are fetched from the store; each swaps
    in at a decode-step boundary; the fetch holds its version and then releases it."""
    engine = TorchEngine(model_dir)
    store.put(0, engine.state_dict())
    long = [GenRequest([3 + i, 4, 5 + i], max_new_tokens=400, temperature=1.0, seed=i)
            for i in range(6)]

    engines = []

    def hold_until_v2(n):
        # the batch must still be decoding when v2 arrives, however slow the fetch is
        # under load: from round 300 on, the decode thread waits (<= 60 s) for v2 staged
        if n >= 300 and engines:
            eng, deadline = engines[0], time.monotonic() + 60
            while eng.version < 2 and eng.pending_version != 2 and time.monotonic() < deadline:
                time.sleep(0.002)

    async def scenario():
        w = InferenceWorker(model_dir, store.url, pool="H20", max_batch=8,
                            engine_options={"step_callback": hold_until_v2})
        engines.append(w.engine)
        tasks = [asyncio.ensure_future(w.generate(r)) for r in long]
        seen = []
        for v in (1, 2):
            # publish only once decoding is under way: put before the first await, v1 was
            # in the store before the rows were admitted, and the worker's store watch
            # could swap it in with no row live (no suspend; seen under load)
            deadline = time.monotonic() + 60  # wait until decoding advanced a bit
            while (await w.stats())["decode_steps"] < 20 * v:
                assert time.monotonic() < deadline, "decoding did not advance in 60 s"
                await asyncio.sleep(0.005)
            store.put(v, perturbed(engine, seed=v))  # the trainer publishes, no waiting
            steps_before = (await w.stats())["decode_steps"]
            await w.update_weights(v)
            assert await w.wait_version(v, timeout=60) == v
            seen.append((steps_before, await w.stats()))
        results = await asyncio.gather(*tasks)
        seen.append((None, await w.stats()))
        await w.close()
        return results, seen

    results, seen = asyncio.run(scenario())
    stats = seen[-1][1]
    assert stats["prefetches"] == 2 and stats["suspends"] == 2 and stats["batches"] == 1
    assert stats["version"] == 2 and stats["prefetch_seconds"] > 0
    assert store.holds() == {}  # the fetches released their holds
    for res in results:  # tokens carry the version that produced them: 0…, 1…, 2…
        assert len(res.token_ids) == 400
        a, b = res.versions.index(1), res.versions.index(2)
        assert 0 < a < b < 400
        assert res.versions == [0] * a + [1] * (b - a) + [2] * (400 - b)
