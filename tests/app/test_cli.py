"""The ``rollart`` command: bad input gives one clear line and exit status 2, before any
cluster starts; ``report`` redraws a run's reward curve."""

import json
import os
import subprocess
import sys

import pytest

from rollart.app.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["train", "graphs/nope.py"], "no graphs file 'graphs/nope.py'"),
    (["train", "--resources", "nowhere"], "no resources file 'nowhere'"),
    (["train", "--model", "/no/such/model"], "/no/such/model"),
])
def test_bad_input_is_one_clear_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollart: error:") and needle in err



@pytest.fixture(autouse=True)
def _dask_logging_restored():
    """``main`` runs ``quiet``, which sets ``DASK_LOGGING__DISTRIBUTED`` in this process
    (``info`` with ``--verbose``): put it back after each test, or later tests' worker
    processes and notebook kernels inherit Dask's INFO logs (tests/app/test_notebooks.py
    failed on them after the --verbose tests ran)."""
    saved = os.environ.get("DASK_LOGGING__DISTRIBUTED")
    yield
    if saved is None:
        os.environ.pop("DASK_LOGGING__DISTRIBUTED", None)
    else:
        os.environ["DASK_LOGGING__DISTRIBUTED"] = saved

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


def test_mode_sync_with_alpha_is_an_error(capsys):
    assert main(["train", "gridnav", "--mode", "sync", "--alpha", "2"]) == 2
    err = capsys.readouterr().err
    assert "GRPO.alpha=2 contradicts mode='sync'" in err and "drop --alpha" in err


def test_train_refuses_a_run_dir_that_holds_a_run(tmp_path, tiny_model, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "graph.json").write_text('{"name": "first"}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    argv = ["train", "gridnav", "--steps", "1", "--model", str(tiny_model), "--run-dir",
            str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--resume {run}" in err and "--overwrite" in err and "new --run-dir" in err
    assert (run / "graph.json").read_text() == '{"name": "first"}'  # nothing touched
    assert main([*argv, "--overwrite", "--resume", str(run)]) == 2
    assert "pass one of them" in capsys.readouterr().err


@pytest.mark.slow
def test_second_run_in_the_same_dir(local_cluster, tiny_model, tmp_path):
    """Re-using a run directory hung after two steps (the first run's weight versions
    outranked the new ones). Now refused at once from ``start_run``; ``overwrite=True``
    starts clean and the run completes."""
    from dataclasses import replace

    from rollart import GRPO, Graph, Policy, Rollout
    from rollart.app.api import start_run
    from rollart.config.preflight import RunDirError
    from rollart.observe.report import read_metrics
    from rollart.types import H800
    from rollart.weights import WeightStore

    g = Graph(name="again", tasks=("gridnav",), steps=6,
              policy=Policy(model=str(tiny_model), warmup_steps=0),
              algo=GRPO(group_size=2, groups_per_step=2),
              rollout=Rollout(inference_pools=(H800,)))
    run_dir = tmp_path / "run"
    start_run(local_cluster, g, run_dir=run_dir).wait(300)
    with pytest.raises(RunDirError, match="already holds a run .*--overwrite"):
        start_run(local_cluster, replace(g, steps=4), run_dir=run_dir)
    with pytest.raises(RunDirError, match="weight store .* already holds versions 4..6"):
        start_run(local_cluster, replace(g, steps=4), run_dir=tmp_path / "other",
                  weights=str(run_dir / "weights"))
    run = start_run(local_cluster, replace(g, steps=4), run_dir=run_dir, overwrite=True)
    result = run.wait(240)  # the hang: two steps, then no progress
    assert [r["step"] for r in result.metrics] == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert WeightStore(str(run_dir / "weights")).versions() == [2, 3, 4]
    # where the time went: this run's four steps, no warm-up (a model folder was given)
    t = result.timings
    assert json.loads((run_dir / "timings.json").read_text()) == t
    assert t["rl_steps"] == 4 and t["warmup_s"] == 0 and 0 < t["rl_s"] < t["total_s"]


def test_eval_on_a_folder_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["eval", str(tmp_path)]) == 2
    assert "has no config.json: it is not a Hugging Face model folder" in \
        capsys.readouterr().err
    run = tmp_path / "run"  # a run dir whose training never saved model/
    run.mkdir()
    from rollart.config.graph import load_graph

    (run / "graph.json").write_text(json.dumps(
        {"source": "gridnav", **load_graph("gridnav")[0].to_dict()}))
    assert main(["eval", str(run)]) == 2
    assert f"{run / 'model'}" in capsys.readouterr().err


def test_samples_of_a_missing_run(tmp_path, capsys):
    assert main(["samples", str(tmp_path / "nope")]) == 2
    assert "no run directory" in capsys.readouterr().err


