"""EnvManager on a real in-process cluster with tagged workers: trajectories flow from
env through inference workers and the REWARD pool into the buffer; failures are contained."""

import threading
import time

import pytest

from rollart.buffer import SampleBuffer
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.manager import EnvManager
from rollart.env.trajectory import TokenLog
from rollart.env.tasks import BUILTIN_TASKS, Task
from rollart.model import load_tokenizer
from rollart.reward import success_reward
from rollart.rollout import LLMProxy
from rollart.testing import unique_key
from rollart.types import CPU_ENV, H20, H800, REWARD


class RaisingEnv(GridNavEnv):
    def step(self, action):
        raise RuntimeError("simulator crashed")


class WrongTypeEnv(GridNavEnv):
    def step(self, action):
        return 42


class HangingEnv(GridNavEnv):
    def step(self, action):
        time.sleep(3)
        return super().step(action)


class FirstInstanceEnv(GridNavEnv):
    """Envs that know whether they were the first created since ``created.clear()``
    (every subclass keeps its own ``created`` list)."""

    created: list = []
    lock = threading.Lock()

    def __init__(self):
        super().__init__()
        with self.lock:
            self.first = not self.created
            self.created.append(self)


class FirstIsStragglerEnv(FirstInstanceEnv):
    """The first instance takes 2 s per step."""

    created = []

    def step(self, action):
        if self.first:
            time.sleep(2.0)
        return super().step(action)


class FirstFailsEnv(FirstInstanceEnv):
    """The first instance crashes on its first step."""

    created = []

    def step(self, action):
        if self.first:
            raise RuntimeError("first env crashed")
        return super().step(action)


def raising_reward(episode):
    raise ValueError("judge unavailable")


def reward_pool_only(episode):
    """Succeeds only when run on a worker of the REWARD pool."""
    from distributed import get_worker

    if REWARD not in get_worker().state.total_resources:
        raise RuntimeError(f"reward ran on {get_worker().name}")
    return 1.0


def sleeping_reward(episode):
    time.sleep(2.0)
    return 1.0


def _task(name, env=GridNavEnv, reward=success_reward):
    return Task(name=name, env_factory=env, reward_fn=reward, max_turns=3)


@pytest.fixture(scope="module")
def rollout(local_cluster, tiny_model, tmp_path_factory, rollout_actors):
    mgr, buf, workers = rollout_actors(local_cluster, tiny_model,
                                       tmp_path_factory.mktemp("w") / "weights", "mgr",
                                       pools=(H800, H20), env_step_timeout=0.5)
    return local_cluster, mgr, buf, workers


def _trajs(buf):
    out = buf.get_batch(1, min_version=-1, timeout=10).result()
    return out


def test_group_flows_into_buffer_with_token_layout(rollout, tiny_model):
    c, mgr, buf, workers = rollout
    summary = mgr.run_group(BUILTIN_TASKS["gridnav"], 11, "ok", 4).result()
    assert summary["task"] == "gridnav" and len(summary["rewards"]) == 4
    trajs = _trajs(buf)
    assert len(trajs) == 4 and {t.group_id for t in trajs} == {"ok"}
    tok = load_tokenizer(tiny_model)
    for t in trajs:
        assert tok.decode(t.prompt_ids).startswith("gridnav :")
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        gen = [i for i, m in enumerate(t.loss_mask) if m]
        assert gen and all(t.versions[i] == 0 and t.logprobs[i] <= 0 for i in gen)
        assert t.num_turns >= 1 and t.state == "trained" and t.outcome in (
            "success", "failure", "truncated")
    routed = [w.stats().result()["requests"] for w, _ in workers]
    assert sum(routed) >= 4


def _near_kind(buf):
    from rollart.runtime.near import near as _near

    return type(_near(buf)).__name__


def test_a_buffer_on_the_managers_own_worker_is_called_without_a_round_trip(rollout):
    """The manager shares its worker with the buffer here: it calls the buffer object
    directly (``rollart.runtime.near.Near``); from another worker the buffer stays a Dask actor handle."""
    c, mgr, buf, _ = rollout
    assert c.submit(_near_kind, buf, resources={CPU_ENV: 1}, pure=False).result() == "Near"
    assert c.submit(_near_kind, buf, resources={REWARD: 1}, pure=False).result() == "Actor"


