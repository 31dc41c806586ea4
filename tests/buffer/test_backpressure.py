"""Backpressure owned by the buffer: the slot rule and the group sequence without a
cluster; the SampleBuffer's slots under puts, takes and a recovery; on a real in-process
cluster an async run never has more than ``max(alpha, 1) * groups_per_step`` groups in
flight or buffered, workers find new versions without a driver call, and a run that
stops progressing (every group dropped as stale; a worker that cannot load) says so."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid

import pytest

from rollart import GRPO, Graph, Rollout
from rollart.buffer import SampleBuffer
from rollart.config.graph import GraphError
from rollart.policy.admission import (Capacity, GroupSequence, Slots, StartBound,
                                      auto_admission)
from rollart.env.tasks import get_task
from rollart.testing import tiny_graph, trajectory
from rollart.types import Trajectory

GRIDNAV, BOXPUSH = get_task("gridnav"), get_task("boxpush")


def _seq(tasks=(GRIDNAV,), seed=0, size=2, weights=None):
    return GroupSequence(list(tasks), weights, seed=seed, group_size=size)


# -- the plain objects -------------------------------------------------------------------
def test_the_sequence_is_the_drivers_old_draws_and_resumes_from_its_state():
    # the draws rollart always made (task by weight, then seed), in this order
    rng, old = random.Random(7), []
    for _ in range(5):
        task = rng.choices([GRIDNAV, BOXPUSH], weights=[1.0, 3.0])[0]
        old.append((task.name, rng.randrange(1_000_000)))
    seq = _seq((GRIDNAV, BOXPUSH), seed=7, weights=[1.0, 3.0])
    got = [seq.next() for _ in range(5)]
    assert [(t.name, s) for t, s, _, _ in got] == old
    assert [g for _, _, g, _ in got] == [f"g{i:06d}" for i in range(5)]
    # resume: from the RNG state, and by replay when only the count is known
    a, b = _seq((GRIDNAV, BOXPUSH), seed=7), _seq((GRIDNAV, BOXPUSH), seed=7)
    for _ in range(3):
        a.next()
    b.load_state(a.state())
    replayed = _seq((GRIDNAV, BOXPUSH), seed=7)
    replayed.load_state({"n_groups": 3, "rng": None})
    peeked = _seq((GRIDNAV, BOXPUSH), seed=7)
    peeked.advance_to(3)
    peeked.peek()  # a peek is not a draw: its state replays to before it
    again = _seq((GRIDNAV, BOXPUSH), seed=7)
    again.load_state(peeked.state())
    nxt = [s.next()[1:3] for s in (a, b, replayed, peeked, again)]
    assert len(set(nxt)) == 1 and nxt[0][1] == "g000003"


def test_slots_bound_groups_and_free_when_a_group_leaves():
    slots = Slots(3, _seq())
    got = [slots.take(h) for h in ("m0", "m1", "m0", "m1")]
    assert [w.group_id for w in got[:3]] == ["g000000", "g000001", "g000002"]
    assert got[3] is None and slots.free == 0
    assert slots.release("g000001") and not slots.release("g000001")  # once only
    w = slots.take("m1")
    assert w.group_id == "g000003" and (w.need, w.first_index) == (2, 0)
    assert slots.take("m0") is None
    with pytest.raises(ValueError, match="groups_per_step"):
        Slots(0, _seq())


def test_a_holder_only_takes_its_pools_tasks_and_never_skips_the_sequence():
    seq = _seq((GRIDNAV, BOXPUSH), seed=1)
    first = seq.peek()[0].name
    other = "boxpush" if first == "gridnav" else "gridnav"
    slots = Slots(4, seq)
    assert slots.take("env-b", tasks=[other]) is None  # the next group is not its pool's
    assert slots.take("env-a", tasks=[first]).group_id == "g000000"
    assert seq.n_groups == 1  # nothing drawn for the holder that could not take it


def test_a_lost_holders_groups_go_back_in_line_for_their_missing_members():
    slots = Slots(3, _seq(size=4))
    a, b, c = slots.take("lost"), slots.take("lost"), slots.take("alive")
    # a: 1 member arrived; b: complete (nothing to re-run)
    again = slots.lost("lost", {a.group_id: 1, b.group_id: 4})
    assert [(w.group_id, w.need, w.first_index) for w in again] == [(a.group_id, 3, 1000)]
    assert slots.free == 0  # the restart still holds its slot
    w = slots.take("alive")
    assert (w.group_id, w.need, w.task, w.seed) == (a.group_id, 3, a.task, a.seed)
    assert slots.held[a.group_id] == "alive" and slots.take("alive") is None
    again = slots.lost("alive", {c.group_id: 0})  # lost twice: ids past both
    assert {w.group_id: w.first_index for w in again} == {a.group_id: 2000, c.group_id: 1000}
    slots.reset(["g000001"])  # a recovered buffer: only its complete groups hold slots
    assert set(slots.held) == {"g000001"} and not slots.retry and slots.free == 2


def _counts(launched=10, in_flight=2, dropped=0, streak=0):
    return {"launched": launched, "in_flight": in_flight, "dropped": dropped,
            "failed_streak": streak}


def test_the_admission_integrates_the_groups_held_over_time(monkeypatch):
    from rollart.buffer import backpressure

    now = [100.0]
    monkeypatch.setattr(backpressure.time, "monotonic", lambda: now[0])
    adm = backpressure.Admission()
    assert adm.stats() == {}  # not open: no figures
    adm.open(Slots(2, _seq()), held=[], next_index=0)
    grab = lambda: asyncio.run(adm.acquire("m0", None, 0.0, lambda: 0))  # noqa: E731
    now[0] = 101.0
    first = grab()  # 0 held for 1 s
    now[0] = 103.0
    grab()  # 1 held for 2 s
    now[0] = 104.0
    adm.free(first.group_id)  # 2 held for 1 s
    now[0] = 108.0  # 1 held for 4 s
    s = adm.stats()
    assert (s["slots_held_s"], s["slots_open_s"], s["slots_held"]) == (8.0, 8.0, 1)


def test_the_watchdog_names_each_way_a_run_stops_progressing():
    from rollart.policy.watchdog import Watchdog

    ok = {"address": "w0", "pool": "H800", "version": 3, "load_error": None}
    dog = Watchdog(stall=5.0, streak_limit=4, alpha=1, now=0.0)
    assert not dog.storm(_counts(streak=3)) and dog.storm(_counts(streak=4))
    # groups dropped as stale while no step completes: dropped counts as settled, so
    # the settling check alone never fires (the run looked healthy for ever)
    for t in range(0, 30):
        why = dog.stalled(_counts(launched=10 + 2 * t, dropped=2 * t), [ok], float(t))
        if why:
            break
    assert t == 5 and why.startswith("no trainer step completed for 5 s while 10 tra")
    assert "Trainer at unknown (no step completed yet); inference workers: w0 (H800) v3" in why
    # a completed step resets it; trajectories that settle without drops are progress
    dog.stepped(3, now=30.0)
    assert all(dog.stalled(_counts(launched=60 + t), [ok], 30.0 + t) is None
               for t in range(20))
    # a worker below version - alpha (the trainer moved on, the worker did not follow)
    dog.stepped(5, now=50.0)
    ok = dict(ok, version=5)
    bad = dict(ok, address="w1", version=3, load_error="v5: UnreadableWeightsError: trunc")
    assert dog.stalled(_counts(launched=80), [ok, bad], 51.0) is None
    assert dog.stalled(_counts(launched=81), [ok, dict(bad, version=4)], 52.0) is None
    assert dog.stalled(_counts(launched=82), [ok, bad], 53.0) is None  # behind again
    why = dog.stalled(_counts(launched=83), [ok, bad], 58.0)
    assert why.startswith("inference worker w1 (H800) has held weight version 3 for 5 s "
                          "while the trainer is at 5") and "v3, last load error: v5: Unr" in why
    # in flight, nothing settles
    dog = Watchdog(stall=5.0, streak_limit=0, alpha=0, now=0.0)
    assert not dog.storm(_counts(streak=100))
    assert [bool(dog.stalled(_counts(), None, float(t))) for t in (0, 4, 5)] == \
        [False, False, True]
    assert Watchdog(stall=0, streak_limit=0, alpha=0, now=0).stalled(_counts(), None, 1e9) \
        is None
    # the trainer waits for a batch, nothing in flight, nothing starts (the take window's
    # hang of bbaee73: complete groups held every slot): no other reason applies
    dog = Watchdog(stall=5.0, streak_limit=0, alpha=1, now=0.0)
    held = dict(_counts(launched=96, in_flight=0), waiters=1, groups_complete=23,
                slots_held=24, slots_capacity=24, slots_take_window=12)
    assert [bool(dog.stalled(held, None, float(t))) for t in (0, 4, 5)] == \
        [False, False, True]
    assert dog.stalled(held, None, 6.0).startswith(
        "the trainer has waited 6 s for a batch while no trajectory was in flight")
    assert "23 complete groups, 24 of 24 slots held, take window 12" in \
        dog.stalled(held, None, 6.0)
    # a trainer computing a long step (no waiter: sync+ stops rollout meanwhile), or one
    # whose batch is being started, is not starved
    dog = Watchdog(stall=5.0, streak_limit=0, alpha=1, now=0.0)
    assert all(dog.stalled(dict(held, waiters=0), None, float(t)) is None for t in range(20))
    assert all(dog.stalled(dict(held, launched=96 + t), None, float(t)) is None
               for t in range(20))


# -- the SampleBuffer's slots, in-process (no cluster) -----------------------------------
def _traj(gid: str, i: int, version: int = 0) -> Trajectory:
    return trajectory(f"{gid}-{i}", gid, seed=1, version=version, reward=1.0,
                      outcome="success", state="scoring")


async def _run_group(buf, work, version: int = 0) -> None:
    ids = [f"{work.group_id}-{work.first_index + i}" for i in range(work.need)]
    await buf.launched(ids)
    for i in range(work.need):
        await buf.put(_traj(work.group_id, work.first_index + i, version), work.size)


def test_the_buffer_hands_out_a_slot_only_when_a_group_leaves(tmp_path):
    async def scenario():
        buf = SampleBuffer(str(tmp_path / "run"))
        await buf.open_slots(Slots(2, _seq()))
        w0, w1 = await buf.acquire("m"), await buf.acquire("m")
        assert await buf.acquire("m", wait=0.2) is None  # both slots held
        waiting = asyncio.ensure_future(buf.acquire("m", wait=30))
        await _run_group(buf, w0)
        await _run_group(buf, w1)
        await asyncio.sleep(0.05)
        assert not waiting.done()  # complete groups still hold their slots
        st = await buf.stats()
        assert (st["slots_held"], st["groups_live"], st["groups_buffered"]) == (2, 2, 2)
        await buf.get_table(1, min_version=0, trained_step=1)  # the trainer takes one
        w2 = await asyncio.wait_for(waiting, 5)
        assert w2.group_id == "g000002"
        # a stale complete group is dropped at the next take: its slot frees too
        await _run_group(buf, w2, version=5)
        await buf.get_table(1, min_version=5, trained_step=2)  # drops w1 (v0), takes w2
        assert (await buf.stats())["slots_held"] == 0
        await buf.close()
        assert await buf.acquire("m", wait=5) is False  # a closed buffer: stop asking

    asyncio.run(scenario())


def test_start_order_takes_the_first_started_and_waits_within_the_window(tmp_path):
    """Rollout.take_window: complete groups are taken in the order they started, and a
    group that started more than the window after the oldest one still running waits
    for it; without a window the first to complete go first (what biased the batch
    toward short episodes)."""
    slots = Slots(6, _seq(), take_window=2)
    for _ in range(4):
        slots.take("m")
    assert slots.take_limit() == 2  # g0 is the oldest held
    slots.release("g000000")
    assert slots.take_limit() == 3
    slots.release("g000002")  # ended with nothing: no room in the window
    assert slots.take_limit() == 4  # g1 and g3 are the two oldest held
    slots.release("g000001")
    assert slots.take_limit() == 4  # only g3 holds one: every group started so far
    assert Slots(6, _seq()).take_limit() is None

    async def scenario(window):
        buf = SampleBuffer(str(tmp_path / f"run-{window}"))
        await buf.open_slots(Slots(6, _seq(), take_window=window))
        w = [await buf.acquire("m") for _ in range(4)]
        for k in (3, 2, 1):  # g0 is the long episode: the others complete before it
            await _run_group(buf, w[k])
        if window is None:
            t = await buf.get_table(2, min_version=0, trained_step=1)
            return sorted(set(t.column("group_id").to_pylist())), None
        # g1 is within the window of g0; g2, g3 are not: one group is not a batch of 2
        with pytest.raises(TimeoutError):
            await buf.get_table(2, min_version=0, timeout=0.3, trained_step=1)
        taking = asyncio.ensure_future(buf.get_table(2, min_version=0, trained_step=1))
        await asyncio.sleep(0.1)
        assert not taking.done()
        await _run_group(buf, w[0])  # the long one arrives: the trainer takes g0, g1
        first = await asyncio.wait_for(taking, 5)
        await buf.mark_trained(1)
        second = await buf.get_table(2, min_version=0, trained_step=2)
        return (sorted(set(first.column("group_id").to_pylist())),
                sorted(set(second.column("group_id").to_pylist())))

    assert asyncio.run(scenario(None))[0] == ["g000002", "g000003"]  # completion order
    assert asyncio.run(scenario(2)) == (["g000000", "g000001"], ["g000002", "g000003"])


def test_a_group_that_ends_with_nothing_inside_the_window_leaves_room_for_the_next(tmp_path):
    """A group inside the window (not the oldest) failing whole: the window spans the
    oldest groups still holding a slot, so the next started group fills the batch. With
    the window counted from the oldest number the trainer waited for a batch it could
    never fill while the complete groups held every slot (benchmarks/pipeline.py
    --max-in-flight 2 --take-window 1 hung so after two steps)."""
    async def scenario():
        buf = SampleBuffer(str(tmp_path / "run"))
        await buf.open_slots(Slots(4, _seq(), take_window=2))
        w = [await buf.acquire("m") for _ in range(3)]
        for i in range(w[1].size):  # g1 fails whole
            t = _traj(w[1].group_id, i)
            t.outcome, t.error = "failed", "env crashed"
            await buf.put(t, w[1].size)
        await _run_group(buf, w[2])
        await _run_group(buf, w[0])
        got = await asyncio.wait_for(buf.get_table(2, min_version=0, trained_step=1), 5)
        return sorted(set(got.column("group_id").to_pylist()))

    assert asyncio.run(scenario()) == ["g000000", "g000002"]


def test_a_group_that_ends_with_nothing_moves_the_window(tmp_path):
    """The oldest group failing whole frees its slot: the window moves on and the
    waiting trainer wakes (no hang behind a group that will never complete)."""
    async def scenario():
        buf = SampleBuffer(str(tmp_path / "run"))
        await buf.open_slots(Slots(4, _seq(), take_window=1))
        w = [await buf.acquire("m") for _ in range(2)]
        await _run_group(buf, w[1])
        taking = asyncio.ensure_future(buf.get_table(1, min_version=0, trained_step=1))
        await asyncio.sleep(0.1)
        assert not taking.done()  # g1 waits for g0
        for i in range(w[0].size):
            t = _traj(w[0].group_id, i)
            t.outcome, t.error = "failed", "env crashed"
            await buf.put(t, w[0].size)
        got = await asyncio.wait_for(taking, 5)
        return sorted(set(got.column("group_id").to_pylist()))

    assert asyncio.run(scenario()) == ["g000001"]


def test_take_window_is_checked_and_reaches_the_slots():
    from rollart.config.graph import GraphError
    from rollart.policy.admission import take_window_groups

    with pytest.raises(GraphError, match="take_window must be ≥ 1"):
        Rollout(take_window=0.5)
    algo = GRPO(group_size=2, groups_per_step=4)
    assert take_window_groups(algo, None) is None
    assert (take_window_groups(algo, 1), take_window_groups(algo, 1.5)) == (4, 6)


def test_slots_are_right_again_after_the_buffer_is_recovered(tmp_path):
    run = str(tmp_path / "run")

    async def first():
        buf = SampleBuffer(run)
        await buf.open_slots(Slots(3, _seq()))
        works = [await buf.acquire("m") for _ in range(3)]
        await _run_group(buf, works[0])  # complete: durable
        await buf.launched([f"{works[1].group_id}-0"])  # in flight when the worker dies
        await buf.store.drain()
        return [w.group_id for w in works]

    async def second():
        buf = SampleBuffer(run, recover=True)
        st = await buf.open_slots(Slots(3, _seq()))  # a fresh Slots, as the driver sends
        assert (st["slots_held"], st["groups_buffered"]) == (1, 1)
        assert st["groups_drawn"] == 2  # continues after the last group its ledger knows
        a, b = await buf.acquire("m"), await buf.acquire("m")
        assert (a.group_id, b.group_id) == ("g000002", "g000003")
        assert await buf.acquire("m", wait=0.2) is None
        await buf.close()

    ids = asyncio.run(first())
    assert ids == ["g000000", "g000001", "g000002"]
    asyncio.run(second())


def test_the_start_bound_counts_groups_started_against_the_trainer_version():
    """AReaL's admission (areal): groups started ≤ (version + alpha + 1) × groups_per_step,
    where started = trained + in training + held; a group that ended with nothing to
    train on does not count; async's Capacity frees a slot as soon as the trainer takes."""
    bound = StartBound(alpha=1, groups_per_step=2)
    assert [bound.room(0, s, 0) for s in (0, 3, 4)] == [4, 1, 0]
    assert bound.room(0, 4, 1) == 2 and bound.stale_floor(7) is None
    assert Capacity(4).room(3, 99, 0) == 1 and Capacity(4).stale_floor(7) == 7
    slots = Slots(4, _seq(), bound)
    got = [slots.take("m") for _ in range(5)]
    assert [w is not None for w in got] == [True] * 4 + [False]
    for w in got[:2]:  # the trainer takes two: still started while it trains on them
        slots.release(w.group_id)
    assert slots.take("m", training=2) is None
    slots.published(2)  # its update is out: version 1, two more may start
    assert [slots.take("m") is not None for _ in range(3)] == [True, True, False]
    slots.release(got[2].group_id)  # ended with every member failed: nothing trained
    assert slots.take("m").group_id == "g000006"
    plain = Slots(4, _seq())  # async: the slots a take frees are free at once
    taken = [plain.take("m") for _ in range(4)]
    plain.release(taken[0].group_id)
    assert plain.take("m", training=1) is not None


