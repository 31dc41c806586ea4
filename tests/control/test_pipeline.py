"""The modes end to end, briefly, on a local tagged cluster: counts add up at every step,
no trained token is older than the mode's bound, redundant extras and stale members
never reach the trainer; ``sync+`` has no turn barrier and stops rollout while the
trainer steps; ``areal`` never aborts and starts no group beyond its bound."""

import threading
import time
from dataclasses import replace

import pyarrow.compute as pc
import pytest

from rollart import GRPO, Policy, Rollout, train
from rollart.buffer import read_samples
from rollart.buffer.journal import entries
from rollart.policy.admission import GroupSequence
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.chaos.faults import Faults, Latency, with_faults
from rollart.env.tasks import get_task
from rollart.config.graph import GraphError
from rollart.testing import check_run_record, tiny_graph

slow = pytest.mark.slow  # the first tests here take minutes; the new modes' do not


def _graph(mode, **rollout):
    tasks = tuple(with_faults(t, Faults(step=Latency("lognormal", 0.005, sigma=1.0)))
                  for t in ("gridnav", "boxpush"))
    return tiny_graph(f"t-{mode}", tasks, mode=mode, steps=4, groups=3, warmup_steps=10,
                      **rollout)


def _check_run(result, alpha):
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    check_run_record(result)  # the ledger against the trainer's reports and the rows
    for r in rows:
        assert r["trainer/staleness_max"] <= alpha
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    # the trainer holds version s - 1 at step s: no trained token older than s - 1 - alpha
    ok = pc.greater_equal(trained["version"], pc.subtract(trained["trained_step"], 1 + alpha))
    assert pc.all(ok).as_py()
    assert trained.num_rows == 4 * 3 * 2
    return rows


@slow
@pytest.mark.parametrize("mode, alpha", [("sync", 0), ("one-off", 1)])
def test_baseline_modes_train(local_cluster, tmp_path, mode, alpha):
    result = train(_graph(mode), client=local_cluster, run_dir=tmp_path / mode,
                   progress=False, eval_seeds=0)
    rows = _check_run(result, alpha)
    assert all(r["traj/cancelled"] == 0 and r["traj/aborted"] == 0 for r in rows)


@slow
def test_async_mode_with_redundancy_cancels_extras(local_cluster, tmp_path):
    result = train(_graph("async", redundancy=2.0), client=local_cluster,
                   run_dir=tmp_path / "async", progress=False, eval_seeds=0)
    rows = _check_run(result, 1)
    assert rows[-1]["traj/cancelled"] > 0
    samples = read_samples(result.run_dir)
    # cancelled extras never reach the buffer, let alone the trainer
    assert "cancelled" not in set(samples["state"].to_pylist())


def test_modes_imply_their_bound():
    assert replace(_graph("sync"), mode="sync").algo.alpha == 0
    assert _graph("one-off").algo.alpha == 1
    assert _graph("sync+").algo.alpha == 0 and _graph("areal").algo.alpha == 1
    assert replace(_graph("areal"), algo=GRPO(group_size=2, alpha=3)).algo.alpha == 3
    with pytest.raises(GraphError, match="sync\\+"):
        replace(_graph("sync+"), algo=GRPO(group_size=2, alpha=1))
    with pytest.raises(GraphError, match="mode"):
        replace(_graph("sync"), mode="fast")
    with pytest.raises(GraphError, match="redundancy"):
        Rollout(redundancy=0.5)


