"""The driver's one way to actors (``rollart.control.fleet.Fleet``) on a real in-process
cluster with one worker per tag: the record of the run's actors, the one lost rule,
lost-aware calls and broadcasts, the one sampler, and what is never judged lost."""

import time

import pytest
from distributed import Client

from rollart import GRPO, Graph, Policy
from rollart.control.fleet import ActorLost, Fleet
from rollart.control.stages import Actors, Stages
from rollart.control.supervisor import lose_worker
from rollart.runtime.lost import is_lost
from rollart.runtime.resources import Pool, Resources
from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN


def _resources() -> Resources:
    return Resources(pools=(Pool("h800", tag=H800, kind="compute_gpu"),
                            Pool("h20", tag=H20, kind="bandwidth_gpu"),
                            Pool("env", tag=CPU_ENV, kind="cpu_env", workers=2),
                            Pool("reward", tag=REWARD, kind="reward"),
                            Pool("trainer", tag=TRAIN, kind="trainer")),
                     processes=False, dashboard_address=":0")


@pytest.fixture
def fleet(tiny_model, tmp_path):
    graph = Graph(name="t-fleet", tasks=("gridnav",), steps=1,
                  policy=Policy(warmup_steps=0), algo=GRPO(group_size=2, groups_per_step=1))
    with _resources().make_cluster() as cluster, Client(cluster) as client:
        stages = Stages(client, graph, tiny_model, tmp_path / "run")
        yield cluster, client, Fleet(stages.start(), stages)


def test_the_record_derives_placement_and_keeps_one_trainer():
    a = Actors(None, None, [("w1", H800, "tcp://a:1"), ("w2", H20, "tcp://b:1")], [])
    a.add("trainer", "t1", TRAIN, "tcp://t:1")
    a.add("trainer", "t2", TRAIN, "tcp://t:2")  # a replacement replaces
    a.add("env", "m1", CPU_ENV, "tcp://e:1")
    assert a.trainer == "t2" and a.managers == ["m1"] and a.manager_tags == [CPU_ENV]
    assert a.placement == {"trainer": ["tcp://t:2"], "buffer": [],
                           "inference": ["tcp://a:1", "tcp://b:1"], "env": ["tcp://e:1"]}
    a.remove("inference", "w1")
    assert a.placement["inference"] == ["tcp://b:1"] and a.of("inference", H800) == []


def test_the_lost_rule():
    assert is_lost(OSError("Unable to contact Actor's worker"))
    assert is_lost(RuntimeError("Worker holding Actor was lost.  Status: cancelled"))
    assert not is_lost(TimeoutError("slow"))  # an OSError, but not a lost worker
    assert not is_lost(RuntimeError("a bug"))
    assert not is_lost(ValueError("bad"), object(), live=None)  # no view: the error alone


def test_calls_broadcasts_and_the_sample_around_a_lost_env_worker(fleet):
    cluster, client, fl = fleet
    actors = fl.actors
    assert len(actors.managers) == 2 and len(actors.workers) == 2
    s = fl.sample(latencies=True)
    assert {tag for tag, _, _ in s.workers} == {H800, H20}
    assert len(s.managers) == 2 and s.buffer["launched"] == 0
    assert [(t, v["version"]) for t, v in sorted((w["pool"], w) for w in s.worker_versions())]\
        == [(H20, -1), (H800, -1)]
    # an error of the call itself is the caller's, as raised: never ActorLost
    with pytest.raises(TypeError):
        fl.call(actors.buffer, "counts", "no such argument")
    lost, kept = actors.managers
    lose_worker(cluster, client, lost._address, restart_after=None)
    deadline = time.monotonic() + 30
    while lost._address in fl.supervisor.live():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(ActorLost, match=lost._address):
        fl.call(lost, "stats")
    answered = fl.broadcast("env", "stats")  # the lost one is left out, no error
    assert [a for a, _ in answered] == [kept]
    assert len(fl.sample().managers) == 1
    fl.supervisor.heal(force=True)  # the supervisor belongs to the fleet: it heals the record
    assert actors.managers == [kept] and lost._address not in actors.placement["env"]


def test_without_a_supervisor_nothing_is_judged_lost(fleet):
    cluster, client, fl = fleet
    bare = Fleet(fl.actors)
    mgr = fl.actors.managers[0]
    lose_worker(cluster, client, mgr._address, restart_after=None)
    deadline = time.monotonic() + 30
    while mgr._address in fl.supervisor.live():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not bare.lost(OSError("Unable to contact Actor's worker"), mgr)
    with pytest.raises(Exception) as e:
        bare.call(mgr, "stats", timeout=30)
    assert not isinstance(e.value, ActorLost)