@pytest.mark.parametrize("env, reward, needle", [
    (RaisingEnv, success_reward, "simulator crashed"),
    (WrongTypeEnv, success_reward, "StepResult"),
    (HangingEnv, success_reward, "env_step_timeout"),
    (GridNavEnv, raising_reward, "judge unavailable"),
])
def test_failures_are_contained_and_counted(rollout, env, reward, needle):
    c, mgr, buf, _ = rollout
    before = buf.counts().result()
    summary = mgr.run_group(_task("bad", env, reward), 3, f"bad-{env.__name__}-{reward.__name__}",
                            2).result()
    assert summary["outcomes"] == ["failed", "failed"]
    after = buf.counts().result()
    # each failed member is replaced once (up to group_size), then failures are delivered
    assert after["failed"] - before["failed"] == 4
    assert after["received"] == after["buffered"] + after["trained"] + after["dropped"] \
        + after["failed"]
    stats = mgr.stats().result()
    assert stats["failed"] >= 4 and stats["replaced"] >= 2 and stats["in_flight"] == 0
    # the manager keeps serving healthy trajectories afterwards
    ok = mgr.run_group(_task("fine"), 5, f"after-{needle}", 2).result()
    assert "failed" not in ok["outcomes"]
    _trajs(buf)


def test_error_text_is_kept_on_the_trajectory(rollout, tiny_model, tmp_path):
    c, _, _, workers = rollout
    buf = c.submit(SampleBuffer, str(tmp_path), actor=True, resources={CPU_ENV: 1},
                   key=unique_key("buf-errors")).result()
    mgr2 = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model,
                    actor=True, resources={CPU_ENV: 1}, key=unique_key("mgr-errors")).result()
    mgr2.run_group(_task("bad", RaisingEnv), 1, "e", 2).result()
    buf.close().result()
    from rollart.buffer import read_samples

    table = read_samples(str(tmp_path)).to_pylist()
    assert [r["state"] for r in table] == ["failed"] * 4  # 2 replaced, then 2 delivered
    assert all("simulator crashed" in r["error"] for r in table)


def test_rewards_run_on_the_reward_pool(rollout):
    c, mgr, buf, _ = rollout
    summary = mgr.run_group(_task("placed", reward=reward_pool_only), 8, "placed", 2).result()
    assert summary["outcomes"].count("failed") == 0 and summary["rewards"] == [1.0, 1.0]
    _trajs(buf)


@pytest.mark.parametrize("reward, needle", [(raising_reward, "judge unavailable"),
                                             (sleeping_reward, "reward_timeout")])
def test_a_reward_on_the_managers_own_worker_runs_there_and_is_contained(
        rollout, tiny_model, tmp_path, reward, needle):
    """A manager on a worker that carries REWARD scores on that worker's threads (no
    Dask task); a reward raising or outliving ``reward_timeout`` fails only its
    trajectory, with the error kept, and the manager goes on scoring."""
    from rollart.buffer import read_samples

    c, _, _, workers = rollout
    buf = c.submit(SampleBuffer, str(tmp_path), actor=True, resources={CPU_ENV: 1},
                   key=unique_key(f"buf-here-{needle}")).result()
    mgr = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model, reward_timeout=0.5,
                   actor=True, resources={REWARD: 1}, key=unique_key(f"mgr-here-{needle}")).result()
    bad = mgr.run_group(_task("here-bad", reward=reward), 2, "here-bad", 2).result()
    assert bad["outcomes"] == ["failed", "failed"]
    ok = mgr.run_group(_task("here-ok", reward=reward_pool_only), 3, "here-ok", 2).result()
    assert ok["rewards"] == [1.0, 1.0]  # it ran on a REWARD worker: this one
    stats = mgr.stats().result()
    assert stats["rewards_here"] == 6 and stats["reward_tasks"] == 0  # 4 failed, 2 fine
    buf.close().result()
    rows = [r for r in read_samples(str(tmp_path)).to_pylist() if r["state"] == "failed"]
    assert len(rows) == 4 and all(needle in r["error"] for r in rows)
    mgr.close().result()