@slow
def test_accounting_holds_under_injected_failures_and_hangs(local_cluster, tmp_path):
    """Random crashes and hangs, plus one group whose every member fails and one whose
    every member hangs on its first step: those two meet their fault whatever the timing
    (a randomly hung member can instead be cancelled when its group fills first, and then
    no time-out happened: this test failed so once in CI)."""
    graph = _graph("async", redundancy=1.5, env_step_timeout=0.5)
    seq = GroupSequence(("gridnav", "guess"), None, graph.seed, graph.algo.group_size)
    first = [seq.next()[1] for _ in range(3)]  # the first groups' episode seeds
    faults = Faults(step=0.002, fail_prob=0.05, hang_prob=0.03, hang_seconds=30.0, seed=3,
                    fail_seeds=(first[0],), hang_seeds=(first[1],))
    graph = replace(graph, tasks=tuple(with_faults(t, faults) for t in ("gridnav", "guess")))
    result = train(graph, client=local_cluster, run_dir=tmp_path / "faulty", progress=False,
                   eval_seeds=0)
    rows = result.metrics
    check_run_record(result)
    assert rows[-1]["traj/failed"] > 0  # injected crashes and hangs (time-outs) happened
    samples = read_samples(result.run_dir)
    failed = samples.filter(pc.equal(samples["state"], "failed"))
    errors = failed["error"].to_pylist()
    assert any("injected failure" in e for e in errors)
    assert any("env_step_timeout" in e for e in errors)
    by_seed = dict(zip(failed["seed"].to_pylist(), errors))
    assert "injected failure at turn 1" in by_seed[first[0]]
    assert "env_step_timeout" in by_seed[first[1]]
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert 0 < trained.num_rows <= 4 * 3 * 2  # failed members are never trained on


# Runs that cannot make progress stop with an error that says why, instead of spinning:
# every trajectory failing (a broken env) is a failure storm; trajectories that wait
# forever (env steps that hang, with no step time-out to catch them) are a stall.
STOPS = {
    "storm": (Faults(fail_prob=1.0, seed=0), {"failure_streak_limit": 12},
              "FailureStormError", r"(?s)last \d+ trajectories all failed.*injected failure"
                                   r".*--resume", "failure_streak_limit"),
    "stall": (Faults(hang_prob=1.0, hang_seconds=15.0, seed=0),
              {"stall_timeout": 3.0, "env_step_timeout": 1000.0}, "StallError",
              r"(?s)in flight but none has settled.*stall_timeout=3.*--resume",
              "stall_timeout"),
}


@slow
@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("case", sorted(STOPS))
def test_a_run_that_cannot_progress_stops_with_the_reason(local_cluster, tmp_path, mode,
                                                          case):
    from rollart.control import supervisor as recovery

    from rollart.app.cli import user_errors

    faults, rollout, error, message, knob = STOPS[case]
    graph = replace(_graph(mode, **rollout),
                    tasks=tuple(with_faults(t, faults) for t in ("gridnav", "boxpush")))
    with pytest.raises(getattr(recovery, error), match=message) as stopped:
        train(graph, client=local_cluster, run_dir=tmp_path / mode, progress=False,
              eval_seeds=0)
    # the command line prints it as its message and exits 2, no traceback: its text
    # says what to fix (rollart.app.cli.main)
    assert isinstance(stopped.value, user_errors())
    with pytest.raises(GraphError, match=knob):
        Rollout(**{knob: -1})


def test_a_failing_task_is_named_at_its_first_failure(local_cluster, tmp_path, caplog):
    """A task whose every trajectory raises, beside one that works: one console line
    names it with the error's text during the first step (not steps later, under
    another reason), and the run goes on with the other task."""
    broken = with_faults("boxpush", Faults(fail_prob=1.0, seed=0))
    graph = replace(_graph("async", failure_streak_limit=0), steps=1,
                    tasks=("gridnav", broken), policy=Policy(warmup_steps=0))
    with caplog.at_level("WARNING", logger="rollart.control.modes.base"):
        result = train(graph, client=local_cluster, run_dir=tmp_path / "named",
                       progress=False, eval_seeds=0)
    named = [r.getMessage() for r in caplog.records
             if "a trajectory failed" in r.getMessage()]
    assert len(named) == 1, named  # once per task, however often it fails
    assert named[0].startswith("task 'boxpush': a trajectory failed: ")
    assert "injected failure" in named[0]
    assert [r["step"] for r in result.metrics] == [1]


class FailsOnEvenSeeds(GridNavEnv):
    """Every member of a group shares its seed: even-seeded groups fail whole."""

    def reset(self, seed):
        if seed % 2 == 0:
            raise RuntimeError(f"broken seed {seed}")
        return super().reset(seed)


