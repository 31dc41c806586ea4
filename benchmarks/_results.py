"""The results log of the benchmark scripts: one JSON line per invocation, appended to
``benchmarks/results/<script>.jsonl`` with its date, commit, load average before the
run and command (``record``), from which the docs' benchmark pages are generated
(``docs/gen_reference.py``: each page's "Latest records" and the results log page).

Every script that prints a ``RESULT`` line does it through ``Run``: ``run = Run(script,
args)`` when it starts (its date and the load average before it), ``run.result(figures,
details)`` at the end, which prints ``RESULT k=v ...`` and appends the record, unless the
run is ``--quick`` (a smoke run: the tests run every script so) or ``--no-record``
(``add_arguments`` adds that flag), or ``ROLLART_NO_RECORD`` is set in the environment
(the test suite sets it: its smoke runs of a script at other small sizes record nothing). ``details`` go to the record only (per-step lists,
per-seed rows)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_RECORD_ENV = "ROLLART_NO_RECORD"
RESULTS = ROOT / "benchmarks" / "results"


def commit() -> str:
    """The short hash of HEAD, with ``+dirty`` when tracked files differ from it (the run's
    code is then not that commit's); ``unknown`` without git. The records themselves
    (``benchmarks/results/``, appended by the runs before) do not count: a run's code is
    the same with them."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no",
                                "--", ".", ":(exclude)benchmarks/results"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
    except OSError:
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def record(script: str, started: str, load, fields: dict, argv=None,
           at: str | None = None) -> Path:
    """Append one run of ``benchmarks/<script>.py`` (``started``: its ISO date;
    ``load``: ``os.getloadavg()`` before it; ``argv``: its arguments, default
    ``sys.argv[1:]``; ``at``: the commit it ran, default ``commit()`` now) with
    ``fields`` to its log; returns the log's path."""
    path = RESULTS / f"{script}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    args = sys.argv[1:] if argv is None else list(argv)
    line = {"date": started, "commit": at or commit(), "load_before": load,
            "command": shlex.join([f"{script}.py", *args]), **_json_safe(fields)}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return path


def _json_safe(x):
    """NaN and infinities (a figure that could not be computed) as ``null``: JSON has
    neither."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def add_arguments(parser) -> None:
    """Add ``--no-record`` (print the RESULT line, append nothing) to a script's parser."""
    parser.add_argument("--no-record", action="store_true",
                        help="print the RESULT line without appending it to "
                             "benchmarks/results/<script>.jsonl")


def fill(args, preset: dict) -> None:
    """Set each of ``preset``'s settings on ``args`` that the command line left ``None``
    (a script's sizes: quick, full, a real model's), so a flag given wins."""
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.6g}"
    return str(value)


class Run:
    """One invocation of ``benchmarks/<script>.py`` (module docstring)."""

    def __init__(self, script: str, args=None, argv=None):
        import datetime

        self.script = script
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")
        self.load = [round(x, 2) for x in os.getloadavg()]
        self.commit = commit()  # the tree it starts on (a commit made meanwhile is not it)
        self.argv = sys.argv[1:] if argv is None else list(argv)
        self.recording = not (getattr(args, "quick", False) or getattr(args, "tiny", False)
                              or getattr(args, "no_record", False)
                              or os.environ.get(NO_RECORD_ENV))

    @staticmethod
    def line(figures: dict, fmt=None) -> str:
        """``RESULT k=v ...`` (floats to 4 significant digits, or ``fmt(value)``)."""
        return "RESULT " + " ".join(f"{k}={(fmt or _fmt)(v)}" for k, v in figures.items())

    def result(self, figures: dict, details: dict | None = None, fmt=None) -> Path | None:
        """Print the RESULT line of ``figures``; append the record (``figures`` and
        ``details``) unless the run does not record. Returns the log's path, if written."""
        print(self.line(figures, fmt), flush=True)
        if not self.recording:
            return None
        return record(self.script, self.started, self.load, {**(details or {}), **figures},
                      self.argv, self.commit)