def test_max_in_flight_is_the_same_budget_for_async_and_areal_apart_from_alpha():
    """``Rollout.max_in_flight`` (steps' worth of groups) bounds the groups held at once
    in both asynchronous modes; alpha bounds staleness only (issue 42)."""
    from rollart.policy.admission import slot_capacity

    algo = GRPO(groups_per_step=4, alpha=1)
    assert slot_capacity(algo) == 4 and slot_capacity(algo, 2) == 8
    assert slot_capacity(GRPO(groups_per_step=4, alpha=3)) == 12  # the default: alpha's
    assert slot_capacity(GRPO(groups_per_step=4, alpha=3), 1) == 4  # decoupled
    budget = slot_capacity(algo, 2)
    async_, areal = Capacity(budget), StartBound(1, 4, limit=budget)
    # nothing held: async may start 8, areal its start bound ((0 + 1 + 1) * 4 = 8)
    assert async_.room(held=0, started=0, version=0) == 8
    assert areal.room(held=0, started=0, version=0) == 8
    # three versions on, AReaL's start bound alone would let 12 more start than started
    # (20 - 8); the shared budget keeps both at 8 held
    assert StartBound(1, 4).room(held=8, started=8, version=3) == 12
    assert areal.room(held=8, started=8, version=3) == 0
    assert async_.room(held=8, started=8, version=3) == 0
    for bad in (0, -1, "2"):
        with pytest.raises(Exception, match="max_in_flight"):
            Rollout(max_in_flight=bad)


