"""The adaptive in-flight limit (``Rollout.max_in_flight="auto"``): the controller on
synthetic signal sequences, the slots it resizes, the figures it reads, the config that
asks for it, and the simulator driving it with its simulated pace."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from rollart import GRPO, Graph, Policy, Rollout
from rollart.config.graph import GraphError
from rollart.env.tasks import get_task
from rollart.policy.admission import (Capacity, GroupSequence, Slots, StartBound,
                                      slot_capacity, take_window_for)
from rollart.policy.inflight import InflightLimit, Pace, pace_of

STARVED_ROOM = Pace(waited_s=3.0, step_s=4.0, rows=6.0, batch=64)  # trainer starves
STARVED_FULL = Pace(waited_s=3.0, step_s=4.0, rows=60.0, batch=64)  # engines full
STARVED_QUEUE = Pace(waited_s=3.0, step_s=4.0, rows=20.0, batch=64, queued=5.0)
FED = Pace(waited_s=0.0, step_s=4.0, rows=6.0, batch=64)  # the batch was ready
FED_QUEUE = Pace(waited_s=0.0, step_s=4.0, rows=64.0, batch=64, queued=9.0)
STALE = Pace(waited_s=3.0, step_s=4.0, rows=6.0, batch=64, stale_groups=2.0)


def _limit(**kw) -> InflightLimit:
    return InflightLimit.for_algo(GRPO(groups_per_step=4, alpha=kw.pop("alpha", 1)))


def _run(lim: InflightLimit, paces) -> list[int]:
    return [lim.update(p) for p in paces]


def test_grows_while_the_trainer_starves_and_the_engines_have_room():
    lim = _limit()
    assert (lim.lo, lim.hi, lim.limit) == (4, 8, 4)
    got = _run(lim, [STARVED_ROOM] * 8)
    assert got[-1] == 8 and got == sorted(got), got
    assert got[0] == 4  # one starved step alone moves nothing (hysteresis)


def test_a_starved_trainer_with_full_or_queueing_engines_grows_nothing():
    for pace in (STARVED_FULL, STARVED_QUEUE, FED):
        assert set(_run(_limit(), [pace] * 10)) == {4}, pace


def test_shrinks_at_once_on_staleness_drops_and_stays_below_the_stale_limit():
    lim = _limit(alpha=3)  # 4 .. 16 groups
    _run(lim, [STARVED_ROOM] * 20)
    assert lim.limit == 16
    assert lim.update(STALE) == 12 and "stale" in lim.why
    probe = InflightLimit.PROBE_AFTER
    got = _run(lim, [STARVED_ROOM] * (probe - 1))
    assert max(got) == 14, got  # up to one unit below the limit that went stale
    assert _run(lim, [STARVED_ROOM] * 3)[-1] == 16  # tried again after clean steps
    assert _run(lim, [STALE] * 5)[-1] == 4  # down to one step's worth, never below


def test_eases_down_when_requests_queue_while_the_trainer_is_fed():
    lim = _limit()
    _run(lim, [STARVED_ROOM] * 8)
    got = _run(lim, [FED_QUEUE] * 10)
    assert got[-1] == 4 and got == sorted(got, reverse=True), got


@pytest.mark.parametrize("pace", [STARVED_ROOM, STARVED_FULL, STARVED_QUEUE, FED,
                                  FED_QUEUE, STALE])
def test_a_steady_signal_moves_the_limit_one_way_and_then_leaves_it(pace):
    for start in (4, 6, 8):
        lim = InflightLimit(4, 8, start=start, unit=2)
        got = _run(lim, [pace] * 30)
        ups = sum(b > a for a, b in zip(got, got[1:]))
        downs = sum(b < a for a, b in zip(got, got[1:]))
        assert not (ups and downs), (pace, start, got)  # no oscillation
        assert len(set(got[-10:])) == 1, (pace, start, got)  # settled


def test_any_signal_sequence_stays_within_one_and_alpha_plus_one_steps_worth():
    rng = random.Random(0)
    for alpha in (0, 1, 2):
        lim = _limit(alpha=alpha)
        paces = [Pace(rng.uniform(0, 4), 4.0, rng.uniform(0, 64), 64,
                      rng.choice([0, 0, 3]), rng.choice([0, 0, 0, 1.5]))
                 for _ in range(500)]
        got = _run(lim, paces)
        assert min(got) >= 4 and max(got) <= 4 * (alpha + 1), (alpha, min(got), max(got))
        if alpha:
            assert len(set(got)) > 1  # it does move under a varying signal
    assert lim.update(None) == lim.limit  # nothing measured: unchanged


def test_the_limit_moves_at_most_once_a_step_and_rarely_on_an_alternating_signal():
    """A trainer starved every other step is not a steady starvation: no growth."""
    lim = _limit()
    assert set(_run(lim, [STARVED_ROOM, FED] * 10)) == {4}


def test_pace_of_reads_rows_queue_and_staleness_from_two_reads_of_the_figures():
    before = {"a": {"tokens_generated": 100, "decode_steps": 10, "busy_seconds": 1.0},
              "b": {"tokens_generated": 0, "decode_steps": 0, "busy_seconds": 0.0}}
    now = [{"address": "a", "tokens_generated": 500, "decode_steps": 60,
            "busy_seconds": 3.0, "queued": 7, "in_flight": 13},  # 4 beyond its 3 free
           {"address": "b", "tokens_generated": 0, "decode_steps": 0,
            "busy_seconds": 0.0, "queued": 2, "in_flight": 0}]  # both join at once
    trainer = {"trainer/wait_s": 0.5, "trainer/step_s": 1.0}
    p = pace_of(trainer, now, before, 4.0, {"groups_stale": 3, "aborted": 2, "dropped": 9},
                {"groups_stale": 0, "aborted": 0, "dropped": 0}, batch=16, group_size=2)
    # a: 8 rows a decode step, busy half the 4 s: 4 rows; b idle: 0 -> 2 per engine
    assert p.rows == pytest.approx(2.0) and p.queued == 2.0 and p.stale_groups == 3.0
    assert p.starved and p.queueing and not p.room and p.stale
    assert pace_of({}, now, before, 4.0, {}, {}, batch=16, group_size=2) is None
    # members aborted in flight count when the buffer dropped fewer groups; a late
    # member's "dropped" is not staleness; a re-created buffer's counts start at 0
    p = pace_of(trainer, now, before, 4.0, {"groups_stale": 1, "aborted": 6, "dropped": 9},
                {"groups_stale": 5, "aborted": 0, "dropped": 0}, batch=16, group_size=2)
    assert p.stale_groups == 3.0
    p = pace_of(trainer, now, before, 4.0, {"dropped": 9}, {}, batch=16, group_size=2)
    assert p.stale_groups == 0 and not p.stale


def test_slots_resize_shrinks_without_stopping_a_group_and_grows_at_once():
    seq = GroupSequence([get_task("gridnav")], None, seed=0, group_size=2)
    slots = Slots(4, seq)
    held = [slots.take("m").group_id for _ in range(4)]
    slots.resize(2)
    assert slots.take("m") is None and sorted(slots.held) == held  # none cancelled
    slots.release(held[0]), slots.release(held[1])
    assert slots.take("m") is None  # still 2 held: at the new limit
    slots.release(held[2])
    assert slots.take("m") is not None and slots.take("m") is None
    slots.resize(5)
    assert [slots.take("m") is not None for _ in range(4)] == [True, True, True, False]
    assert slots.stats()["slots_capacity"] == 5
    with pytest.raises(ValueError, match="at least one group"):
        slots.resize(0)


def test_both_admissions_take_a_new_limit():
    assert Capacity(3).resized(5).room(held=4, started=9, version=0) == 1
    bound = StartBound(alpha=1, groups_per_step=2, limit=4).resized(1)
    assert bound.room(held=1, started=1, version=0) == 0  # the limit, not the bound


def test_auto_is_the_only_word_max_in_flight_takes():
    assert Rollout(max_in_flight="auto").max_in_flight == "auto"
    for bad in ("Auto", "adaptive", "2"):
        with pytest.raises(GraphError, match=r"max_in_flight.*\"auto\""):
            Rollout(max_in_flight=bad)
    assert Rollout().max_in_flight is None  # unset: the mode decides (Graph.max_in_flight)


def test_the_mode_decides_an_unset_limit_and_stale_members():
    """Unset, async adapts its limit and re-scores stale members (its default); areal
    keeps AReaL's start bound alone and its members; the lockstep modes abort none; the
    vLLM engine cannot re-score, so async there aborts. A set value is kept in every
    mode, and an impossible one is refused."""
    assert (Graph("g").max_in_flight, Graph("g").stale_members) == ("auto", "rescore")
    for mode in ("areal", "sync+", "sync", "one-off"):
        g = Graph("g", mode=mode)
        assert (g.max_in_flight, g.stale_members) == (None, "abort"), mode
    vllm = Graph("g", policy=Policy(engine="vllm"))
    assert (vllm.max_in_flight, vllm.stale_members) == ("auto", "abort")
    fixed = Graph("g", rollout=Rollout(max_in_flight=1.0, stale_members="abort"))
    assert (fixed.max_in_flight, fixed.stale_members) == (1.0, "abort")
    assert Graph("g", mode="areal", rollout=Rollout(max_in_flight="auto")).max_in_flight \
        == "auto"
    # a graph's mode changed afterwards (as --mode does) takes the new mode's own
    assert replace(Graph("g"), mode="areal").stale_members == "abort"
    with pytest.raises(GraphError, match="mode='async' only"):
        Graph("g", mode="areal", rollout=Rollout(stale_members="rescore"))
    with pytest.raises(GraphError, match="stale_members must be one of"):
        Rollout(stale_members="keep")


def test_auto_takes_in_start_order_unless_a_window_is_set():
    algo = GRPO(groups_per_step=4, alpha=2)
    graph = lambda **kw: Graph("g", algo=algo, rollout=Rollout(**kw))  # noqa: E731
    assert take_window_for(graph(max_in_flight="auto")) == 4
    assert take_window_for(graph()) == 4  # unset in async: "auto"
    assert take_window_for(graph(max_in_flight="auto", take_window=2)) == 8
    assert take_window_for(graph(max_in_flight=2)) is None
    assert take_window_for(replace(graph(), mode="areal")) is None
    assert slot_capacity(algo, "auto") == 8  # starts at max(alpha, 1) steps' worth


def test_the_simulator_adapts_with_the_same_rule():
    """A trainer much faster than rollout and engines with room: the simulated run's
    limit grows from one step's worth to alpha + 1 steps' worth, and stays there; no
    trained trajectory is older than alpha."""
    from rollart.sim import ClusterSpec, EnvPool, GPUPool, RewardPool, SimConfig, simulate
    from rollart.sim.costs import MODELS, Costs, EnvCost, TrainCost, WeightSync
    from rollart.chaos.faults import Latency
    from rollart.testing import tiny_graph
    from rollart.types import H20

    costs = Costs(model=MODELS["Qwen3-8B"], env={"*": EnvCost(
        "fixed", reset=Latency("fixed", 1.0), step=Latency("fixed", 0.5))})
    costs = costs.with_(train=TrainCost(costs.model, costs.gpus["H800"], 10 ** 6,
                                        overhead_s=0.0),
                        weights=WeightSync(latency_s=0.0, rdma_bytes_s=1e15))
    cluster = ClusterSpec((GPUPool(H20, "H20", 1),), (EnvPool("CPU_ENV", 64),),
                          RewardPool(), trainer_gpus=8)
    g = tiny_graph("sim", steps=12, groups=4, size=2, max_in_flight="auto",
                   inference_pools=("H20",))
    g = replace(g, algo=replace(g.algo, alpha=1))
    r = simulate(SimConfig(cluster, g, costs, steps=12))
    limits = r.extra["inflight_limits"]
    assert len(limits) == 12 and min(limits) >= 4 and max(limits) <= 8, limits
    assert limits[-1] == 8 and limits == sorted(limits), limits
    assert max(r.staleness) <= 1


def test_a_resumed_limit_goes_on_from_the_checkpoints_within_the_bounds():
    lim = _limit()
    lim.resume(6)
    assert lim.limit == 6 and _run(lim, [STARVED_ROOM] * 2)[-1] == 8
    lim.resume(100)
    assert lim.limit == 8  # a checkpoint of another graph's bounds is clamped


def test_a_run_of_stale_steps_caps_growth_below_the_limit_that_went_stale_only():
    """The groups lost in the steps right after a shrink started under the limit before
    it: they do not lower the cap to the shrunk limit."""
    lim = _limit(alpha=3)
    _run(lim, [STARVED_ROOM] * 20)
    assert _run(lim, [STALE] * 2) == [12, 8]
    got = _run(lim, [STARVED_ROOM] * (InflightLimit.PROBE_AFTER - 1))
    assert max(got) == 14 and got[-1] == 14, got  # not capped at 10 by the second


def _staleness_of_takes(admission, capacity: int, gps: int = 2, steps: int = 8):
    """Rollout that completes at once, a trainer that takes ``gps`` groups a step in
    start order: each taken group's versions behind the trainer (the take frees slots
    before the step's update is published, as the buffer's take does), and the groups
    held after each fill."""
    slots = Slots(capacity, GroupSequence([get_task("gridnav")], None, 0, 2), admission)
    started, ages, held, training = {}, [], [], 0

    def fill():
        while (w := slots.take("m", training=training)) is not None:
            started[w.group_id] = slots.version
        held.append(len(slots.held))

    fill()
    for _ in range(steps):
        batch = sorted(slots.held, key=lambda g: int(g[1:]))[:gps]
        ages += [slots.version - started[g] for g in batch]
        for g in batch:
            slots.release(g)
        training = len(batch)
        fill()  # groups start while the step trains, on the version before its update
        slots.published(training)
        training = 0
        fill()
    return ages, held


def test_auto_admits_by_the_start_bound_so_a_grown_limit_goes_stale_no_more():
    """alpha 1, one and a half steps' worth: a fixed count of slots leaves a group from
    each take for the take after next, two versions on (async would drop it); the
    start bound ``async`` uses under ``"auto"`` holds as much and trains none older
    than alpha."""
    ages, held = _staleness_of_takes(Capacity(3), 3)
    assert max(ages) == 2 and max(held) == 3, (ages, held)
    bound = StartBound(alpha=1, groups_per_step=2, limit=3, drop_stale=True)
    ages, held = _staleness_of_takes(bound, 3)
    assert max(ages) <= 1 and max(held) == 3, (ages, held)
    assert bound.stale_floor(4) == 4 and bound.resized(5).drop_stale  # async still drops
    assert StartBound(alpha=1, groups_per_step=2).stale_floor(4) is None  # areal never