def test_token_log_layout():
    log = TokenLog()
    log.add_observation([1, 2])
    log.add_generation([3, 4], [-0.5, -0.1], [7, 7])
    log.add_observation([5])
    assert log.ids == [1, 2, 3, 4, 5] and log.loss_mask == [1, 1, 0]
    assert log.versions == [7, 7, -1] and log.logprobs == [-0.5, -0.1, 0.0]


def test_redundant_members_are_cancelled_and_never_trained(rollout):
    from rollart.chaos.faults import Faults, Latency, with_faults

    c, mgr, buf, _ = rollout
    slow = with_faults(_task("straggly"), Faults(step=Latency("lognormal", 0.02, sigma=1.5),
                                                 seed=1))
    before = buf.counts().result()
    summary = mgr.run_group(slow, 21, "redundant", 2, redundancy=2.0).result()
    assert len(summary["outcomes"]) == 2
    after = buf.counts().result()
    assert after["launched"] - before["launched"] == 4
    assert after["cancelled"] - before["cancelled"] == 2
    batch = buf.get_batch(1, min_version=-1, timeout=10).result()
    assert len(batch) == 2 and {t.group_id for t in batch} == {"redundant"}
    assert buf.counts().result()["in_flight"] == 0


def test_backups_start_only_for_stragglers_once_part_of_the_group_is_in(rollout):
    """``backup_after``: the extra member starts only when half the group is delivered,
    for the member still running; the straggler is then cancelled, never trained."""
    c, mgr, buf, _ = rollout
    FirstIsStragglerEnv.created.clear()
    task = _task("backup", env=FirstIsStragglerEnv)
    before, stats0 = buf.counts().result(), mgr.stats().result()
    t0 = time.time()
    summary = mgr.run_group(task, 51, "backup", 2, redundancy=1.5, backup_after=0.5).result()
    took = time.time() - t0
    after, stats1 = buf.counts().result(), mgr.stats().result()
    assert len(summary["outcomes"]) == 2
    assert after["launched"] - before["launched"] == 3  # 2 members + 1 backup
    assert stats1["backups"] - stats0["backups"] == 1
    assert after["cancelled"] - before["cancelled"] == 1  # the straggler
    assert len(FirstIsStragglerEnv.created) == 3
    assert took < 2.0 * task.max_turns  # the group did not wait for the straggler
    batch = buf.get_batch(1, min_version=-1, timeout=10).result()
    assert len(batch) == 2 and {t.group_id for t in batch} == {"backup"}
    assert buf.counts().result()["in_flight"] == 0

    # the same group without stragglers and with backups due only at the end: no extra
    before = buf.counts().result()
    mgr.run_group(_task("nobackup"), 52, "nobackup", 2, redundancy=1.5,
                  backup_after=1.0).result()
    after = buf.counts().result()
    assert after["launched"] - before["launched"] == 2 and after["cancelled"] == \
        before["cancelled"]
    buf.get_batch(1, min_version=-1, timeout=10).result()


def test_members_cancelled_before_they_start_are_settled_and_the_group_ends(rollout,
                                                                             tiny_model):
    """A member cancelled before its coroutine's first step (a backup registered while
    its group filled) never runs its own clean-up; the group must still end and the
    ledger must say ``cancelled`` (this hung the async pipeline once)."""
    import asyncio

    from rollart.env.manager import _GroupRun

    _, _, _, workers = rollout

    async def main():
        buf = SampleBuffer(None)
        mgr = EnvManager(LLMProxy(workers), buf, tiny_model)
        grp = _GroupRun(_task("unstarted"), 61, "unstarted", 2)
        await mgr._launch(grp, 2)  # registered, their tasks not yet started
        for job in list(grp.jobs.values()):
            job.cancel()
        await asyncio.wait_for(grp.done.wait(), 10)
        return await buf.counts(), mgr.counts

    counts, mgr_counts = asyncio.run(main())
    assert counts["launched"] == 2 and counts["cancelled"] == 2 and counts["in_flight"] == 0
    assert mgr_counts["cancelled"] == 2


