"""Bucket-by-bucket loading: a bucketed version read through ``iter_buckets`` is the
published state dict byte for byte; a reader racing the publisher sees whole versions
only; an engine loads a version bucket by bucket holding about two buckets (not a
model copy), never generates from a mix of two versions, and an inference worker
streams a trainer gang's version while it serves."""

import asyncio
import threading
import time
import tracemalloc

import pytest
import torch

from rollart.rollout import InferenceWorker, TorchEngine
from rollart.types import GenRequest
from rollart.weights import WeightStore
from rollart.weights.store import UnreadableWeightsError
from stores import backend_store  # tests/weights/


@pytest.fixture(params=["fsspec", "mooncake"])
def store(request, tmp_path):
    return backend_store(request, tmp_path, "buckets", segment_mb=128)



@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """A tiny model large enough that a bucket is small next to it (~30 MB)."""
    from rollart.model import build_tiny_model

    corpus = ["gridnav : goal 3 right 1 up ; act ? left down , stop ."]
    return build_tiny_model(tmp_path_factory.mktemp("big") / "m", corpus,
                            hidden_size=256, num_layers=8)


def publish(store, version: int, sd: dict, buckets: int) -> list[str]:
    """``sd`` as ``buckets`` buckets in order, then the manifest (a trainer gang's way)."""
    keys = list(sd)
    per = -(-len(keys) // buckets)
    names = [store.put_bucket(version, k, {x: sd[x] for x in keys[k * per:(k + 1) * per]})[0]
             for k in range(buckets) if keys[k * per:(k + 1) * per]]
    store.put_manifest(version, names)
    return names


def shifted(sd: dict, by: float) -> dict:
    return {k: v + by for k, v in sd.items()}


def test_buckets_reassemble_the_state_dict_byte_for_byte(store, model_dir):
    sd = shifted(TorchEngine(model_dir).state_dict(), 0.25)
    names = publish(store, 1, sd, buckets=5)
    got, seen = {}, []
    with store.iter_buckets(1, ahead=1) as stream:
        assert stream.names == names and stream.metadata == {}
        for name, part in stream:
            seen.append(name)
            assert not set(part) & set(got)  # each tensor in one bucket
            got.update(part)
    assert seen == names and set(got) == set(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert got[k].numpy().tobytes() == v.numpy().tobytes(), k
    assert store.transfer["origin_bytes"] >= sum(v.numel() * 4 for v in sd.values())
    store.put(2, sd)  # one blob: one bucket
    with store.iter_buckets(2) as stream:
        assert stream.names == [] and len(list(stream)) == 1
    with pytest.raises(KeyError, match="version 9"):
        store.iter_buckets(9)
    store.put_manifest(3, names[:1] + [store._bucket_name(3, 7)])  # a bucket never written
    with pytest.raises(UnreadableWeightsError, match="missing"):
        list(store.iter_buckets(3))
    with pytest.raises(ValueError, match="ahead"):
        store.iter_buckets(1, ahead=0)


def test_a_reader_racing_the_publisher_sees_old_or_new_never_a_mix(store):
    """Every tensor of version v is v: a reader that streams whatever is latest while
    the publisher writes buckets and manifests and collects old versions sees one
    value per read."""
    keys = [f"w{i}" for i in range(8)]
    stop, errors, reads = threading.Event(), [], []

    def publisher():
        try:
            for v in range(1, 21):
                publish(store, v, {k: torch.full((256, 256), float(v)) for k in keys}, 4)
                store.gc(keep=2)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            stop.set()

    t = threading.Thread(target=publisher)
    t.start()
    while not stop.is_set() or not reads:
        v = store.latest()
        if v < 1:
            continue
        store.hold("racer", v)
        try:
            with store.iter_buckets(v) as stream:
                values = {float(f(x)) for _, part in stream for x in part.values()
                          for f in (torch.min, torch.max)}
        except KeyError:  # collected between latest() and the hold: a newer one exists
            continue
        finally:
            store.release("racer")
        reads.append((v, values))
    t.join()
    assert not errors, errors
    assert all(values == {float(v)} for v, values in reads), reads
    assert len({v for v, _ in reads}) >= 2  # the reads did race the publisher


def test_loading_bucket_by_bucket_holds_about_two_buckets_not_a_model_copy(tmp_path,
                                                                         big_model):
    """tracemalloc counts what loading allocates: the bytes read and the tensors parsed
    from them (safetensors keeps tensor data in Python bytes); the model's own
    parameters are written in place. The whole-dict path holds every bucket at once."""
    engine = TorchEngine(big_model)
    sd = shifted(engine.state_dict(), 0.5)
    model_bytes = sum(v.numel() * v.element_size() for k, v in sd.items())
    store = WeightStore(str(tmp_path / "w"))
    names = publish(store, 1, sd, buckets=16)
    bucket = max(len(store._read(n)) for n in names)
    assert bucket < model_bytes / 6

    def peak(load) -> int:
        tracemalloc.start()
        try:
            load()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    streamed = peak(lambda: (engine.request_stream(store.iter_buckets(1), 1),
                             engine.apply_pending_update()))
    assert engine.version == 1
    now = engine.state_dict()
    assert all(torch.equal(now[k], sd[k]) for k in sd if k != "lm_head.weight")
    whole = peak(lambda: engine.load_state_dict(store.get(1), 2))
    # streaming: the bucket being copied, the one read ahead, and a parse's transient
    # copy of one; the whole dict: every bucket's bytes and tensors at once
    assert streamed < 4 * bucket, (streamed, bucket, model_bytes)
    assert streamed < model_bytes / 2, (streamed, model_bytes)
    assert whole > model_bytes, (whole, model_bytes)


class Failing:
    """A bucket stream whose bucket ``at`` cannot be read (its relay and the origin
    failed)."""

    def __init__(self, store, version, at):
        self.inner, self.at, self.closed = store.iter_buckets(version), at, False

    def __iter__(self):
        for i, item in enumerate(self.inner):
            if i == self.at:
                raise UnreadableWeightsError("bucket unreadable (test)")
            yield item

    def close(self):
        self.closed = True
        self.inner.close()


def test_a_stream_failing_half_way_never_lets_a_mix_generate(tmp_path, model_dir):
    engine = TorchEngine(model_dir)
    v0 = engine.state_dict()
    store = WeightStore(str(tmp_path / "w"))
    new = shifted(v0, 0.3)
    publish(store, 1, new, buckets=4)
    # failing before any bucket was copied: the old weights stay, generation goes on
    early = Failing(store, 1, at=0)
    engine.request_stream(early, 1)
    with pytest.raises(UnreadableWeightsError):
        engine.apply_pending_update()
    assert early.closed and engine.mixed is None and engine.version == 0
    # failing after two buckets: a mix; generation waits until a whole version arrives
    late = Failing(store, 1, at=2)
    engine.request_stream(late, 1)
    out = {}

    def generate():
        out["r"] = engine.generate([GenRequest([3, 4, 5], max_new_tokens=4)])[0]

    t = threading.Thread(target=generate)
    t.start()
    deadline = time.monotonic() + 60
    while engine.mixed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.mixed is not None and engine.mixed[0] == 1 and late.closed
    time.sleep(0.5)
    assert t.is_alive() and "r" not in out  # not generating from the mix
    engine.request_stream(store.iter_buckets(1), 1)  # the worker reads it again
    t.join(60)
    assert not t.is_alive() and out["r"].versions == [1] * 4
    assert engine.mixed is None
    now = engine.state_dict()
    assert all(torch.equal(now[k], new[k]) for k in new if k != "lm_head.weight")
    # a mix and the engine closing meanwhile: the wait ends with an error naming it
    engine.request_stream(Failing(store, 1, at=1), 2)
    closing = threading.Timer(0.5, engine.cancel_updates)
    closing.start()
    with pytest.raises(RuntimeError, match="mix of two versions"):
        engine.apply_pending_update()
    closing.join()
    # closing drops a staged stream: its reader stops (and its hold is released)
    staged = Failing(store, 1, at=9)
    engine.request_stream(staged, 3)
    engine.cancel_updates()
    assert staged.closed and engine.pending_version is None


def test_lora_engines_take_whole_versions(model_dir):
    engine = TorchEngine(model_dir, lora={"r": 4, "lora_alpha": 8,
                                          "target_modules": "all-linear"})
    with pytest.raises(TypeError, match="whole state dict"):
        engine.request_stream(iter([]), 1)


def test_a_worker_streams_a_gang_version_while_serving(tmp_path, model_dir):
    store = WeightStore(str(tmp_path / "w"))
    base = TorchEngine(model_dir).state_dict()
    store.put(0, base)
    new = shifted(base, 0.2)

    async def scenario():
        w = InferenceWorker(model_dir, store.url, pool="H20", max_batch=4, watch=0.05)
        reqs = [asyncio.ensure_future(w.generate(GenRequest([3 + i, 4], max_new_tokens=60,
                                                            temperature=1.0, seed=i)))
                for i in range(3)]
        publish(store, 1, new, buckets=4)
        assert await w.wait_version(1, timeout=120) == 1
        results = await asyncio.gather(*reqs)
        stats = await w.stats()
        now = w.engine.state_dict()
        await w.close()
        return results, stats, now

    results, stats, now = asyncio.run(scenario())
    assert stats["streamed"] == 1 and stats["version"] == 1 and not stats["weights_mixed"]
    assert stats["weights_origin_bytes"] > 0 and stats["weights_fallbacks"] == 0
    assert all(torch.equal(now[k], new[k]) for k in new if k != "lm_head.weight")
    for r in results:  # a row's versions never go back: old tokens, then new ones
        assert r.versions == sorted(r.versions) and set(r.versions) <= {0, 1}
    assert store.holds() == {}  # the stream's close released the hold