def test_the_buffer_counts_a_taken_batch_until_published_and_drops_nothing_in_areal(
        tmp_path):
    async def scenario():
        buf = SampleBuffer(str(tmp_path / "run"))
        await buf.open_slots(Slots(1, _seq(), StartBound(alpha=0, groups_per_step=1)))
        w0 = await buf.acquire("m")
        assert await buf.acquire("m", wait=0.2) is None  # version 0: one group
        await _run_group(buf, w0, version=0)
        table = await buf.get_table(1, min_version=0, trained_step=1)
        assert table.num_rows == 2
        waiting = asyncio.ensure_future(buf.acquire("m", wait=30))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # taken, not published: it still counts
        await buf.mark_trained(1)
        w1 = await asyncio.wait_for(waiting, 5)
        assert w1.group_id == "g000001"
        # a group far older than the trainer's bound is trained, not dropped
        await _run_group(buf, w1, version=0)
        table = await buf.get_table(1, min_version=5, trained_step=2)
        assert table.num_rows == 2 and (await buf.counts())["dropped"] == 0
        await buf.close()

    asyncio.run(scenario())


def test_async_keeps_a_stale_complete_group_for_the_trainer_to_rescore(tmp_path):
    """``GRPO.stale_groups="rescore"``: async's admission (fixed or adaptive) drops no
    complete group as too stale: the trainer takes it and re-scores its old tokens. Under
    the default "drop" the same group is dropped at the take."""
    assert auto_admission(GRPO(groups_per_step=2), 4).drop_stale
    kept = auto_admission(GRPO(groups_per_step=2, stale_groups="rescore"), 4)
    assert not kept.drop_stale and kept.stale_floor(7) is None
    assert not kept.resized(6).drop_stale and not Capacity(4, False).resized(6).drop_stale
    # "clip" keeps it too; the trainer then trains its tokens as they are
    clip = auto_admission(GRPO(groups_per_step=2, stale_groups="clip"), 4)
    assert not clip.drop_stale and clip.stale_floor(7) is None
    with pytest.raises(GraphError, match="stale_groups must be one of"):
        GRPO(stale_groups="keep")
    for kept in ("rescore", "clip"):
        with pytest.raises(GraphError, match="applies to mode='async' only"):
            Graph("g", mode="areal", algo=GRPO(stale_groups=kept))

    async def scenario(drop: bool) -> tuple[int, int]:
        buf = SampleBuffer(str(tmp_path / f"run-{drop}"))
        await buf.open_slots(Slots(2, _seq(), Capacity(2, drop)))
        old, new = await buf.acquire("m"), await buf.acquire("m")
        await _run_group(buf, old, version=0)
        await _run_group(buf, new, version=5)
        table = await buf.get_table(1, min_version=5, trained_step=1)
        dropped = (await buf.counts())["dropped"]
        await buf.close()
        return sorted(set(table.column("group_id").to_pylist())), dropped

    assert asyncio.run(scenario(True)) == (["g000001"], 2)  # the old group dropped
    assert asyncio.run(scenario(False)) == (["g000000"], 0)  # kept: taken first


