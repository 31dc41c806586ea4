"""Every example runs, with tiny settings."""

import doctest
import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quickstart_runs(tmp_path):
    result = _load("quickstart").main(steps=3, warmup_steps=20, run_dir=str(tmp_path / "q"),
                                      processes=False)
    assert len(result.metrics) == 3 and (tmp_path / "q" / "reward.png").exists()
    assert set(result.evaluation["trained"]) == {"gridnav"}


@pytest.mark.slow
def test_custom_task_mixes_with_builtin(tmp_path):
    from dataclasses import replace

    from distributed import Client

    import rollart

    mod = _load("custom_task")
    assert doctest.testmod(mod).failed == 0
    g = mod.graph(steps=3)
    g = replace(g, policy=replace(g.policy, warmup_steps=20))
    res = rollart.load_resources()
    res = replace(res, processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = rollart.train(g, client=client, run_dir=tmp_path / "c", eval_seeds=8,
                               progress=False)
    assert set(result.evaluation["trained"]) == {"ladder", "boxpush"}
    assert any("reward/ladder" in row for row in result.metrics)
    assert result.metrics[-1]["traj/failed"] == 0
