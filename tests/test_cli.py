"""The ``rollart`` command: bad input gives one clear line and exit status 2, before any
cluster starts; ``report`` redraws a run's reward curve."""

import json
import subprocess
import sys

import pytest

from rollart.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["train", "graphs/nope.py"], "no graphs file 'graphs/nope.py'"),
    (["train", "--resources", "nowhere"], "no resources file 'nowhere'"),
    (["train", "--model", "/no/such/model"], "/no/such/model"),
])
def test_bad_input_is_one_clear_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollart: error:") and needle in err


def test_graph_module_without_graph(tmp_path, capsys):
    f = tmp_path / "empty.py"
    f.write_text("X = 1\n")
    assert main(["train", str(f)]) == 2
    assert "defines no graph() function" in capsys.readouterr().err


def test_unknown_task_in_graph(tmp_path, capsys):
    f = tmp_path / "g.py"
    f.write_text("from rollart import Graph\ndef graph():\n"
                 "    return Graph(name='g', tasks=('chess',))\n")
    assert main(["train", str(f)]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'chess'" in err and "gridnav" in err


def test_model_folder_missing_weights(tmp_path, tiny_model, capsys):
    import shutil

    broken = tmp_path / "m"
    shutil.copytree(tiny_model, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    assert main(["train", "gridnav", "--model", str(broken)]) == 2
    assert "weights" in capsys.readouterr().err


def test_report_redraws_reward_png(tmp_path, capsys):
    rows = [{"step": i, "reward/gridnav": i / 10, "reward/guess": 0.2} for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "reward.png").stat().st_size > 1000
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "rollart", "train", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--resources", "--steps", "--model", "--seed", "--alpha", "--run-dir"):
        assert flag in out