def test_a_lost_manager_frees_nothing_and_its_group_is_handed_out_again(tmp_path):
    async def scenario():
        buf = SampleBuffer(str(tmp_path / "run"))
        await buf.open_slots(Slots(1, _seq(size=2)))
        w = await buf.acquire("lost")
        await buf.launched([f"{w.group_id}-0", f"{w.group_id}-1"])
        await buf.put(_traj(w.group_id, 0), 2)
        assert await buf.holder_lost("lost") == 1
        assert await buf.acquire("lost", wait=0.1) is False  # a lost holder: stop asking
        again = await buf.acquire("alive")
        assert (again.group_id, again.need, again.first_index) == (w.group_id, 1, 1000)
        c = await buf.counts()
        assert c["failed"] == 1 and c["orphaned"] == 1  # member 1 died with its manager
        await buf.launched([f"{w.group_id}-1000"])
        await buf.put(_traj(w.group_id, 1000), 2)
        assert (await buf.counts())["groups_complete"] == 1
        await buf.close()

    asyncio.run(scenario())


# -- on a real in-process cluster --------------------------------------------------------
def _start(client, graph, model, run_dir):
    from rollart.control.fleet import Fleet
    from rollart.control.modes import make_pipeline
    from rollart.control.stages import Stages

    stages = Stages(client, graph, model, run_dir)
    actors = stages.start()
    assert actors.trainer.publish().result() == 0  # nobody tells the workers
    pipe = make_pipeline(Fleet(actors, stages), graph)
    return actors, pipe


