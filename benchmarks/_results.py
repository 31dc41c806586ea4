"""The results log of the benchmark scripts: one JSON line per invocation, appended to
``benchmarks/results/<script>.jsonl`` with its date, commit, load average before the
run and command (``record``), from which the docs' benchmark pages are generated
(``docs/gen_reference.py``). Imported by the scripts that record (``lora_chat.py``,
``trainer_gang.py``, ``agent_endpoint.py``, ``cluster_sim.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def commit() -> str:
    """The short hash of HEAD (``unknown`` without git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def record(script: str, started: str, load, fields: dict, argv=None) -> Path:
    """Append one run of ``benchmarks/<script>.py`` (``started``: its ISO date;
    ``load``: ``os.getloadavg()`` before it; ``argv``: its arguments, default
    ``sys.argv[1:]``) with ``fields`` to its log; returns the log's path."""
    path = RESULTS / f"{script}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    args = sys.argv[1:] if argv is None else list(argv)
    line = {"date": started, "commit": commit(), "load_before": load,
            "command": " ".join([f"{script}.py", *args]), **fields}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return path