class SlowToSettle(SampleBuffer):
    """The real buffer, but registering and settling each take ``delay`` seconds."""

    def __init__(self, *args, delay: float = 0.3, **kw):
        super().__init__(*args, **kw)
        self.delay = delay

    async def launched(self, traj_ids):
        import asyncio

        await asyncio.sleep(self.delay)
        return await super().launched(traj_ids)

    async def settle(self, traj_ids, state):
        import asyncio

        await asyncio.sleep(self.delay)
        return await super().settle(traj_ids, state)


def test_closing_returns_once_every_member_reached_the_buffer(rollout, tiny_model):
    """``close()`` at the run's end: members cancelled before they started settle in a
    task of their own, and a launch may still be registering; close returns only once
    all of it reached the buffer, so nothing is left in flight for the driver to count
    as lost with its worker (it was, now and then, when the buffer was slow)."""
    import asyncio

    from rollart.env.manager import _GroupRun

    _, _, _, workers = rollout

    async def main():
        buf = SlowToSettle(None)
        mgr = EnvManager(LLMProxy(workers), buf, tiny_model)
        started = _GroupRun(_task("closing-started"), 62, "closing-started", 2)
        await mgr._launch(started, 2)  # registered; their tasks not yet started
        late = _GroupRun(_task("closing-late"), 63, "closing-late", 2)
        registering = asyncio.ensure_future(mgr._launch(late, 2))
        await asyncio.sleep(0.05)  # the ledger is registering them when close comes
        await mgr.close()
        counts = await buf.counts()
        await registering
        return counts, late, mgr.counts

    counts, late, mgr_counts = asyncio.run(main())
    assert counts["launched"] == 4 and counts["in_flight"] == 0, counts
    assert counts["cancelled"] == 4 and mgr_counts["cancelled"] == 4, (counts, mgr_counts)
    assert not late.jobs and late.done.is_set()  # never started, and the group ended


class SlowToRegister(SampleBuffer):
    """The real buffer, but registering launches after the first takes a second."""

    calls = 0

    async def launched(self, traj_ids):
        import asyncio

        self.calls += 1
        if self.calls > 1:
            await asyncio.sleep(1.0)
        return await super().launched(traj_ids)


def test_a_group_does_not_end_while_a_replacement_is_being_registered(rollout, tiny_model):
    """A failed member's replacement is registered with the ledger (an await) before it
    runs; a member finishing in that window must not end the group one member short."""
    c, _, _, workers = rollout
    buf = c.submit(SlowToRegister, None, actor=True, resources={CPU_ENV: 1},
                   key=unique_key("buf-slow-register")).result()
    mgr = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model, actor=True,
                   resources={CPU_ENV: 1}, key=unique_key("mgr-slow-register")).result()
    FirstFailsEnv.created.clear()  # in-process cluster: the class the workers use
    summary = mgr.run_group(_task("race", env=FirstFailsEnv), 71, "race", 2).result()
    assert len(summary["outcomes"]) == 2 and "failed" not in summary["outcomes"]
    counts = buf.counts().result()
    assert counts["launched"] == 3 and counts["failed"] == 1 and counts["in_flight"] == 0


def test_lockstep_batch_moves_turn_by_turn(rollout):
    c, mgr, buf, _ = rollout
    groups = [(BUILTIN_TASKS["gridnav"], 31, "lock-a", 2), (BUILTIN_TASKS["boxpush"], 32,
                                                            "lock-b", 2)]
    out = mgr.run_batch(groups).result()
    assert [o["group_id"] for o in out] == ["lock-a", "lock-b"]
    assert mgr.stats().result()["barrier_wait_s"] > 0
    assert len(buf.get_batch(2, min_version=-1, timeout=10).result()) == 4


