"""PD disaggregation: KV handoffs, exact equivalence with colocated decoding, prefix reuse,
the KV moved worker to worker over Dask's TCP comms, and Dask ``sizeof`` for tensors."""

import pickle

import pytest
import torch
from dask.sizeof import sizeof
from distributed import Client, Scheduler, SpecCluster, Worker

from rollart.affinity import Affinity
from rollart.rollout import InferenceWorker, LLMProxy, TorchEngine
from rollart.rollout.pd import KVHandoff, PrefixCache, pack
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


def test_dask_sizeof_counts_tensor_and_handoff_bytes():
    t = torch.zeros(1024, 1024)
    assert sizeof(t) >= 4 * 2**20
    h = pack(torch.zeros(2, 2, 4, 64, 16), torch.zeros(300), version=0)
    assert isinstance(h, KVHandoff) and h.nbytes == 2 * 2 * 4 * 64 * 16 * 4
    assert sizeof(h) >= h.nbytes
    assert torch.equal(h.kv(), torch.zeros(2, 2, 4, 64, 16))


# -- on a cluster: the KV goes from the H800 worker to the H20 worker over tcp ---------
class ProxyHost:
    """Stands in for an env manager: holds an unpickled LLMProxy on a worker."""

    def __init__(self, proxy):
        self.proxy = proxy

    async def generate(self, traj_id, req, task=None):
        return await self.proxy.generate(traj_id, req, task=task)

    async def stats(self):
        return self.proxy.stats()


@pytest.fixture(scope="module")
def pd_cluster(model_dir, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store") / "w")
    tags = (H800, H20, "CPU_ENV")
    opts = {"nthreads": 1, "host": "127.0.0.1", "protocol": "tcp", "dashboard": False}
    spec = {t: {"cls": Worker, "options": {**opts, "resources": {t: 1}}} for t in tags}
    sched = {"cls": Scheduler, "options": {"host": "127.0.0.1", "protocol": "tcp",
                                           "dashboard_address": ":0"}}
    with SpecCluster(workers=spec, scheduler=sched) as cluster, Client(cluster) as c:
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
