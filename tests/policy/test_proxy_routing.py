"""LLMProxy routing logic: task affinity, token load, prefix stickiness, auto mode."""

import asyncio
import pickle

import pytest

from rollart.policy.affinity import Affinity, classify
from rollart.rollout import LLMProxy
from rollart.types import H20, H800, GenRequest, GenResult


class Fake:
    """An actor-like worker: answers ``max_new_tokens`` tokens, optionally held back."""

    def __init__(self, name):
        self.name, self.seen, self.gate = name, [], None

    async def generate(self, req):
        self.seen.append(req)
        if self.gate is not None:
            await self.gate.wait()
        return GenResult([1] * req.max_new_tokens, [0.0] * req.max_new_tokens,
                         [0] * req.max_new_tokens, "length", worker=self.name)


def proxy_of(pools, **kw):
    fakes = [Fake(f"w{i}") for i in range(len(pools))]
    return LLMProxy(list(zip(fakes, pools)), **kw), fakes


def turns(proxy, traj, n, prompt=4, new=3, task=None):
    """Play ``n`` turns of a trajectory whose prompt grows by what it generated + 2."""
    async def play():
        ids, workers = list(range(prompt)), []
        for _ in range(n):
            res = await proxy.generate(traj, GenRequest(list(ids), new), task=task)
            workers.append(res.worker)
            ids += res.token_ids + [7, 8]
        return workers
    return asyncio.run(play())


def test_a_trajectory_sticks_to_the_worker_holding_its_prefix():
    proxy, fakes = proxy_of([H800, H800, H800])
    for t in ("a", "b", "c"):
        assert len(set(turns(proxy, t, 4))) == 1
    used = {r.cache_key for f in fakes for r in f.seen}
    assert used == {"a", "b", "c"}  # the engine keeps KV under the trajectory id
    stats = proxy.stats()
    assert stats["sticky_turns"] == 9 and stats["turns"] == 12
    # turn 2 prompt = 4 + 3 + 2 = 9 tokens of which 4 + 2 cached, etc.
    assert 0.4 < stats["expected_reuse"] < 0.9


def test_without_stickiness_turns_spread_and_nothing_is_reused():
    proxy, _ = proxy_of([H800, H800], sticky=False)
    assert turns(proxy, "a", 4) == ["w0", "w1", "w0", "w1"]
    assert proxy.stats()["expected_reuse"] == 0


def test_new_trajectories_go_to_the_fewest_queued_and_in_flight_tokens():
    async def scenario():
        proxy, fakes = proxy_of([H800, H800])
        fakes[0].gate, fakes[1].gate = asyncio.Event(), asyncio.Event()
        big = asyncio.ensure_future(proxy.generate("big", GenRequest(list(range(500)), 8)))
        await asyncio.sleep(0)
        small = [asyncio.ensure_future(proxy.generate(f"s{i}", GenRequest([1, 2], 4)))
                 for i in range(3)]
        await asyncio.sleep(0)
        load = [w["tokens"] for w in proxy.stats()["workers"]]
        assert load == [508, 18]  # three small calls beat one long prompt
        for f in fakes:
            f.gate.set()
        await asyncio.gather(big, *small)
        return proxy, fakes

    proxy, fakes = asyncio.run(scenario())
    assert [r.cache_key for r in fakes[0].seen] == ["big"]
    assert all(w["tokens"] == 0 and w["in_flight"] == 0 for w in proxy.stats()["workers"])


def test_task_affinity_pins_pools_and_is_checked():
    routes = {"decode_task": Affinity(pools=(H20,))}
    proxy, _ = proxy_of([H800, H20, H20], routes=routes)
    assert set(turns(proxy, "a", 3, task="decode_task")) <= {"w1", "w2"}
    assert {turns(proxy, f"x{i}", 1)[0] for i in range(3)} == {"w0", "w1", "w2"}
    with pytest.raises(ValueError, match="task 'pd'.*'H20'.*available pools: \\['H800'\\]"):
        proxy_of([H800], routes={"pd": Affinity(prefill=H800, decode=H20)})


def test_auto_mode_classifies_tasks_by_their_token_ratio():
    routes = {"readish": Affinity(auto=True), "talkish": Affinity(auto=True)}
    proxy, _ = proxy_of([H800, H20], routes=routes, auto_min_turns=2)
    assert proxy.classification("readish") is None
    turns(proxy, "r0", 2, prompt=120, new=2, task="readish")
    turns(proxy, "t0", 2, prompt=3, new=30, task="talkish")
    assert proxy.classification("readish") == "prefill"
    assert proxy.classification("talkish") == "decode"
    assert proxy.pools_for("readish") == (H800,) and proxy.pools_for("talkish") == (H20,)
    assert turns(proxy, "r1", 2, prompt=120, new=2, task="readish") == ["w0", "w0"]
    assert turns(proxy, "t1", 2, prompt=3, new=30, task="talkish") == ["w1", "w1"]
    tasks = proxy.stats()["tasks"]
    assert tasks["readish"]["class"] == "prefill" and tasks["talkish"]["turns"] == 4
    assert classify(10, 10) == "decode" and classify(30, 10, ratio=2) == "prefill"


def test_routes_survive_pickling():
    proxy, _ = proxy_of([H800, H20], routes={"t": Affinity(pools=(H20,))})
    copy = pickle.loads(pickle.dumps(proxy))
    assert copy.pools_for("t") == (H20,) and copy.stats()["workers"][1]["tokens"] == 0