def test_stale_in_flight_members_are_aborted_and_replaced(rollout):

    from rollart.chaos.faults import Faults, with_faults

    c, mgr, buf, _ = rollout
    slow = with_faults(_task("slowish"), Faults(step=0.3))
    before = buf.counts().result()
    fut = mgr.run_group(slow, 41, "abort", 2)
    time.sleep(0.5)  # both members generated their first turn at version 0
    assert mgr.abort_older_than(1).result() == 2  # version 0 can no longer be trained
    summary = fut.result()  # replacements (still version 0 here) complete the group
    assert len(summary["outcomes"]) == 2
    after = buf.counts().result()
    assert after["aborted"] - before["aborted"] == 2
    assert after["launched"] - before["launched"] == 4
    assert after["in_flight"] == 0
    buf.get_batch(1, min_version=-1, timeout=10).result()


def test_take_work_runs_what_the_buffers_slots_allow_and_ends_with_the_buffer(
        rollout, tiny_model):
    """``take_work``: the manager takes a group whenever the buffer frees a slot, never
    more than the slots; the loop returns when the buffer closes."""
    from rollart.policy.admission import GroupSequence, Slots

    c, _, _, workers = rollout
    buf = c.submit(SampleBuffer, None, actor=True, resources={CPU_ENV: 1},
                   key=unique_key("buf-slots")).result()
    mgr = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model, actor=True,
                   resources={CPU_ENV: 1}, key=unique_key("mgr-slots")).result()
    seq = GroupSequence([_task("slotted")], None, seed=5, group_size=2)
    buf.open_slots(Slots(2, seq)).result()
    loop = mgr.take_work("m", None)
    deadline = time.monotonic() + 60
    while buf.counts().result()["groups_complete"] < 2:
        assert time.monotonic() < deadline and not loop.done()
        time.sleep(0.05)
    time.sleep(0.5)  # a third group would have been taken by now
    st = buf.stats().result()
    assert (st["slots_held"], st["groups_live"], st["launched"]) == (2, 2, 4)
    assert mgr.stats().result()["groups_taken"] == 2
    got = buf.get_batch(1, min_version=-1, timeout=10).result()  # a slot frees
    assert len({t.group_id for t in got} & {"g000000", "g000001"}) == 1
    while mgr.stats().result()["groups_taken"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    buf.close().result()
    assert loop.result(timeout=30)["groups_taken"] == 3
    mgr.close().result()


def test_closing_a_manager_ends_its_take_work_with_its_summary(rollout, tiny_model):
    """``close()`` while ``take_work`` waits for a slot: the call returns its summary. It
    raised: the cancellation dropped the call's connection, and the scheduler relaying
    the call logged "broadcast to ... failed: CommClosedError" at the end of every run."""
    from rollart.policy.admission import GroupSequence, Slots

    c, _, _, workers = rollout
    buf = c.submit(SampleBuffer, None, actor=True, resources={CPU_ENV: 1},
                   key=unique_key("buf-closing")).result()
    mgr = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model, actor=True,
                   resources={CPU_ENV: 1}, key=unique_key("mgr-closing")).result()
    buf.open_slots(Slots(1, GroupSequence([_task("closing")], None, seed=6,
                                          group_size=2))).result()
    loop = mgr.take_work("m", None)
    deadline = time.monotonic() + 60
    while buf.counts().result()["groups_complete"] < 1:  # then it waits for a slot
        assert time.monotonic() < deadline and not loop.done()
        time.sleep(0.05)
    mgr.close().result()
    assert loop.result(timeout=30) == {"groups_taken": 1, "running": 0}
    buf.close().result()


def _outcome(fut) -> str:
    try:
        return repr(fut.result(timeout=5))
    except Exception as e:  # noqa: BLE001 - reported
        return f"raised {type(e).__name__}: {e}"


