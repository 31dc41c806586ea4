"""``StagedUpdates`` alone: no engine, no model, no Dask. Its copy functions are plain
callables over dicts, so each rule of the pending version is checked by itself: newer
wins, older is ignored, a superseded request is merged, a failed copy is reported, a
stream that failed half-way leaves the weights ``mixed`` until a whole version came."""

import threading

import pytest

from rollart.rollout.staging import (StagedUpdates, _Stream, check_bucket, check_complete,
                                     check_state_dict)


class Weights:
    """A fake engine's weights: what was copied in, and at which version."""

    def __init__(self):
        self.values, self.version, self.copies = {}, 0, 0

    def copy_in(self, staged, version):
        if staged.get("fail"):
            raise RuntimeError("copy failed")
        self.values.update(staged)
        self.version, self.copies = version, self.copies + 1

    def copy_stream(self, stream, version):
        for name, part in stream:
            if part.get("fail"):
                raise RuntimeError(f"bucket {name} failed")
            stream.copied += 1
            self.values.update(part)
        self.version = version


class Buckets(list):
    """An iterable of buckets with ``close()``, as ``WeightStore.iter_buckets`` gives."""

    closed = False

    def close(self):
        self.closed = True


def _updates(w, **kw):
    seen = []
    u = StagedUpdates(stage=dict, copy_in=w.copy_in, copy_stream=w.copy_stream,
                      on_update=lambda v, err: seen.append((v, err)), **kw)
    return u, seen


def test_the_newest_request_wins_and_is_applied_once_reported():
    w = Weights()
    u, seen = _updates(w)
    assert u.pending_version is None and u.apply(raise_errors=True) is None
    u.request({"a": 1}, 2)
    u.request({"a": 0}, 1)  # older than pending: ignored
    u.request({"a": 3}, 3)  # newer: replaces
    assert u.pending_version == 3 and w.copies == 0  # nothing copied before apply
    assert u.apply(raise_errors=False) == 3
    assert w.values == {"a": 3} and w.version == 3 and w.copies == 1
    assert seen == [(3, None)] and u.pending_version is None and u.seconds >= 0


def test_a_superseded_request_is_merged_by_the_engines_rule():
    w = Weights()
    u, _ = _updates(w, supersede=lambda older, newer: {**older, **newer})
    u.request({"base": 1}, 1)
    u.request({"adapter": 2}, 2)
    u.apply(raise_errors=True)
    assert w.values == {"base": 1, "adapter": 2} and w.version == 2


def test_the_stage_function_checks_on_the_callers_thread():
    def stage(sd):
        return check_state_dict(sd, {"w": (2,)}, tied=False)

    u = StagedUpdates(stage=stage, copy_in=lambda staged, v: None)
    with pytest.raises(KeyError, match="missing"):
        u.request({"x": [0, 0]}, 1)
    assert u.pending_version is None


def test_a_failed_copy_is_reported_and_the_old_version_kept():
    w = Weights()
    u, seen = _updates(w)
    u.request({"fail": True}, 4)
    assert u.apply(raise_errors=False) is None
    assert w.version == 0 and u.error[0] == 4 and seen[0][0] == 4
    assert isinstance(seen[0][1], RuntimeError) and u.mixed is None
    u.request({"fail": True}, 5)
    with pytest.raises(RuntimeError, match="copy failed"):
        u.apply(raise_errors=True)


def test_load_now_drops_a_pending_version_not_newer():
    w = Weights()
    u, _ = _updates(w)
    u.request({"a": 1}, 3)
    u.load_now({"a": 5}, 5)
    assert w.version == 5 and u.pending_version is None
    u.request({"a": 7}, 7)
    u.load_now({"a": 6}, 6)
    assert u.pending_version == 7  # newer than what was loaded: kept


def test_a_stream_is_copied_bucket_by_bucket_and_a_replaced_one_closed():
    w = Weights()
    u, seen = _updates(w)
    first = Buckets([("b0", {"a": 1})])
    u.request_stream(first, 1)
    second = Buckets([("b0", {"a": 2}), ("b1", {"b": 2})])
    u.request_stream(second, 2)
    assert first.closed and not second.closed
    assert u.apply(raise_errors=True) == 2
    assert w.values == {"a": 2, "b": 2} and second.closed and seen == [(2, None)]


def test_a_stream_failing_half_way_waits_for_a_whole_version():
    w = Weights()
    u, seen = _updates(w)
    u.request_stream(Buckets([("b0", {"a": 1}), ("b1", {"fail": True})]), 1)
    mended = threading.Timer(0.2, u.request, ({"a": 2, "b": 2}, 2))
    mended.start()
    assert u.apply(raise_errors=False) == 2  # waited for version 2, applied it
    mended.join()
    assert u.mixed is None and w.version == 2 and [v for v, _ in seen] == [1, 2]


def test_cancel_ends_the_wait_of_mixed_weights_and_closes_a_staged_stream():
    w = Weights()
    u, _ = _updates(w)
    u.request_stream(Buckets([("b0", {"a": 1}), ("b1", {"fail": True})]), 1)
    threading.Timer(0.2, u.cancel).start()
    with pytest.raises(RuntimeError, match="mix of two versions"):
        u.apply(raise_errors=True)
    staged = Buckets([("b0", {"a": 2})])
    u.request_stream(staged, 2)
    u.cancel()
    assert staged.closed and u.pending_version is None


def test_without_a_stream_copy_a_stream_is_refused():
    u = StagedUpdates(stage=dict, copy_in=lambda staged, v: None)
    with pytest.raises(TypeError, match="bucket by bucket"):
        u.request_stream([], 1)


def test_the_stream_lets_each_bucket_go_before_the_next():
    held = []
    s = _Stream(iter([("b0", {"a": 1}), ("b1", {"b": 2})]))
    for name, part in s:
        held.append(name)
    assert held == ["b0", "b1"] and s.copied == 0


def test_bucket_checks_name_what_does_not_match():
    shapes = {"w": (2,), "lm_head.weight": (2,)}

    class T:
        shape = (2,)

    t = T()
    assert check_bucket("b0", {"w": t, "lm_head.weight": t}, shapes, tied=True) == {"w": t}
    with pytest.raises(KeyError, match="unexpected"):
        check_bucket("b1", {"x": T()}, shapes, tied=False)
    check_complete(1, {"w"}, shapes, tied=True)
    with pytest.raises(KeyError, match="lacks weights"):
        check_complete(1, {"w"}, shapes, tied=False)
