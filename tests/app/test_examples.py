"""Every example runs, with tiny settings."""

import doctest
import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quickstart_runs(tmp_path):
    # 4 held-out seeds, not the script's 32: the evaluation (warm-up and trained policy)
    # took half the test's time, and 4 check it as well
    result = _load("quickstart").main(steps=2, warmup_steps=5, run_dir=str(tmp_path / "q"),
                                      processes=False, eval_seeds=4)
    assert len(result.metrics) == 2 and (tmp_path / "q" / "reward.png").exists()
    assert result.evaluation["seeds"] == 4
    assert set(result.evaluation["trained"]) == {"gridnav"}


@pytest.mark.slow
def test_custom_task_mixes_with_builtin(tmp_path):
    from dataclasses import replace

    from distributed import Client

    import rollart

    mod = _load("custom_task")
    assert doctest.testmod(mod).failed == 0
    g = mod.graph(steps=2)
    g = replace(g, policy=replace(g.policy, warmup_steps=5))
    res = rollart.load_resources()
    res = replace(res, processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = rollart.train(g, client=client, run_dir=tmp_path / "c", eval_seeds=4,
                               progress=False)
    assert set(result.evaluation["trained"]) == {"ladder", "boxpush"}
    assert any("reward/ladder" in row for row in result.metrics)
    assert result.metrics[-1]["traj/failed"] == 0