def test_a_group_that_ends_in_error_in_take_work_is_counted_in_the_run_metrics(
        rollout, tiny_model):
    """A group whose ``run_group`` raises inside ``take_work`` (here: its member ids are
    already in the buffer's ledger, so registering them is an ``AccountingError``) ends
    at the buffer with its error and counts in the manager's ``group_errors``; the run's
    ``rollout/group_errors`` metric includes it (it counted only the driver's own
    ``take_work`` errors, so a group lost this way was a 0 in metrics.jsonl)."""
    from rollart.policy.admission import GroupSequence, Slots
    from rollart.control.fleet import Fleet
    from rollart.control.stages import Actors
    from rollart.observe.figures import step_row

    c, _, _, workers = rollout
    # keys of their own (unique_key): Dask hands back the actor of a key it still holds,
    # and once, in the full suite, this test got another test's closed buffer that way
    # and take_work ended at once
    buf = c.submit(SampleBuffer, None, actor=True, resources={CPU_ENV: 1},
                   key=unique_key("buf-take-errors")).result()
    mgr = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model, actor=True,
                   resources={CPU_ENV: 1}, key=unique_key("mgr-take-errors")).result()
    task = _task("clash")
    fleet = Fleet(Actors(None, buf, [(w, tag, w._address) for w, tag in workers], [mgr]))

    def rollout_stats() -> dict:  # the step row's figures, from one sample of the actors
        return step_row({}, fleet.sample(), elapsed=0.0)

    assert rollout_stats()["rollout/group_errors"] == 0
    buf.open_slots(Slots(2, GroupSequence([task], None, seed=3, group_size=2))).result()
    buf.launched(["g000001-0"]).result()  # the second group's first member id
    loop = mgr.take_work("m", None)
    deadline = time.monotonic() + 60
    while True:
        # read done() before the count: the loop counts the group's error before it
        # ends, so a loop found done beforehand has its count in the stats read next
        # (read the other way round, a loop ending in between failed the wait)
        ended = loop.done()
        if mgr.stats().result()["group_errors"] >= 1:
            break
        if ended:  # take_work ended before the group's error was counted: say how
            pytest.fail(f"take_work ended first: {_outcome(loop)}")
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stats = rollout_stats()
    assert stats["rollout/group_errors"] == 1
    # g000001 never completes: the member id the test launched for it never arrives (the
    # count of complete groups is no check: the errored group's slot goes to a third
    # group, which may complete before this read on a fast machine)
    assert buf.counts().result()["in_flight"] >= 1
    # and the group that ended is that one, with the error that ended it
    assert any(e.startswith("group g000001:") and "AccountingError" in e
               for e in buf.recent_errors().result()), buf.recent_errors().result()
    buf.close().result()
    loop.result(timeout=30)
    mgr.close().result()


class PutFailsOnce(SampleBuffer):
    """The real buffer, but booking the first delivery raises (a disk full, a bug).
    Deliveries come in ``put_many`` calls: only that one trajectory's caller hears it."""

    adds = 0

    def _add(self, traj, group_size):
        self.adds += 1
        if self.adds == 1:
            raise OSError("no space left on device (injected)")
        return super()._add(traj, group_size)


def test_a_member_that_raises_ends_its_group_with_the_error_instead_of_hanging(
        rollout, tiny_model):
    """A member whose delivery raises (not a trajectory's failure: the buffer's ``put``
    here) ends its group: ``run_group`` raises with the error naming the member, the
    other members are settled as cancelled, nothing is left in flight but the member
    that raised. (Before, the exception ended only that member's task: this group
    returned one member short without a word, and a group whose last member raised
    never ended.)"""
    c, _, _, workers = rollout
    buf = c.submit(PutFailsOnce, None, actor=True, resources={CPU_ENV: 1},
                   key=unique_key("buf-put-fails")).result()
    mgr = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model, actor=True,
                   resources={CPU_ENV: 1}, key=unique_key("mgr-put-fails")).result()
    with pytest.raises(RuntimeError, match=r"group boom ended: member boom-\d: OSError: "
                                           r"no space left on device"):
        mgr.run_group(_task("boom"), 5, "boom", 3).result(timeout=60)
    counts = buf.counts().result()
    assert counts["launched"] == 3
    assert counts["in_flight"] == 1  # the member that raised: orphaned at the run's end
    assert counts["cancelled"] + counts["received"] == 2
    assert mgr.stats().result()["groups_running"] == 0
    # the manager keeps working: the next group delivers in full
    summary = mgr.run_group(_task("after"), 6, "after", 2).result(timeout=60)
    assert len(summary["outcomes"]) == 2
