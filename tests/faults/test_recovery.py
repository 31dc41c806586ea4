"""Lost workers mid-run (rollart.control.supervisor): an env worker, an inference worker and the
trainer's worker die during one short async run on an in-process tagged cluster; the run
completes, every lost actor is replaced, the ledger adds up with nothing left in flight,
and no trajectory is trained twice."""

import re
import threading
import time

import pyarrow.compute as pc
import pytest

from rollart import GRPO, Graph, Policy, Rollout, train
from rollart.buffer import read_samples
from rollart.chaos.faults import Faults, with_faults
from rollart.control.supervisor import lose_worker
from rollart.runtime.resources import Pool, Resources, workers_with
from rollart.types import BUFFER, CPU_ENV, H20, H800, REWARD, TRAIN
from rollart.testing import check_run_record

pytestmark = pytest.mark.slow


def chaos_resources() -> Resources:
    """Like resources/local.py, but two env workers; the buffer (BUFFER) on the reward
    worker, so the trainer's loss below is the trainer's alone (test_stages.py loses the
    buffer)."""
    return Resources(pools=(
        Pool("infer-h800", tag=H800, kind="compute_gpu"),
        Pool("infer-h20", tag=H20, kind="bandwidth_gpu"),
        Pool("env", tag=CPU_ENV, kind="cpu_env", workers=2),
        Pool("reward", tag=REWARD, kind="reward", threads=2, extra_tags={BUFFER: 1}),
        Pool("trainer", tag=TRAIN, kind="trainer"),
    ), processes=False, dashboard_address=":0")


def _steps_done(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _killer(cluster, client, run_dir, plan, log):
    """Kill one worker of each role in ``plan`` [(after_step, tag)], in order."""
    for after, tag in plan:
        while _steps_done(run_dir) < after:
            time.sleep(0.05)
        addrs = workers_with(client, tag)
        addr = addrs[-1]
        log.append((tag, lose_worker(cluster, client, addr, restart_after=0.5)))


def run_losing_env_inference_and_trainer(tmp_path, name: str, **graph_kwargs):
    """A 7-step gridnav run (5% env failures, 1.5x redundancy, a checkpoint every 2
    steps) on ``chaos_resources`` in which an env, an H20 and the trainer's worker are
    killed after steps 1, 3 and 5; returns ``(result, killed)``. Also used by
    tests/faults/test_modes_recovery.py."""
    from distributed import Client

    faults = Faults(step=0.002, fail_prob=0.05, seed=1)
    graph = Graph(name=name, tasks=(with_faults("gridnav", faults),), steps=7,
                  checkpoint_every=2, policy=Policy(warmup_steps=0),
                  rollout=Rollout(env_step_timeout=2.0, redundancy=1.5), **graph_kwargs)
    killed: list = []
    with chaos_resources().make_cluster() as cluster, Client(cluster) as client:
        plan = [(1, CPU_ENV), (3, H20), (5, TRAIN)]
        t = threading.Thread(target=_killer, args=(cluster, client, tmp_path / "run",
                                                   plan, killed), daemon=True)
        t.start()
        result = train(graph, client=client, run_dir=tmp_path / "run", progress=False,
                       eval_seeds=0)
        t.join(5)
    return result, killed


def test_run_survives_losing_env_inference_and_trainer_workers(tmp_path):
    result, killed = run_losing_env_inference_and_trainer(
        tmp_path, "t-recovery", algo=GRPO(group_size=2, groups_per_step=3, alpha=1))
    assert [tag for tag, _ in killed] == [CPU_ENV, H20, TRAIN]
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, 8))
    check_run_record(result)  # the ledger against the trainer's reports and the rows
    roles = sorted(e["role"] for e in result.recovery)
    # every killed role was re-created (under load a role is sometimes re-created twice:
    # noted in the issue, the accounting below must hold either way)
    assert set(roles) == {"env", "inference", "trainer"}, result.recovery
    assert all(e["recovery_s"] >= 0 for e in result.recovery)
    trainer = next(e for e in result.recovery if e["role"] == "trainer")
    assert "checkpoint" in trainer["restored_from"]  # the step-4 checkpoint
    final = result.final_counts
    assert final["in_flight"] == 0  # nothing lost: every launch ended in a final state
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))["traj_id"].to_pylist()
    assert len(trained) == len(set(trained))  # no trajectory trained twice
    assert rows[-1]["version"] >= 6