def test_quiet_turns_dask_info_off_and_verbose_on(monkeypatch):
    import logging

    from rollart.app.cli import quiet

    monkeypatch.delenv("DASK_LOGGING__DISTRIBUTED", raising=False)
    quiet()
    assert logging.getLogger("distributed.scheduler").getEffectiveLevel() == logging.WARNING
    monkeypatch.delenv("DASK_LOGGING__DISTRIBUTED", raising=False)
    quiet(verbose=True)
    assert logging.getLogger("distributed.worker").getEffectiveLevel() == logging.INFO
    monkeypatch.setenv("DASK_LOGGING__DISTRIBUTED", "error")  # the user's own setting wins
    quiet()
    assert logging.getLogger("distributed.nanny").getEffectiveLevel() == logging.ERROR
    monkeypatch.delenv("DASK_LOGGING__DISTRIBUTED", raising=False)
    quiet()


def test_cluster_start_shows_progress(capsys):
    """The first seconds of a run: a line naming the workers, a bar of workers
    connected, and the time it took (a real SpecCluster, in-process workers)."""
    from dataclasses import replace

    from rollart.control.prepare import connect
    from rollart.runtime.resources import load_resources

    res = replace(load_resources(), processes=False, dashboard_address=":0")
    n = sum(p.workers for p in res.pools)
    with connect(res, progress=True) as client:
        assert len(client.scheduler_info()["workers"]) == n
    err = capsys.readouterr().err
    assert f"rollart: starting a local Dask cluster ({n} workers: H800×1" in err
    assert f"{n}/{n}" in err and "starting Dask workers" in err and ": done in " in err


# a graph file whose env returns None from reset: the warm-up (on the trainer's worker)
# stops with a WarmupEnvError, which reaches the CLI as one
BAD_ENV_GRAPH = '''
from rollart import GRPO, Graph, Policy, Rollout, Task
from rollart.types import H800


class NoneResetEnv:
    def reset(self, seed):
        return None

    def step(self, action):
        raise RuntimeError("never stepped")

    def close(self):
        pass


def reward(episode):
    return 0.0


def action(rng, observation):
    return "go"


def words():
    return ["go", "stop"]


def graph():
    task = Task(name="bad", env_factory=NoneResetEnv, reward_fn=reward, max_turns=2,
                warmup_action=action, vocabulary=words)
    return Graph(name="bad", tasks=(task,), steps=1,
                 policy=Policy(warmup_steps=1, warmup_batch=2),
                 algo=GRPO(group_size=2, groups_per_step=1),
                 rollout=Rollout(inference_pools=(H800,)))
'''

IN_PROCESS = '''
from dataclasses import replace

from rollart.runtime.resources import load_resources


def resources():
    return replace(load_resources(), processes=False, dashboard_address=":0")
'''


def test_an_env_error_in_the_warm_up_is_one_line_and_exit_2(tmp_path, capsys):
    """Raised on the trainer's worker (an in-process cluster: seconds), re-raised by Dask
    as its own class: one line, status 2; the traceback only with ``--verbose``."""
    graph, res = tmp_path / "bad_env.py", tmp_path / "inproc.py"
    graph.write_text(BAD_ENV_GRAPH)
    res.write_text(IN_PROCESS)
    argv = ["train", str(graph), "--resources", str(res), "--eval-seeds", "0",
            "--no-progress", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("rollart: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "warm-up of task 'bad'" in lines[0] and "reset returned NoneType" in lines[0]
    assert "Policy.warmup_steps=0" in lines[0]
    assert main(["--verbose", *argv, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "WarmupEnvError: warm-up of task 'bad'" in err


def test_verbose_shows_the_traceback_of_a_user_error(capsys):
    assert main(["--verbose", "train", "graphs/nope.py"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "GraphError: no graphs file 'graphs/nope.py'" in err
    assert main(["train", "graphs/nope.py", "--verbose"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_template_that_cannot_show_the_tools_ends_the_cli_cleanly(tmp_path, capsys):
    """The start check runs before a cluster starts: one line, status 2."""
    from rollart.testing import CHATML_SPECIALS, bpe_tokenizer, save_folder, tiny_qwen2

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = bpe_tokenizer(CHATML_SPECIALS, template, eos="<|im_end|>", pad="<|endoftext|>")
    folder = save_folder(tmp_path / "model", tiny_qwen2(tok), tok)
    graph = tmp_path / "calc_chat.py"
    graph.write_text("from rollart import Graph, Policy\n"
                     "from rollart.env.adapters.tool import calc_tool_task\n"
                     "def graph():\n"
                     "    return Graph(name='c', tasks=(calc_tool_task(tool_format='hermes'),),"
                     " policy=Policy(conversation='chat'))\n")
    argv = ["train", str(graph), "--model", folder, "--run-dir", str(tmp_path / "run"),
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollart: error: task 'calc' declares")
    assert "tools_in_prompt=True" in err


def test_status_of_a_scheduler_that_is_not_there_is_one_line_and_exit_2(capsys):
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", "--scheduler", f"tcp://127.0.0.1:{port}", "--timeout", "1s"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"rollart: error: cannot connect to the Dask scheduler at "
                          f"tcp://127.0.0.1:{port}")

