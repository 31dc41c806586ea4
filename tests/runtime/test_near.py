"""``resources/laptop.py``: env managers and the inference workers share one worker and
call each other directly (``rollart.runtime.near``), and a run still trains with
its accounting intact: redundant members cancelled mid-generation free their rows,
nothing cancelled reaches the trainer."""

from dataclasses import replace

import pytest

from rollart import GRPO, Graph, Policy, Rollout, load_resources, train
from rollart.runtime import near as near_module
from rollart.buffer import read_samples
from rollart.runtime.near import Near, near
from rollart.testing import check_run_record

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def laptop():
    from distributed import Client

    res = replace(load_resources("laptop"), processes=False, dashboard_address=":0")
    assert res.source.endswith("resources/laptop.py")
    with res.make_cluster() as cluster, Client(cluster) as client:
        yield client


def test_an_async_run_on_the_laptop_layout_trains_through_direct_calls(laptop, tmp_path):
    before = dict(near_module.calls)
    graph = Graph(name="t-laptop", tasks=("gridnav", "guess"), mode="async", steps=3,
                  policy=Policy(warmup_steps=10),
                  algo=GRPO(group_size=2, groups_per_step=3, alpha=1),
                  rollout=Rollout(redundancy=2.0))
    result = train(graph, client=laptop, run_dir=tmp_path / "run", progress=False,
                   eval_seeds=0)
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2, 3]
    check_run_record(result)
    assert rows[-1]["traj/cancelled"] > 0
    assert "cancelled" not in set(read_samples(result.run_dir)["state"].to_pylist())
    made = {k: v - before.get(k, 0) for k, v in near_module.calls.items()}
    # every turn went to a co-located inference worker; the buffer is on the trainer's
    # worker (BUFFER), off the worker that holds the envs, so deliveries cross to it
    assert made.get("generate", 0) >= rows[-1]["traj/trained"]
    assert made.get("put", 0) == 0
    # the rollout worker carries REWARD: rewards ran on its threads, never as tasks
    assert rows[-1]["rollout/rewards_here"] >= rows[-1]["traj/trained"]
    assert rows[-1]["rollout/reward_tasks"] == 0


def _kind(actor):
    return type(near(actor)).__name__


def test_near_is_the_handle_elsewhere(laptop):
    from rollart.buffer import SampleBuffer
    from rollart.testing import unique_key
    from rollart.types import CPU_ENV, TRAIN

    buf = laptop.submit(SampleBuffer, None, actor=True, resources={CPU_ENV: 1},
                        key=unique_key("near-buf")).result()
    assert near(buf) is buf  # in the client: no worker
    assert laptop.submit(_kind, buf, resources={CPU_ENV: 1}, pure=False).result() == "Near"
    assert laptop.submit(_kind, buf, resources={TRAIN: 1}, pure=False).result() == "Actor"
    assert Near.__reduce__(Near(buf, object()))[1][0] is buf  # travels as the handle
