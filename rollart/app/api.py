"""Driving a run from a connected Dask ``Client`` (a notebook, a script, a remote cluster).

>>> # from distributed import Client; import rollart
>>> # client = Client("tcp://scheduler:8786")        # or Client(cluster)
>>> # run = rollart.start_run(client, "gridnav", steps=40)
>>> # run.progress()                                 # live widget in a notebook
>>> # run.metrics().tail()                           # pandas DataFrame, one row per step
>>> # run.stop(); run.wait()                          # graceful: finishes the step, saves
>>> # run.samples().to_pandas()                      # the Arrow/Parquet trajectories

``start_run`` runs ``rollart.train`` in a background thread of this process, so the
client stays free; the run's live figures go to the scheduler's ``/rollart`` page.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rollart.control.loop import RunResult, execute
from rollart.control.prepare import Prepared, prepare
from rollart.observe.metrics import request_stop
from rollart.observe.monitor import install
from rollart.observe.report import read_metrics


class Run:
    """A run started by ``start_run``; every method is safe while it runs."""

    def __init__(self, client, run_dir: Path, steps: int):
        self.client, self.run_dir, self.steps = client, Path(run_dir), steps
        self.name = self.run_dir.name
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<rollart.Run {self.name} {self.status}: {self.step}/{self.steps} steps>"

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.result is not None:
            return "stopped" if len(self.result.metrics) < self.steps else "finished"
        return "running"

    @property
    def step(self) -> int:
        rows = self.rows()
        return rows[-1]["step"] if rows else 0

    @property
    def dashboard_link(self) -> str | None:
        link = getattr(self.client, "dashboard_link", None)
        return link.rsplit("/", 1)[0] + "/rollart" if link else None

    def rows(self) -> list[dict]:
        try:
            return read_metrics(self.run_dir)
        except FileNotFoundError:
            return []

    def metrics(self):
        """One row per trainer step as a pandas ``DataFrame`` indexed by ``step``."""
        import pandas as pd

        df = pd.DataFrame(self.rows())
        return df.set_index("step") if "step" in df else df

    def samples(self, columns: list[str] | None = None):
        """The latest state of every trajectory so far (``rollart.buffer.read_samples``:
        the ``samples/`` parts and the buffer's journal) as a ``pyarrow.Table``."""
        from rollart.buffer import read_samples

        table = read_samples(str(self.run_dir))
        return table.select(columns) if columns else table

    def stop(self) -> None:
        """Stop after the current trainer step (during the format warm-up: after its
        current warm-up step, with no RL step): the model is saved, samples flushed."""
        request_stop(self.name)

    def scale(self, pool: str, n: int) -> None:
        """Run ``n`` workers in ``pool`` from the next trainer step on: a ``Pool.name``
        of the cluster rollart made (``"env"``, ``"infer-h20"``), or a resource tag
        (``"CPU_ENV"``) on any cluster. Workers added are routed to as they join; workers
        removed are drained first (``rollart.control.scaling``). The console and
        ``recovery.json`` say what was done, or why not."""
        from rollart.control.scaling import request_scale

        request_scale(self.name, pool, n)

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends; returns its ``RunResult`` (re-raises its error)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"run {self.name} still running after {timeout}s")
        if self.error is not None:
            raise self.error
        return self.result

    def done(self) -> bool:
        return not self._thread.is_alive()

    def progress(self, interval: float = 1.0):
        """A live progress widget (ipywidgets) or, without ipywidgets, a text line."""
        from rollart.observe.widget import progress_widget

        return progress_widget(self, interval)

    def _target(self, prep: Prepared, kwargs) -> None:
        try:
            self.result = execute(prep, client=self.client, **kwargs)
        except BaseException as e:  # noqa: BLE001 - kept for wait()
            self.error = e


def start_run(client, graph=None, *, steps: int | None = None, run_dir=None,
              eval_seeds: int = 0, overwrite: bool = False, model: str | None = None,
              weights: str | None = None, progress: bool = False, **settings) -> Run:
    """Start ``graph`` on the cluster behind ``client`` and return at once.

    ``graph``/``steps``/``settings`` are ``rollart.train``'s (``seed``, ``alpha``, ``mode``,
    ``model``, ``resume``, ``overrides=["algo.lr=1e-4"]``, ``report_to="tensorboard"``).
    Held-out evaluation is off by default here (``eval_seeds=0``). Everything ``train``
    checks before a cluster is used is checked here, before anything starts
    (``rollart.control.prepare.prepare``): a ``run_dir`` that already holds a run raises
    ``RunDirError`` unless ``overwrite=True`` (its outputs are deleted) or
    ``resume=run_dir``.
    """
    prep = prepare(graph, client=client, steps=steps, run_dir=run_dir, overwrite=overwrite,
                   weights=weights, **settings)
    install(client)
    run = Run(client, prep.run_dir, prep.graph.steps)
    run._thread = threading.Thread(target=run._target, name=f"rollart-run-{run.name}",
                                   args=(prep, dict(model=model, weights=weights,
                                                    progress=progress,
                                                    eval_seeds=eval_seeds)),
                                   daemon=True)
    run._thread.start()
    return run


def wait_for_step(run: Run, step: int, timeout: float = 300) -> None:
    """Block until ``run`` has logged ``step`` (or ended); for scripts and tests."""
    deadline = time.time() + timeout
    while run.step < step and not run.done():
        if time.time() > deadline:
            raise TimeoutError(f"run {run.name} did not reach step {step} in {timeout}s")
        time.sleep(0.2)
