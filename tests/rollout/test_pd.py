"""PD disaggregation: KV handoffs, exact equivalence with colocated decoding, prefix reuse,
the KV moved worker to worker over Dask's TCP comms, and Dask ``sizeof`` for tensors."""

import pickle

import pytest
import torch
from dask.sizeof import sizeof

from rollart.policy.affinity import Affinity
from rollart.rollout import InferenceWorker, LLMProxy, TorchEngine
from rollart.rollout import pd
from rollart.rollout.pd import KVHandoff, PrefixCache, pack, plan_prefill
from rollart.testing import ProxyHost, tagged_cluster
from rollart.types import H20, H800, GenRequest


def greedy(lengths, new=10, key=None):
    return [GenRequest([3 + (i * 5 + j) % 17 for j in range(n)], max_new_tokens=new,
                       temperature=0.0, cache_key=key and f"{key}{i}")
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def engines(model_dir):
    return TorchEngine(model_dir, prefix_cache=0), TorchEngine(model_dir, prefix_cache=0)


@pytest.mark.parametrize("lengths", [(7,), (7, 3, 5, 1)])
def test_pd_decode_equals_colocated_exactly(engines, lengths):
    a, b = engines
    reqs = greedy(lengths)
    colocated = a.generate(reqs)
    handoffs = pickle.loads(pickle.dumps(a.prefill(reqs), protocol=5))  # another process
    assert [h.tokens for h in handoffs] == list(lengths)
    disaggregated = b.decode(reqs, handoffs)
    for c, d in zip(colocated, disaggregated):
        assert c.token_ids == d.token_ids and len(c.token_ids) == 10
        assert c.logprobs == d.logprobs  # bit for bit, not approximately
        assert c.finish_reason == d.finish_reason


def test_handoff_from_other_weights_is_recomputed(engines, model_dir):
    a, _ = engines
    b = TorchEngine(model_dir, version=3, prefix_cache=0)
    reqs = greedy((4, 6))
    out = b.decode(reqs, a.prefill(reqs))  # made under version 0: re-prefilled here
    assert b.recompute_tokens == 10
    assert [r.token_ids for r in out] == [r.token_ids for r in b.generate(reqs)]
    assert all(v == [3] * 10 for v in (r.versions for r in out))


def test_prefix_cache_reuses_a_trajectorys_context(model_dir):
    eng, ref = TorchEngine(model_dir), TorchEngine(model_dir, prefix_cache=0)
    first = greedy((5, 4), new=6, key="t")
    out1 = eng.generate(first)
    second = [GenRequest(r.prompt_ids + o.token_ids + [7, 8], 6, temperature=0.0,
                         cache_key=r.cache_key) for r, o in zip(first, out1)]
    second.append(GenRequest([9, 10, 11], 6, temperature=0.0, cache_key="new"))
    out2, want = eng.generate(second), ref.generate(second)
    pc = eng.prefix_cache
    # turn 1: nothing cached; turn 2: both prompts + 5 of 6 generated tokens reused
    assert pc.hits == 2 and pc.hit_tokens == (5 + 5) + (4 + 5)
    assert pc.prompt_tokens == 9 + sum(len(r.prompt_ids) for r in second)
    for got, exp in zip(out2, want):
        assert got.token_ids == exp.token_ids
        assert max(abs(x - y) for x, y in zip(got.logprobs, exp.logprobs)) < 1e-4
    eng.load_state_dict(eng.state_dict(), version=1)  # new weights: old KV is stale
    eng.generate([GenRequest(second[0].prompt_ids + [5], 2, temperature=0.0,
                             cache_key=second[0].cache_key)])
    assert pc.hits == 2


def _cost(chunks, lengths, call):
    return sum(call + len(c) * max(lengths[i] for i in c) for c in chunks)


def _cuts(n):
    """Every way to cut ``range(n)`` into contiguous runs."""
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in _cuts(n - first):
            yield [list(range(first))] + [[first + i for i in c] for c in rest]


@pytest.mark.parametrize("seed", range(6))
def test_prefill_plan_is_the_cheapest_cut_of_the_sorted_rows(seed):
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([1, 3, 12, 20, 40, 245, 250]) for _ in range(rng.randint(1, 8))]
    chunks = plan_prefill(lengths, call_tokens=32)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cheapest = min(_cost([[order[i] for i in c] for c in cut], lengths, 32)
                   for cut in _cuts(len(lengths)))
    assert _cost(chunks, lengths, 32) == cheapest


def test_prefill_plan_sends_a_long_prompt_alone():
    lengths = [12, 9, 245, 11, 10, 14, 8, 13]  # one first turn among follow-up turns
    assert sorted(map(sorted, plan_prefill(lengths, 32))) == [[0, 1, 3, 4, 5, 6, 7], [2]]
    assert plan_prefill([10] * 6, 32) == [[0, 1, 2, 3, 4, 5]]
    assert len(plan_prefill(lengths, 10_000)) == 1  # calls dearer than any padding
    assert plan_prefill([], 32) == []


