"""A member that crosses the staleness bound mid-episode, on a real in-process cluster
(inference workers, env manager, sample buffer, a tiny model): with
``stale_members="rescore"`` it keeps its first turns' tokens, re-scored under the new
weights; with ``"abort"`` it is aborted and run again from the start."""

import time

import pytest
import torch

from rollart.chaos.faults import Faults, with_faults
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.rescore import Rescorer, stale_positions
from rollart.env.tasks import Task
from rollart.env.trajectory import TokenLog
from rollart.reward import success_reward
from rollart.rollout import TorchEngine
from rollart.types import H800, ScoreResult
from rollart.weights import WeightStore


def _slow_task(name):
    """Three turns, each env step 0.4 s: a member is mid-episode for about a second."""
    task = Task(name=name, env_factory=GridNavEnv, reward_fn=success_reward, max_turns=3)
    return with_faults(task, Faults(step=0.4))


def _perturbed(model):
    eng = TorchEngine(model)
    g = torch.Generator().manual_seed(11)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in eng.state_dict().items()}
    eng.load_state_dict(new, 1)  # the reference: the weights as an engine holds them
    return new, eng


def _generated(traj):
    return [i for i, m in enumerate(traj.loss_mask) if m]


@pytest.mark.parametrize("mode", ["rescore", "abort"])
def test_a_member_crossing_the_bound_mid_episode(local_cluster, tiny_model, tmp_path,
                                                 rollout_actors, mode):
    store_dir = tmp_path / "weights"
    mgr, buf, _ = rollout_actors(local_cluster, tiny_model, store_dir, f"cross-{mode}",
                                 pools=(H800,), stale_members=mode, env_step_timeout=5.0)
    new, reference = _perturbed(tiny_model)
    fut = mgr.run_group(_slow_task(f"cross-{mode}"), 7, f"cross-{mode}", 2)
    time.sleep(0.6)  # both members generated their first turn at version 0, and step on
    WeightStore(str(store_dir)).put(1, new)  # the trainer published version 1 ...
    aborted = mgr.abort_older_than(1).result()  # ... and version 0 can no longer train
    summary = fut.result(timeout=120)
    assert len(summary["outcomes"]) == 2
    counts, stats = buf.counts().result(), mgr.stats().result()
    if mode == "abort":  # replacements start at once, maybe before v1 was loaded
        trajs = buf.get_batch(1, min_version=-1, timeout=10).result()
        assert aborted == 2 and counts["aborted"] == 2 and counts["launched"] == 4
        assert {t.traj_id for t in trajs} == {"cross-abort-2", "cross-abort-3"}  # re-run
        assert stats["wasted_tokens"] > 0 and stats.get("rescored_tokens", 0) == 0
        return
    trajs = buf.get_batch(1, min_version=1, timeout=10).result()  # fresh enough to train
    assert len(trajs) == 2
    for t in trajs:
        assert min(t.versions[i] for i in _generated(t)) >= 1
    # rescore: the original members, none aborted or restarted
    assert aborted == 0 and counts["aborted"] == 0 and counts["launched"] == 2
    assert {t.traj_id for t in trajs} == {"cross-rescore-0", "cross-rescore-1"}
    assert stats["rescored_members"] >= 2 and stats["rescore_failed"] == 0
    assert stats["rescored_members"] > stats["rescored_at_end"]  # some at a turn boundary
    assert stats["rescored_tokens"] > 0 and stats["wasted_tokens"] == 0
    for t in trajs:
        # every generated token's log-prob is version 1's now, the first turn's
        # re-scored ones included: the tiny model under v1 says the same
        ids = list(t.prompt_ids) + list(t.response_ids)
        gen = _generated(t)
        with torch.no_grad():
            logits = reference.model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        start = len(t.prompt_ids)
        want = [float(logp[start + i - 1, ids[start + i]]) for i in gen]
        assert [t.logprobs[i] for i in gen] == pytest.approx(want, abs=1e-3)
        assert t.num_turns >= 2


class _Proxy:
    """Answers re-scorings with a fixed version (a worker that did or did not load)."""

    def __init__(self, version):
        self.version, self.asked = version, []

    async def rescore(self, traj_id, req, pools=None, task=None, wait=0.0):
        self.asked.append(req)
        return ScoreResult([-1.0] * len(req.positions), self.version)


def test_rescorer_replaces_only_stale_tokens_and_refuses_a_worker_behind_the_floor():
    import asyncio

    log = TokenLog([1, 2])
    log.add_generation([5, 6], [-0.1, -0.2], [0, 0])
    log.add_observation([7])
    log.add_generation([8], [-0.3], [1])
    r = Rescorer(temperature=0.7)
    ok = asyncio.run(r.refresh(_Proxy(1), "t", "task", log))
    assert ok and r.counts["rescored_tokens"] == 0  # no floor yet: nothing to do
    r.raise_floor(1)
    r.raise_floor(0)  # a floor never goes down
    behind = _Proxy(0)
    assert not asyncio.run(r.refresh(behind, "t", "task", log))
    assert log.versions == [0, 0, -1, 1] and r.counts["rescore_failed"] == 1
    proxy = _Proxy(2)
    assert asyncio.run(r.refresh(proxy, "t", "task", log))
    req = proxy.asked[0]
    assert req.token_ids == [1, 2, 5, 6] and req.positions == [2, 3]
    assert req.min_version == 1 and req.temperature == 0.7
    assert log.versions == [2, 2, -1, 1] and log.logprobs == [-1.0, -1.0, 0.0, -0.3]
    assert stale_positions(log, 2) == [3]
