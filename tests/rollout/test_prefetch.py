"""``WeightPrefetch`` alone: a real (fsspec) ``WeightStore`` in a temp folder and a fake
engine that records what was staged; no model, no Dask. The part watches the store,
loads what is newer, stages it whole or as a stream, tells its owner (``on_staged``) and
its waiters, and reports a version that failed to load."""

import threading
import time

import pytest
import torch

from rollart.rollout.prefetch import WeightPrefetch
from rollart.weights.store import BucketStream, WeightStore


class FakeEngine:
    """What the prefetch uses of an engine: ``version``, ``mixed``, ``streams_weights``,
    ``request_update``, ``request_stream``; a staged version is applied by ``apply``."""

    def __init__(self, streams=False):
        self.version, self.mixed, self.streams_weights = 0, None, streams
        self.staged = []

    def request_update(self, state_dict, version):
        self.staged.append(("whole", version, state_dict))

    def request_stream(self, stream, version):
        self.staged.append(("stream", version, stream))


def _weights(x: float) -> dict:
    return {"w": torch.full((2, 2), x)}


def _until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def store(tmp_path):
    return WeightStore(str(tmp_path / "w"))


def test_the_watch_finds_a_new_version_and_stages_it_whole(store):
    eng, staged = FakeEngine(), threading.Event()
    p = WeightPrefetch(store.url, eng, version=0, reader="r", watch=0.05,
                       on_staged=staged.set)
    p.start()
    try:
        store.put(1, _weights(1.0))
        assert staged.wait(10)
        kind, version, sd = eng.staged[0]
        assert (kind, version) == ("whole", 1) and torch.equal(sd["w"], _weights(1.0)["w"])
        st = p.stats()
        assert st["prefetches"] == 1 and st["watches"] >= 1 and st["streamed"] == 0
        assert p.fetched == 1 and st["load_error"] is None and p.latest_seen == 1
    finally:
        p.stop()
        p.join(10)


def test_a_waiter_is_told_when_the_engine_holds_its_version(store):
    eng, told = FakeEngine(), []
    p = WeightPrefetch(store.url, eng, version=0, reader="r", watch=None)
    assert p.wait(0, told.append) == 0  # held already: no wait
    store.put(2, _weights(2.0))
    p.start()
    try:
        assert p.wait(2, told.append) is None  # looks at the store now (no watch)
        _until(lambda: eng.staged)
        assert told == []  # staged, not applied yet
        eng.version = 2
        p.applied(2, None)  # the engine's on_update
        assert told == [2]
    finally:
        p.stop()
        p.join(10)


def test_a_version_that_fails_to_load_is_reported_and_tried_again(store):
    eng, told = FakeEngine(), []
    p = WeightPrefetch(store.url, eng, version=0, reader="r", watch=None, retry_after=0.1)
    store.put_bytes(1, b"not a safetensors file")
    p.start()
    try:
        assert p.wait(1, told.append) is None
        _until(lambda: told)
        assert isinstance(told[0], Exception) and p.error_text().startswith("v1: ")
        with pytest.raises(type(told[0])):
            p.wait(1, told.append)
        store.put(2, _weights(2.0))
        p.want(2)  # a new version asked for: the error is forgotten
        _until(lambda: eng.staged)
        assert eng.staged[0][1] == 2
    finally:
        p.stop()
        p.join(10)


def test_a_failed_swap_asks_for_the_version_again_when_the_weights_are_mixed(store):
    eng = FakeEngine()
    p = WeightPrefetch(store.url, eng, version=0, reader="r", watch=None)
    p.wanted = p.fetched = 3
    eng.mixed = (3, RuntimeError("half"))
    p.applied(3, RuntimeError("half"))
    assert p.wanted == 3 and p.fetched == 0 and p.load_error[0] == 3


def test_a_bucketed_version_is_staged_as_a_stream_held_until_closed(store):
    eng = FakeEngine(streams=True)
    names = [store.put_bucket(1, k, {f"w{k}": torch.ones(2)})[0] for k in range(2)]
    store.put_manifest(1, names)
    p = WeightPrefetch(store.url, eng, version=0, reader="r", watch=None)
    p.start()
    try:
        p.want(1)
        _until(lambda: eng.staged)
        kind, version, stream = eng.staged[0]
        assert (kind, version) == ("stream", 1) and isinstance(stream, BucketStream)
        assert p.stats()["streamed"] == 1 and store.holds().get("r") == 1
        got = {k for _, part in stream for k in part}
        stream.close()  # the engine closes it once copied: the hold ends
        assert got == {"w0", "w1"} and "r" not in store.holds()
    finally:
        p.stop()
        p.join(10)


def test_closing_fails_the_waiters(store):
    told = []
    p = WeightPrefetch(store.url, FakeEngine(), version=0, reader="r", watch=None)
    p.wait(5, told.append)
    p.fail_waiters(RuntimeError("closed"))
    assert len(told) == 1 and str(told[0]) == "closed"