@slow
def test_sync_mode_refills_groups_whose_every_member_failed(local_cluster, tmp_path):
    """Lockstep members are not replaced; a group with no member left is re-run, so the
    trainer never waits for groups nobody runs."""
    half = replace(get_task("gridnav"), name="halfbroken", env_factory=FailsOnEvenSeeds)
    graph = replace(_graph("sync", failure_streak_limit=0), tasks=(half,),
                    policy=Policy(warmup_steps=0))  # the warm-up would meet even seeds too
    result = train(graph, client=local_cluster, run_dir=tmp_path / "sync", progress=False,
                   eval_seeds=0)
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["rollout/groups_refilled"] > 0
    check_run_record(result)
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert trained.num_rows == 4 * 3 * 2 and all(s % 2 for s in trained["seed"].to_pylist())


@slow
def test_a_comm_error_while_the_trainer_is_alive_reruns_the_step(local_cluster, tmp_path,
                                                                   monkeypatch):
    """A trainer step that fails with a comm error (as when another worker dies while the
    batch is gathered) while the trainer itself is alive is re-run on the same trainer:
    no replacement, no step lost."""
    from rollart.trainer.trainer import Trainer

    real, calls = Trainer._train_step, []

    async def flaky(self, buffer, step, timeout):
        calls.append(step)
        if step == 2 and calls.count(2) == 1:
            raise OSError("connection to a lost worker closed (injected)")
        return await real(self, buffer, step, timeout)

    monkeypatch.setattr(Trainer, "_train_step", flaky)  # in-process workers share it
    result = train(_graph("async"), client=local_cluster, run_dir=tmp_path / "flaky",
                   progress=False, eval_seeds=0)
    rows = _check_run(result, 1)
    assert calls.count(2) == 2 and [r["version"] for r in rows] == [1, 2, 3, 4]
    assert result.recovery == []  # the trainer was never replaced


# -- sync+ and areal: short runs (3 steps of 3 groups of 2, no warm-up) ------------------
def _quick(mode, env=None, **rollout):
    task = get_task("gridnav") if env is None else \
        replace(get_task("gridnav"), name="nav", env_factory=env)
    return tiny_graph(f"q-{mode}", (task,), mode=mode, steps=3, groups=3, **rollout)


def _adds_up(result) -> None:
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    check_run_record(result)  # the ledger against the trainer's reports and the rows


def _trained(run_dir):
    samples = read_samples(run_dir)
    return samples.filter(pc.equal(samples["state"], "trained"))


class Turns:
    """What the test envs saw (the cluster runs in this process: one copy of it)."""

    lock = threading.Lock()
    made = 0
    second_step = threading.Event()  # some env other than the first finished 2 steps
    released = threading.Event()  # the straggler's env was closed
    events: list = []

    @classmethod
    def reset(cls):
        cls.made, cls.events = 0, []
        cls.second_step.clear()
        cls.released.clear()


class SlowFirstNav(GridNavEnv):
    """The first env made is slow: its first step waits (up to 30 s) until another env
    finished its second step. Behind a turn barrier that never happens."""

    def __init__(self):
        super().__init__()
        with Turns.lock:
            self.index, Turns.made = Turns.made, Turns.made + 1
        self.steps = 0

    def step(self, action):
        if self.index == 0 and self.steps == 0:
            Turns.events.append(("first env's first step waited for another's second",
                                 Turns.second_step.wait(30)))
        out = super().step(action)
        self.steps += 1
        if self.index and self.steps == 2:
            Turns.second_step.set()
        return out


class StragglerNav(GridNavEnv):
    """The first env made never finishes its first step unless it is closed (60 s)."""

    def __init__(self):
        super().__init__()
        with Turns.lock:
            self.index, Turns.made = Turns.made, Turns.made + 1

    def step(self, action):
        if self.index == 0:
            Turns.events.append(("straggler released by close", Turns.released.wait(60)))
            raise RuntimeError("the straggler's step ran to its end")
        return super().step(action)

    def close(self):
        if self.index == 0:
            Turns.released.set()
        super().close()