def _stop(actors, extra=()):
    from rollart.control.lifecycle import shutdown as _shutdown

    _shutdown(actors)
    for w in extra:
        w.close().result()


def _versions(actors) -> list[int]:
    return [w.stats().result()["version"] for w, _, _ in actors.workers]


def test_an_async_run_stays_within_its_slots_and_workers_follow_the_trainer(
        local_cluster, tiny_model, tmp_path):
    graph = tiny_graph("bp-bound", steps=4)
    bound = 1 * 2  # async: alpha 1; one step's worth of groups of 2 (slot_capacity)
    actors, pipe = _start(local_cluster, graph, tiny_model, tmp_path / "run")
    live, stop = [], threading.Event()

    def sample():  # the buffer's own figures, while the run goes on
        while not stop.is_set():
            st = actors.buffer.stats().result()
            live.append((st["groups_live"], st.get("slots_held")))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        steps = [pipe.step(s) for s in range(1, 5)]
        stop.set()
        sampler.join(30)
        assert [m["version"] for m in steps] == [1, 2, 3, 4]
        assert len(live) > 20 and max(n for n, _ in live) <= bound
        assert max(n for n, _ in live) == bound  # every slot was used
        # rollout ran ahead: a batch rolled out while the trainer stepped on the last one
        assert max(m["trainer/staleness_max"] for m in steps) >= 1, steps
        deadline = time.monotonic() + 60
        while _versions(actors) != [4] * len(actors.workers):  # found in the store
            assert time.monotonic() < deadline, _versions(actors)
            time.sleep(0.1)
    finally:
        stop.set()
        _stop(actors)