@pytest.mark.parametrize("lean", [True, False])
def test_prefill_shares_equal_prompts_and_splits_by_length(model_dir, lean):
    """Every row of one batched prefill (equal first-turn prompts, cached prefixes, one
    long prompt) continues exactly as if it had been prefilled alone: same next-token
    logits and same KV at its real columns. Equal prompts are forwarded once."""
    eng = TorchEngine(model_dir, lean=lean)
    assert (eng.lean is not None) == lean
    first = greedy((3, 4), new=3, key="t")
    out = eng.generate(first)  # their KV is cached for the next turn
    group = [3, 5, 7, 9, 11]  # a group's members: one prompt
    reqs = [GenRequest(r.prompt_ids + o.token_ids + [8, 9], 4, cache_key=r.cache_key)
            for r, o in zip(first, out)]
    reqs += [GenRequest(list(group), 4, cache_key=f"g{i}") for i in range(3)]
    reqs += [GenRequest([3 + i % 15 for i in range(40)], 4, cache_key="long")]
    hits = [eng.prefix_cache.lookup(r, eng.version) for r in reqs]
    assert [h is not None for h in hits] == [True, True, False, False, False, False]
    before = (eng.prefill_tokens, eng.prefill_padded, eng.prefill_shared)
    logits, mask, next_pos, cache = pd.prefill(eng, [r.prompt_ids for r in reqs], hits)
    assert eng.prefill_shared - before[2] == 2
    # a cached row forwards its last generated token (not in its cache) and [8, 9]
    assert eng.prefill_tokens - before[0] == 3 + 3 + 5 + 40
    padded = eng.prefill_padded - before[1]
    assert padded < 4 * 40  # the 40-token prompt did not pad the short rows to its length
    for i, req in enumerate(reqs):
        want_logits, want_mask, want_pos, want_cache = pd.prefill(eng, [req.prompt_ids])
        torch.testing.assert_close(logits[i], want_logits[0], rtol=1e-5, atol=1e-5)
        assert int(next_pos[i]) == int(want_pos[0]) == len(req.prompt_ids)
        cols = mask[i].bool()
        assert int(cols.sum()) == len(req.prompt_ids)
        for got, want in zip(pd.cache_layers(cache), pd.cache_layers(want_cache)):
            torch.testing.assert_close(got[0][i][:, cols], want[0][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[1][i][:, cols], want[1][0], rtol=1e-5, atol=1e-5)


def test_a_group_sharing_its_prefill_samples_as_if_alone(model_dir):
    """A group's members (one prompt, their own seeds) share one prefill forward and
    still draw their own samples: the tokens and log-probs of each equal its
    generation alone."""
    eng, alone = TorchEngine(model_dir), TorchEngine(model_dir)
    group = [GenRequest([4, 6, 8, 10, 12, 5], 8, temperature=1.0, seed=100 + i,
                        cache_key=f"m{i}") for i in range(6)]
    together = eng.generate(group)
    assert eng.prefill_shared == 5
    for req, got in zip(group, together):
        want = alone.generate([req])[0]
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert len({tuple(r.token_ids) for r in together}) > 1  # their own samples


def test_a_failed_prefill_reaches_the_rows_it_was_for(model_dir):
    """An error in the prefill of rows joining the batch is delivered to those rows
    (their callers would otherwise wait for a result that never comes)."""
    eng = TorchEngine(model_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("prefill exploded")

    eng._forward = broken
    with pytest.raises(RuntimeError, match="prefill exploded"):
        eng.generate(greedy((3, 5)))


@pytest.mark.parametrize("lean", [True, False])
def test_rows_kv_is_each_rows_live_columns_in_its_own_memory(model_dir, lean):
    """Gathered for several rows at once (a mask with holes mid-row, as prefix reuse
    leaves), each row's KV equals its masked columns, contiguous and unshared."""
    eng = TorchEngine(model_dir, lean=lean)
    cache = eng._new_cache()
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        cache.update(torch.randn(4, 4, 6, 16, generator=g),
                     torch.randn(4, 4, 6, 16, generator=g), layer)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1], [1] * 6, [0, 1, 0, 1, 0, 1]])
    rows = [3, 1, 2]
    kvs = pd.rows_kv(cache, rows, mask)
    for j, kv in zip(rows, kvs):
        cols = mask[j].bool()
        want = torch.stack([torch.stack([k[j][:, cols], v[j][:, cols]])
                            for k, v in pd.cache_layers(cache)])
        assert torch.equal(kv, want) and kv.is_contiguous()
        assert kv.untyped_storage().nbytes() == kv.numel() * kv.element_size()


