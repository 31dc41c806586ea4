"""benchmarks/lora_chat.py runs tiny (one seed, 3 RL steps, 8 held-out seeds: full
fine-tuning and LoRA on the chat graph) and reports figures that make sense; its full
run is a script, not a test (docs/how-to/lora.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.bench
@pytest.mark.slow
def test_lora_chat_tiny():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_chat.py"),
                          "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    r = {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    assert r["seeds"] == 1
    # the adapter (rank 16 on every linear layer of the chat toy) is a small part of
    # the model, and both sides published every step
    assert 0 < r["bytes_ratio"] < 0.5 and r["mib_per_version_full"] > 0
    for side in ("full", "lora"):
        assert r[f"wall_min_{side}"] > 0 and r[f"rl_step_s_{side}"] > 0
        assert 0 <= r[f"tasks_ok_{side}"] <= 4
    assert {k for k in r if k.startswith("median_gain_")} == {
        f"median_gain_{t}_{s}" for t in ("boxpush", "calc", "gridnav", "guess")
        for s in ("full", "lora")}