def test_an_async_run_with_a_take_window_trains_groups_in_start_order(
        local_cluster, tiny_model, tmp_path):
    """take_window = one step's worth: each step trains the oldest groups started (every
    group of step k started before every group of step k+1), on a real cluster."""
    from rollart.buffer import read_samples
    from rollart.policy.admission import group_number

    graph = tiny_graph("bp-window", steps=4, take_window=1, max_in_flight=3)
    actors, pipe = _start(local_cluster, graph, tiny_model, tmp_path / "run")
    try:
        steps = [pipe.step(s) for s in range(1, 5)]
        assert [m["version"] for m in steps] == [1, 2, 3, 4]
        assert actors.buffer.slot_stats().result()["slots_take_window"] == 2
        actors.buffer.flush().result()
    finally:
        _stop(actors)
    rows = read_samples(str(tmp_path / "run")).to_pylist()
    by_step: dict[int, set[int]] = {}
    for r in rows:
        if r["state"] == "trained":
            by_step.setdefault(r["trained_step"], set()).add(group_number(r["group_id"]))
    assert sorted(by_step) == [1, 2, 3, 4], by_step
    for k in (1, 2, 3):
        assert max(by_step[k]) < min(by_step[k + 1]), by_step


def test_every_group_dropped_as_stale_is_a_stall(local_cluster, tiny_model, tmp_path):
    """The workers read another weight store (stuck on v0): every group is too old for
    the trainer from step 3 on and is dropped, so no step completes. Async at a fixed
    limit with stale members aborted (under its default, re-scoring waits on the stuck
    workers and the stall names them: ``StallError`` "has held weight version 0")."""
    from rollart.control.supervisor import StallError
    from rollart.rollout import InferenceWorker

    graph = tiny_graph("bp-drop", steps=4, stall_timeout=6.0, max_in_flight=1.0,
                       stale_members="abort")
    actors, pipe = _start(local_cluster, graph, tiny_model, tmp_path / "run")
    elsewhere = str(tmp_path / "another-store")
    own = list(actors.workers)
    stuck = [(local_cluster.submit(InferenceWorker, tiny_model, elsewhere, pool=tag,
                                   threads=1, actor=True, workers=[addr],
                                   key=f"stuck-{tag}-{uuid.uuid4().hex[:6]}").result(),
              tag, addr) for _, tag, addr in own]
    for w, _, _ in own:  # the record of the run's actors: the stuck ones replace them
        actors.remove("inference", w)
    for w, tag, addr in stuck:
        actors.add("inference", w, tag, addr)
    for m in actors.managers:
        m.set_inference_workers([(w, tag) for w, tag, _ in stuck]).result()
    for w, _, _ in own:
        w.close().result()
    try:
        with pytest.raises(StallError, match=r"(?s)no trainer step completed for \d+ s "
                           r"while \d+ trajectories were dropped as too stale.*"
                           r"stall_timeout=6.*Trainer at v2; inference workers: .* v0"):
            for s in range(1, 20):
                pipe.step(s)
        assert s == 3 and pipe.version == 2
    finally:
        _stop(actors)