def test_prefix_cache_is_bounded_and_checks_tokens():
    pc = PrefixCache(max_entries=2)
    kv = torch.zeros(1, 2, 1, 3, 4)
    for key in "abc":
        pc.store(key, [1, 2, 3], kv, version=0)
    assert len(pc) == 2
    assert pc.lookup(GenRequest([1, 2, 3, 4], cache_key="c"), 0) is not None
    assert pc.lookup(GenRequest([1, 2, 3, 4], cache_key="a"), 0) is None  # evicted
    assert pc.lookup(GenRequest([1, 9, 3, 4], cache_key="c"), 0) is None  # other prefix
    assert pc.lookup(GenRequest([1, 2, 3], cache_key="c"), 0) is None  # nothing new
    assert pc.lookup(GenRequest([1, 2, 3, 4], cache_key="c"), 1) is None  # other weights


def test_prefix_cache_drops_older_weights_entries_at_the_first_store_under_new_ones():
    """Finished trajectories' KV of an old version is never looked up again (their keys
    are gone); it must not stay until ``max_entries`` of them pile up."""
    pc = PrefixCache(max_entries=512)
    kv = torch.zeros(1, 2, 1, 3, 4)
    for key in "abc":
        pc.store(key, [1, 2, 3], kv, version=0)
    assert len(pc) == 3
    pc.store("d", [1, 2, 3], kv, version=1)
    assert len(pc) == 1  # a, b and c were of version 0
    assert pc.lookup(GenRequest([1, 2, 3, 4], cache_key="d"), 1) is not None
    pc.store("e", [1, 2, 3], kv, version=1)
    assert len(pc) == 2  # the same weights: kept


def test_dask_sizeof_counts_tensor_and_handoff_bytes():
    t = torch.zeros(1024, 1024)
    assert sizeof(t) >= 4 * 2**20
    h = pack(torch.zeros(2, 2, 4, 64, 16), torch.zeros(300), version=0)
    assert isinstance(h, KVHandoff) and h.nbytes == 2 * 2 * 4 * 64 * 16 * 4
    assert sizeof(h) >= h.nbytes
    assert torch.equal(h.kv(), torch.zeros(2, 2, 4, 64, 16))


# -- on a cluster: the KV goes from the H800 worker to the H20 worker over tcp ---------
@pytest.fixture(scope="module")
def pd_cluster(model_dir, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store") / "w")
    with tagged_cluster(H800, H20, "CPU_ENV", protocol="tcp") as c:
        actors = {t: c.submit(InferenceWorker, model_dir, store, pool=t, max_batch=8,
                              actor=True, resources={t: 1}).result() for t in (H800, H20)}
        routes = {"pd": Affinity(prefill=H800, decode=H20), "colo": Affinity(pools=(H20,))}
        proxy = LLMProxy([(a, t) for t, a in actors.items()], routes=routes)
        host = c.submit(ProxyHost, proxy, actor=True, resources={"CPU_ENV": 1}).result()
        yield c, host, actors
        for a in actors.values():
            a.close().result()


def test_pd_over_dask_tcp_equals_colocated(pd_cluster):
    c, host, actors = pd_cluster
    addr = {t: a.stats().result()["address"] for t, a in actors.items()}
    assert all(a.startswith("tcp://") for a in addr.values())
    for i, req in enumerate(greedy((6, 2, 9), new=8)):
        pd = host.generate(f"pd-{i}", req, "pd").result()
        colo = host.generate(f"colo-{i}", req, "colo").result()
        assert pd.token_ids == colo.token_ids and pd.logprobs == colo.logprobs
        assert pd.worker == colo.worker == addr[H20]  # decode ran on the H20 worker
    prefill, decode = (actors[t].stats().result() for t in (H800, H20))
    assert prefill["kv_sent"] == 3 and prefill["kv_received"] == 0
    assert decode["kv_received"] == 3 and decode["kv_bytes_received"] > 0
    assert prefill["tokens_generated"] == 0  # the H800 worker only prefilled
    stats = host.stats().result()
    assert stats["pd_requests"] == 3 and stats["pd_kv_bytes"] == decode["kv_bytes_received"]
    # handoffs are freed once decoded (dropped asynchronously)
    for _ in range(100):
        if actors[H800].stats().result()["kv_held"] == 0 and \
                not any(k.startswith("kv-") for k in c.who_has()):
            break
        import time
        time.sleep(0.05)
    assert actors[H800].stats().result()["kv_held"] == 0


def test_pd_prefill_worker_keeps_the_trajectory_prefix(pd_cluster):
    _, host, actors = pd_cluster
    before = actors[H800].stats().result()["prefix_hit_tokens"]
    req = greedy((5,), new=4)[0]
    out = host.generate("multi", req, "pd").result()
    nxt = GenRequest(req.prompt_ids + out.token_ids + [6, 7], 4, temperature=0.0)
    host.generate("multi", nxt, "pd").result()
    after = actors[H800].stats().result()
    assert after["prefix_hit_tokens"] - before == len(req.prompt_ids)  # the turn-1 prompt
