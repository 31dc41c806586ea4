"""The trajectory ledger (pure) and the staleness bound of the buffer under random
workloads (real SampleBuffer coroutines, no cluster)."""

import asyncio
import random

import pytest

from rollart.buffer import SampleBuffer
from rollart.buffer.ledger import AccountingError, Ledger
from rollart.testing import trajectory


def test_every_trajectory_ends_once():
    led = Ledger()
    for t in "abcde":
        led.launch(t)
    led.move("a", "buffered")
    led.move("a", "trained")
    led.move("b", "failed")
    led.move("c", "cancelled")
    led.move("d", "aborted")
    assert led.check() == {"launched": 5, "in_flight": 1, "buffered": 0, "taken": 0,
                           "trained": 1, "dropped": 0, "aborted": 1, "cancelled": 1,
                           "failed": 1, "lost_in_step": 0}


def test_taken_until_confirmed_then_trained_released_or_lost():
    led = Ledger()
    for t in "abc":
        led.launch(t)
        led.move(t, "buffered")
        led.move(t, "taken", step=4)
    assert led.check()["taken"] == 3
    led.move("a", "trained", step=4)
    led.move("b", "buffered")  # its step was lost: back in line
    led.move("b", "taken", step=5)
    led.move("b", "trained", step=5)
    led.move("c", "lost_in_step", step=4)
    t = led.check()
    assert (t["taken"], t["trained"], t["lost_in_step"], t["buffered"]) == (0, 2, 1, 0)
    assert led.drain()[-5:] == [("a", "trained", 4), ("b", "buffered", None),
                                ("b", "taken", 5), ("b", "trained", 5),
                                ("c", "lost_in_step", 4)]
    assert led.drain() == []


def test_load_continues_counts_and_state():
    led = Ledger()
    led.load({"a": "trained", "b": "taken", "c": "in_flight"})
    assert led.check()["launched"] == 3 and led.counts["taken"] == 1
    led.move("b", "trained", step=1)
    with pytest.raises(AccountingError, match="from trained to trained"):
        led.move("a", "trained")
    # totals that cover ids the state does not list (an old checkpoint's)
    led.load({"x": "buffered"}, {"launched": 5, "buffered": 1, "trained": 4})
    assert led.check()["trained"] == 4


@pytest.mark.parametrize("moves, match", [
    ([("a", "buffered"), ("a", "trained"), ("a", "trained")], "from trained to trained"),
    ([("a", "cancelled"), ("a", "buffered")], "from cancelled to buffered"),
    ([("a", "teleported")], "unknown trajectory state"),
    ([("a", "taken")], "from in_flight to taken"),  # taken only from the buffer
    ([("a", "lost_in_step")], "from in_flight to lost_in_step"),
    ([("a", "buffered"), ("a", "lost_in_step")], "from buffered to lost_in_step"),
    ([("a", "buffered"), ("a", "taken"), ("a", "dropped")], "from taken to dropped"),
])
def test_impossible_transitions_fail_loudly(moves, match):
    led = Ledger()
    led.launch("a")
    with pytest.raises(AccountingError, match=match):
        for t, s in moves:
            led.move(t, s)


def test_a_trajectory_never_launched_is_refused():
    led = Ledger()
    led.launch("a")
    with pytest.raises(AccountingError, match="trajectory ghost-0 was never launched: it "
                       "cannot go to buffered"):
        led.move("ghost-0", "buffered")
    with pytest.raises(AccountingError, match="ghost-1 was never launched.* trained"):
        led.move("ghost-1", "trained", step=3)
    assert "ghost-0" not in led and "ghost-1" not in led
    assert led.totals()["launched"] == 1 and led.drain() == [("a", "in_flight", None)]


def test_double_launch_fails():
    led = Ledger()
    led.launch("a")
    with pytest.raises(AccountingError, match="launched twice"):
        led.launch("a")


def _traj(tid, gid, version):
    return trajectory(tid, gid, [1], [2, 3], logprobs=[-0.1, -0.2],
                      versions=[version, version + 1], reward=random.random())


@pytest.mark.parametrize("seed", range(5))
def test_no_batch_ever_contains_a_token_older_than_alpha(seed):
    """Random arrival order and versions; the trainer advances one version per batch."""
    rng = random.Random(seed)
    alpha, group_size = rng.randint(0, 2), rng.randint(2, 4)

    async def run():
        buf = SampleBuffer(None)
        version, trained = 0, 0
        members = [(g, i) for g in range(60) for i in range(group_size)]
        rng.shuffle(members)
        for g, i in members:  # each member generated a little behind the trainer
            traj = _traj(f"g{g}-{i}", f"g{g}", max(0, version - rng.randint(0, 3)))
            await buf.launched([traj.traj_id])
            await buf.put(traj, group_size)
            try:
                batch = await buf.get_batch(2, version - alpha, timeout=0.001)
            except TimeoutError:
                continue
            assert all(t.version >= version - alpha for t in batch)
            trained += len(batch)
            version += 1
        c = await buf.counts()
        assert trained > 0 and c["trained"] == trained and c["in_flight"] == 0
        # against the test's own record: every member it launched, and what it trained on
        assert c["launched"] == len(members)
        assert c["dropped"] + c["buffered"] == len(members) - trained
        return c

    asyncio.run(run())


def test_an_id_reported_without_a_launch_is_adopted_and_counted():
    """An arrival or settlement the ledger never saw launched is no silent launch: it is
    counted (``unannounced``); a move of an unknown id is still refused."""
    led = Ledger()
    led.launch("a")
    assert led.adopt("a") is False and led.adopt("b") is True
    led.move("b", "buffered")
    assert led.counts["unannounced"] == 1 and led.check()["launched"] == 2
    with pytest.raises(AccountingError, match="c was never launched"):
        led.move("c", "buffered")