def _chaos(tmp_path, *args) -> tuple[dict, str]:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "chaos.py"), *args,
                          "--run-dir", str(tmp_path)], cwd=root,
                         capture_output=True, text=True, timeout=560,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return dict(kv.split("=") for kv in line.split()[1:]), out.stdout


def _planted(chaos, tmp_path) -> dict:
    """The chaos run's audit again, on a copy with one of each fault planted: a step
    the trainer reports one more trajectory for than the rows hold, one env-finished
    episode of a seed the run never drew, and a trained row written again at another
    step."""
    import json
    import shutil

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from rollart.buffer.schema import read_parts

    run = tmp_path / "planted"
    shutil.copytree(tmp_path / "run", run)
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    metrics[0] = {**metrics[0], "trainer/batch_size": metrics[0]["trainer/batch_size"] + 1,
                  "trainer/batch_sha1": "0" * 16}
    events = chaos.read_env_log(tmp_path / "envs")
    events += [{"ev": "start", "task": "guess", "seed": -1},  # a single vanished episode
               {"ev": "end", "task": "guess", "seed": -1, "success": True}]
    parts = read_parts(str(run))
    row = parts.filter(pc.equal(parts["state"], "trained")).slice(0, 1)
    again = row.set_column(row.schema.get_field_index("trained_step"), "trained_step",
                           pa.array([10_000], pa.int32()))
    pq.write_table(again, run / "samples" / "part-zzzz-planted.parquet")
    return chaos.audit(run, metrics, events)


def _vanished_row(chaos, tmp_path) -> dict:
    """The audit on a copy whose rows lack one trajectory of a trained group that had
    exactly its size in rows (a trained group holds every member: nothing may excuse
    it): one lost."""
    import json
    import shutil
    from collections import Counter

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from rollart.buffer import read_samples
    from rollart.buffer.schema import read_parts

    run = tmp_path / "vanished"
    shutil.copytree(tmp_path / "run", run)
    events = chaos.read_env_log(tmp_path / "envs")
    table = read_parts(str(run))
    parts = table.to_pylist()
    rows = Counter((r["task"], r["seed"]) for r in read_samples(str(run)).to_pylist())
    pick = next(r for r in parts if r["state"] == "trained"
                and rows[(r["task"], r["seed"])] == 2)  # group_size 2: no row to spare
    kept = [r for r in parts if r["traj_id"] != pick["traj_id"]]
    for p in (run / "samples").glob("*.parquet"):
        p.unlink()
    pq.write_table(pa.Table.from_pylist(kept, schema=table.schema),
                   run / "samples" / "part-0000-kept.parquet")
    for p in (run / "pending").glob("**/*.parquet"):  # the journal's copy of its row
        entry = pq.read_table(p)
        pq.write_table(entry.filter(pc.invert(pc.equal(entry["traj_id"], pick["traj_id"]))),
                       p)
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return chaos.audit(run, metrics, events)


@pytest.mark.bench
def test_chaos_script_short(tmp_path):
    """The chaos soak (benchmarks/chaos.py), short, with the trainer's worker killed
    mid-step and one more worker killed: nothing lost, nothing trained twice, counted
    from the envs' own record, the rows and the trainer's report (not the ledger); and
    the same audit finds each kind of fault planted in a copy of the run."""
    import importlib.util
    import re
    import sys
    from pathlib import Path

    result, stdout = _chaos(tmp_path, "--steps", "5", "--seed", "2")
    assert result["lost"] == "0" and result["duplicated"] == "0", result
    assert result["lost_trained"] == "0" and result["lost_completed"] == "0", result
    assert result["ledger_lost"] == "0" and int(result["env_episodes"]) > 0, result
    assert result["trainer_mid_step"] == "1", stdout  # killed while its step ran
    assert float(result["max_recovery_s"]) < 120 and int(result["steps"]) >= 5
    assert re.search(r"killed \S+ \(TRAIN, \S+\) during step", stdout)
    assert len(re.findall(r"killed \S+ \(", stdout)) == 2
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"
    spec = importlib.util.spec_from_file_location("bench_chaos", path)
    chaos = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = chaos
    spec.loader.exec_module(chaos)
    planted = _planted(chaos, tmp_path)
    assert planted["lost_trained"] >= 1 and planted["lost_completed"] == 1, planted
    assert planted["duplicated"] >= 1, planted
    vanished = _vanished_row(chaos, tmp_path)
    assert vanished["lost_completed"] == 1, vanished