def test_syncplus_runs_trajectories_free_and_stops_rollout_while_training(local_cluster,
                                                                        tmp_path):
    Turns.reset()
    result = train(_quick("sync+", SlowFirstNav), client=local_cluster,
                   run_dir=tmp_path / "syncplus", progress=False, eval_seeds=0)
    _adds_up(result)
    # no turn barrier: a batch-mate took two steps while the first env's first one waited
    assert Turns.events == [("first env's first step waited for another's second", True)]
    trained = _trained(result.run_dir)
    assert trained.num_rows == 3 * 3 * 2
    # rollout stopped while the trainer stepped: every generated token of a row trained
    # at step s came from version s - 1, the trainer's version when it was rolled out
    for versions, mask, step in zip(trained["versions"].to_pylist(),
                                    trained["loss_mask"].to_pylist(),
                                    trained["trained_step"].to_pylist()):
        gen = {v for v, m in zip(versions, mask) if m}
        assert gen == {step - 1}, (gen, step)


def test_syncplus_redundancy_keeps_the_first_finishers(local_cluster, tmp_path):
    Turns.reset()
    result = train(_quick("sync+", StragglerNav, redundancy=1.5, env_step_timeout=120.0),
                   client=local_cluster, run_dir=tmp_path / "redundant", progress=False,
                   eval_seeds=0)
    rows = result.metrics
    _adds_up(result)
    # the straggler's group trained on its two other members; the straggler was cancelled
    assert Turns.events == [("straggler released by close", True)]
    assert rows[-1]["traj/cancelled"] >= 1 and rows[-1]["traj/failed"] == 0
    trained = _trained(result.run_dir)
    groups = trained["group_id"].to_pylist()
    assert trained.num_rows == 3 * 3 * 2 and groups.count("g000000") == 2


def _launch_order(run_dir) -> list[tuple[int, int]]:
    """From the buffer's journal, in the order the buffer saw them: for each group's
    first launch, ``(group index, trainer updates published before it)``."""
    import pyarrow.parquet as pq

    out, seen, published = [], set(), set()
    for _, path in entries(str(run_dir), "ledger"):
        t = pq.read_table(path)
        for traj, state, step in zip(t["traj_id"].to_pylist(), t["state"].to_pylist(),
                                     t["trained_step"].to_pylist()):
            gid = traj.rsplit("-", 1)[0]
            if state == "trained":
                published.add(step)
            elif state == "in_flight" and gid not in seen:
                seen.add(gid)
                out.append((int(gid[1:]), len(published)))
    return out


def test_async_groups_start_on_the_version_the_trainer_published(local_cluster, tmp_path,
                                                                  monkeypatch):
    """A group taken up when a step's take frees its slot starts on the version that step
    published, not on the one a worker still held while loading it (its first turns
    would be a version older, and with alpha 1 the group dropped a step later). Workers
    here read weights as slowly as worker processes on a busy laptop do."""
    from rollart.rollout.prefetch import WeightPrefetch

    real = WeightPrefetch.fetch

    def slow_fetch(self, target):
        time.sleep(0.3)  # in the worker's prefetch thread, as a slow store read
        return real(self, target)

    monkeypatch.setattr(WeightPrefetch, "fetch", slow_fetch)  # in-process workers
    result = train(_quick("async"), client=local_cluster, run_dir=tmp_path / "async",
                   progress=False, eval_seeds=0)
    _adds_up(result)
    samples = read_samples(result.run_dir)
    oldest: dict[str, int] = {}
    for gid, v in zip(samples["group_id"].to_pylist(), samples["version"].to_pylist()):
        if v >= 0:
            oldest[gid] = min(v, oldest.get(gid, v))
    launches = [(f"g{i:06d}", n) for i, n in _launch_order(result.run_dir)]
    late = [(g, n, oldest[g]) for g, n in launches if g in oldest and oldest[g] < n]
    assert not late, late  # (group, updates published before it started, its oldest)
    assert all(r["traj/dropped"] == 0 for r in result.metrics)


