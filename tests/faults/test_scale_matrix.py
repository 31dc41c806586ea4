"""The kill matrix's scale cells (issue 52): a pool of a running job resized on a cluster
of worker processes, audited apart from the ledger.

Each cell is one run of ``benchmarks/elastic.py`` (``resources/local.py``'s layout, worker
processes, two tasks whose every env writes its own record) at a small size:

- the decode pool (``infer-h20``) 1 -> 2 -> 1 through ``Run.scale``;
- the env pool 1 -> 3 -> 1 through ``Run.scale``;
- a ``dask worker --resources H20=1`` started by hand joining the decode pool mid-run,
  then retired by tag (``Run.scale("H20", 1)``), exiting on its own;
- the trainer's pool 1 -> 2 -> 1: a one-process trainer becomes a two-rank gang with its
  state and back (``rollart.control.resize``).

The script fails unless the pool was resized as asked, every new worker did work, and a
hand-started worker exited cleanly once retired; the audit of ``benchmarks/chaos.py``
(the envs' own record, the Parquet rows, the trainer's batch digests: not the ledger or
the journal) must find nothing lost and nothing duplicated.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.matrix]

ROOT = Path(__file__).resolve().parents[2]

#: (pool, the size it grows to, grown by hand-started workers)
CELLS = [("infer-h20", 2, False), ("env", 3, False), ("infer-h20", 2, True),
         ("trainer", 2, False)]


@pytest.mark.parametrize("pool,to,hand", CELLS,
                         ids=[f"{p}-1-{n}-1{'-by-hand' if h else ''}" for p, n, h in CELLS])
def test_a_pool_resized_mid_run_loses_and_duplicates_nothing(pool, to, hand):
    args = [sys.executable, str(ROOT / "benchmarks" / "elastic.py"), "--no-record",
            "--pool", pool, "--to", str(to), "--steps", "60", "--up-at", "4",
            "--down-at", "10", "--during", "3"] + (["--hand"] if hand else [])
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    r = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert r["lost"] == "0" and r["duplicated"] == "0", line
    assert r["groups_left_by_shrink"] == "0", line  # drained: nothing handed out again
    assert int(r["grow_step"]) <= int(r["joined_step"]) <= int(r["shrink_step"]), line
    assert r["processes"] == "1" and r["to"] == str(to) and r["hand"] == str(int(hand)), line