def test_chaos_run_outlasts_a_slow_restart(tmp_path):
    """The flake's cause (max_recovery_s=inf under load): the killed env worker came back
    after the run's last step had already finished on the surviving one, so no
    replacement was ever made. Forced here: it comes back 8 s after the kill at step 2
    of 3; the run goes on until the replacement exists, and reports its time. The
    trainer's worker is killed mid-step too (during step 2), restarting as slowly: the
    two kills raced in lose_worker (KeyError 'env-1', the env worker never came back)
    and a call on the closed trainer's worker then sat out Dask's connect time-out."""
    result, stdout = _chaos(tmp_path, "--steps", "3", "--seed", "2", "--restart-after", "8")
    assert result["killed"] == "CPU_ENV", result  # seed 2: an env worker after step 2
    assert len(re.findall(r"killed \S+ \(", stdout)) == 2, stdout
    assert 8 <= float(result["max_recovery_s"]) < 120, stdout
    assert int(result["steps"]) > 3 and result["lost"] == "0", result
    assert result["duplicated"] == "0" and result["trained_unreported"] == "0", result


def test_lose_worker_twice_at_once_while_the_cluster_forgets_lost_workers():
    """Two in-process workers lost at once (chaos.py's random kill beside its mid-step
    trainer kill), each restarted after a pause longer than the cluster's own
    ``distributed.deploy.lost-worker-timeout``: a ``SpecCluster`` drops a worker the
    scheduler lost from ``cluster.workers`` after that timeout, so ``lose_worker``'s
    restart found the name gone (``KeyError 'env-1'``, the killer thread died and the
    worker never came back). Both come back under their names, and the cluster closes."""
    import dask
    from distributed import Client

    res = Resources(pools=(Pool("env", tag=CPU_ENV, kind="cpu_env", workers=2),),
                    processes=False, dashboard_address=":0")
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "50ms"}), \
            res.make_cluster() as cluster, Client(cluster) as client:
        before = sorted(workers_with(client, CPU_ENV))
        names, errors = [], []

        def lose(addr):
            try:
                names.append(lose_worker(cluster, client, addr, restart_after=0.5))
            except Exception as e:  # noqa: BLE001 - the assertion below names it
                errors.append(repr(e))

        threads = [threading.Thread(target=lose, args=(a,)) for a in before]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and sorted(names) == sorted(cluster.worker_spec), errors
        client.wait_for_workers(2, timeout=60)
        after = sorted(workers_with(client, CPU_ENV))
        assert len(after) == 2 and not set(after) & set(before)
        assert sorted(cluster.workers) == sorted(cluster.worker_spec)


def test_close_bounded_says_what_kept_the_loop_from_stopping(caplog):
    """A task on an in-process cluster's loop that outlives every cancellation (as an
    actor's left on a worker closed in-process can) kept the loop's thread from stopping:
    the cluster's close raised a bare "join timed out". ``close_bounded`` closes the
    client and the cluster, and names the task that was still pending."""
    import asyncio
    import logging

    from distributed import Client

    from rollart.runtime.waits import close_bounded

    async def stubborn_env_call():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    res = Resources(pools=(Pool("env", tag=CPU_ENV, kind="cpu_env"),),
                    processes=False, dashboard_address=":0")
    cluster = res.make_cluster()
    client = Client(cluster)
    cluster.loop.add_callback(lambda: asyncio.ensure_future(stubborn_env_call()))
    with caplog.at_level(logging.WARNING, logger="rollart.runtime.waits"):
        close_bounded(client, cluster, seconds=60)
    assert str(cluster.status) == "Status.closed" and client.status == "closed"
    assert "stubborn_env_call" in caplog.text, caplog.text