def test_a_worker_that_cannot_load_new_versions_is_a_stall(local_cluster, tiny_model,
                                                           tmp_path):
    """One worker's model does not fit the trainer's weights (every load fails); the run
    goes on on the others, and after stall_timeout it stops naming that worker."""
    from rollart.env.tasks import BUILTIN_TASKS, task_corpus
    from rollart.model import build_tiny_model
    from rollart.control.supervisor import StallError
    from rollart.rollout import InferenceWorker

    other = build_tiny_model(str(tmp_path / "other"), task_corpus(list(BUILTIN_TASKS)),
                             hidden_size=32)
    graph = tiny_graph("bp-load", steps=4, stall_timeout=3.0)
    actors, pipe = _start(local_cluster, graph, tiny_model, tmp_path / "run")
    _, tag, addr = actors.workers[0]
    bad = local_cluster.submit(InferenceWorker, other, pipe.supervisor.store_url, pool=tag,
                               threads=1, retry_after=0.5, actor=True, workers=[addr],
                               key=f"bad-{uuid.uuid4().hex[:6]}").result()
    actors.add("inference", bad, tag, f"{addr}#bad")  # not routed to: the run goes on
    try:
        with pytest.raises(StallError, match=r"(?s)inference worker \S+#bad .* has held "
                           r"weight version 0 for \d+ s while the trainer is at \d+ "
                           r"\(Rollout.stall_timeout=3.*last load error: v\d+: "
                           r".*shapes do not match"):
            for s in range(1, 40):
                pipe.step(s)
        assert s >= 3
    finally:
        actors.remove("inference", bad)
        _stop(actors, [bad])
