"""The docs site builds with ``--strict`` (links, anchors, the generated reference pages),
as .ci/run builds it; the ``docs`` extra (in ``test``) brings MkDocs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for page in ("reference/config", "reference/cli", "reference/parquet", "reference/api",
                 "benchmarks/results", "benchmarks/history"):
        assert (tmp_path / "site" / page / "index.html").exists(), page
    config = (tmp_path / "site/reference/config/index.html").read_text()
    assert "staleness bound" in config and "GPUs of each worker" in config