def test_areal_never_aborts_and_starts_no_group_beyond_its_bound(local_cluster, tmp_path):
    graph = _quick("areal", redundancy=1.5)
    result = train(graph, client=local_cluster, run_dir=tmp_path / "areal", progress=False,
                   eval_seeds=0)
    rows = result.metrics
    _adds_up(result)
    alpha, per_step = graph.algo.alpha, graph.algo.groups_per_step
    assert all(r["traj/aborted"] == 0 and r["rollout/aborted_now"] == 0 for r in rows)
    assert all(r["traj/dropped"] == 0 for r in rows)  # stale or not, admitted is trained
    launches = _launch_order(result.run_dir)
    assert len(launches) >= 3 * per_step
    # AReaL's bound: group i starts only while i < (version + alpha + 1) * groups_per_step
    assert all(i < (v + alpha + 1) * per_step for i, v in launches), launches
    # ... and rollout ran ahead of the trainer: it used the room the bound gives
    assert any(i >= (v + 1) * per_step for i, v in launches), launches
    assert _trained(result.run_dir).num_rows == 3 * 3 * 2
    assert all("trainer/staleness_max" in r for r in rows)  # reported, may exceed alpha


def _nice_of_threads() -> set:
    import os

    out = set()
    for t in os.listdir("/proc/self/task"):
        try:  # a thread may end between the listing and the read (seen in CI)
            out.add(os.getpriority(os.PRIO_PROCESS, int(t)))
        except ProcessLookupError:
            pass
    return out


def _start_a_thread() -> None:
    import threading
    import time

    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()


def test_rollout_processes_on_the_trainers_host_yield_the_cpu_to_it_and_get_it_back():
    """``rollart.runtime.priority``: on a process cluster every worker but the trainer's
    gets nice 10 on all its threads; the driver and the trainer keep theirs. When the
    run ends (``give_back``) every thread of theirs, one started meanwhile included, has
    the nice value it had, so the next run on the cluster starts as the first did."""
    from distributed import Client, LocalCluster

    from rollart.runtime.priority import ROLLOUT_NICE, give_back, yield_to_trainer

    before = _nice_of_threads()
    with LocalCluster(n_workers=3, threads_per_worker=2, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        trainer, *rollout = sorted(client.scheduler_info()["workers"])
        at_start = client.run(_nice_of_threads)
        yielded = yield_to_trainer(client, trainer)
        assert sorted(yielded) == rollout
        client.run(_start_a_thread, workers=rollout)  # inherits nice 10
        nice = client.run(_nice_of_threads)
        assert nice[trainer] == before and _nice_of_threads() == before
        assert all(nice[a] == {ROLLOUT_NICE} for a in rollout)
        assert give_back(client, yielded) == []  # root here, as in CI
        assert client.run(_nice_of_threads) == at_start


def test_an_in_process_cluster_is_left_alone(local_cluster):
    from rollart.runtime.priority import yield_to_trainer

    before = _nice_of_threads()
    trainer = sorted(local_cluster.scheduler_info()["workers"])[0]
    assert yield_to_trainer(local_cluster, trainer) == {} and _nice_of_threads() == before


def test_an_async_run_with_keep_weight_updates_trains(local_cluster, tmp_path):
    """Policy.weight_update="keep" through --set, on a real (in-process) cluster: no
    context is re-prefilled after a swap, and the trained rows are sound: each row's
    version is its oldest generated token's (the one staleness is judged by), within the
    bound, whatever versions its later tokens carry."""
    from rollart.config.overrides import apply_overrides

    graph = apply_overrides(_quick("async"), ["policy.weight_update=keep"])
    assert graph.policy.worker_options()["engine_options"]["weight_update"] == "keep"
    result = train(graph, client=local_cluster, run_dir=tmp_path / "keep", progress=False,
                   eval_seeds=0)
    _adds_up(result)
    # swaps mid-generation happen here (timing decides how many; the recompute mode
    # re-prefilled hundreds of tokens in this run), none re-prefills anything
    assert all(r["rollout/recompute_tokens"] == 0 for r in result.metrics)
    trained = _trained(result.run_dir)
    assert trained.num_rows == 3 * 3 * 2
    for versions, mask, version, step in zip(
            trained["versions"].to_pylist(), trained["loss_mask"].to_pylist(),
            trained["version"].to_pylist(), trained["trained_step"].to_pylist()):
        gen = [v for v, m in zip(versions, mask) if m]
        assert version == min(gen) and step - 2 <= version <= step - 1, (gen, step)