class Kept:
    """A long benchmark's per-seed results kept under ``runs/bench-<script>/<name>/``
    (``runs/`` is not tracked), so an invocation cut short (a crash, a machine needed
    back, a session's end) goes on with ``--resume`` where it stopped: ``settings.json``
    says what the kept results are of (a resume with other settings is refused),
    ``before.json`` the figures measured once before any seed, ``s<seed>.json`` each
    finished seed, ``s<seed>.made.json`` the commit and date it was measured at; a seed
    cut short mid-run starts again from its beginning.

    ``runs/`` goes with its machine. So a script puts ``kept.record()`` in its record, and
    ``--resume`` with no kept folder reads the newest record of the same name and
    settings back from ``benchmarks/results/<script>.jsonl``: a series of seeds can span
    invocations on different machines, each seed paired within its own invocation, each
    carrying its own commit and date.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> k = Kept("x", "n", {"steps": 2}, resume=False, root=d, results=d)
    >>> k.before(lambda: {"t": 0.1}), k.seed(0, lambda folder: {"after": 0.5})
    ({'t': 0.1}, {'after': 0.5})
    >>> again = Kept("x", "n", {"steps": 2}, resume=True, root=d, results=d)
    >>> again.seed(0, lambda folder: 1 / 0)  # read back, never run again
    seed 0: read back from .../bench-x/n/s0.json
    {'after': 0.5}
    >>> Kept("x", "n", {"steps": 3}, resume=True, root=d, results=d)
    Traceback (most recent call last):
    ...
    SystemExit: --resume: ... holds runs of {'steps': 2}, not {'steps': 3}

    The machine gone (no ``runs/``), its record read back:

    >>> _ = (d / "x.jsonl").write_text(json.dumps({"date": "D", **k.record()}) + "\\n")
    >>> import shutil; shutil.rmtree(d / "bench-x")
    >>> elsewhere = Kept("x", "n", {"steps": 2}, resume=True, root=d, results=d)
    --resume: seeds 0 read back from x.jsonl (the record of D)
    >>> elsewhere.before(lambda: 1 / 0), elsewhere.seed(0, lambda folder: 1 / 0)
    seed 0: read back from .../bench-x/n/s0.json
    ({'t': 0.1}, {'after': 0.5})
    >>> elsewhere.record()["kept"]["made"]["0"] == k.record()["kept"]["made"]["0"]
    True
    >>> shutil.rmtree(d / "bench-x")  # a record of other settings is not read back
    >>> Kept("x", "n", {"steps": 3}, resume=True, root=d, results=d).record()["kept"]["seeds"]
    {}
    """

    def __init__(self, script: str, name: str, settings: dict, resume: bool,
                 root: Path = ROOT / "runs", results: Path = RESULTS):
        import shutil

        self.name, self.settings = name, json.loads(json.dumps(settings))
        self.folder = Path(root) / f"bench-{script}" / name
        marker = self.folder / "settings.json"
        if resume and marker.is_file():
            kept = json.loads(marker.read_text())
            if kept != self.settings:
                raise SystemExit(f"--resume: {self.folder} holds runs of {kept}, not "
                                 f"{settings}")
        else:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True)
            marker.write_text(json.dumps(self.settings))
            if resume:
                self._from_record(Path(results) / f"{script}.jsonl")

    def _from_record(self, log: Path) -> None:
        """Write the newest record's kept results of this name and settings back into
        the (new) folder."""
        lines = log.read_text().splitlines() if log.is_file() else []
        for line in reversed(lines):
            rec = json.loads(line)
            kept = rec.get("kept") or {}
            if kept.get("name") != self.name or kept.get("settings") != self.settings:
                continue
            if kept.get("before") is not None:
                (self.folder / "before.json").write_text(json.dumps(kept["before"]))
            for seed, value in kept.get("seeds", {}).items():
                (self.folder / f"s{seed}.json").write_text(json.dumps(value))
                made = kept.get("made", {}).get(seed)
                if made:
                    (self.folder / f"s{seed}.made.json").write_text(json.dumps(made))
            print(f"--resume: seeds {','.join(kept.get('seeds', {})) or 'none'} read back "
                  f"from {log.name} (the record of {rec.get('date')})", flush=True)
            return

    def before(self, measure) -> dict:
        """``measure()``'s figures, measured once and kept."""
        return self._once(self.folder / "before.json", measure)

    def seed(self, seed: int, run) -> dict:
        """Seed ``seed``'s result: read back if kept, else ``run(folder)`` (a fresh
        folder for its files) and kept, with the commit and date it started at."""
        import datetime
        import shutil

        done = self.folder / f"s{seed}.json"
        if done.is_file():
            print(f"seed {seed}: read back from {done}", flush=True)
            return json.loads(done.read_text())
        shutil.rmtree(self.folder / f"s{seed}", ignore_errors=True)
        made = {"commit": commit(), "date": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds")}
        value = self._once(done, lambda: run(self.folder / f"s{seed}"))
        (self.folder / f"s{seed}.made.json").write_text(json.dumps(made))
        return value

    def record(self) -> dict:
        """``{"kept": ...}``, for the invocation's record: the name, settings, figures
        before any seed and each finished seed with the commit and date it was made at,
        which a ``--resume`` elsewhere reads back."""
        read = lambda p: json.loads(p.read_text()) if p.is_file() else None  # noqa: E731
        seeds = sorted((int(p.stem[1:]), p) for p in self.folder.glob("s*.json")
                       if p.stem[1:].isdigit())
        return {"kept": {
            "name": self.name, "settings": self.settings,
            "before": read(self.folder / "before.json"),
            "seeds": {str(k): read(p) for k, p in seeds},
            "made": {str(k): read(self.folder / f"s{k}.made.json") for k, _ in seeds}}}

    @staticmethod
    def _once(path: Path, make) -> dict:
        if path.is_file():
            return json.loads(path.read_text())
        value = make()
        path.write_text(json.dumps(value))  # Python's JSON: inf and nan come back
        return value
