"""Experiment trackers: a run's figures in TensorBoard, MLflow or Weights & Biases, offline.

``--report-to tensorboard,mlflow,wandb`` (``rollart.train(..., report_to=...)``) picks
them; ``make_trackers`` checks that each one's package imports (else a ``TrackerError``
naming the extra to install) before any cluster starts. The control loop then calls,
on every tracker, ``start`` once (the graph and the resources as parameters),
``log_step`` after every trainer step with the very row ``metrics.jsonl`` gets, and
``finish`` at the end with the reward plot. Everything stays in the run directory and
off the network:

==============  ===========================  ============================================
tracker         extra                        where it writes
==============  ===========================  ============================================
tensorboard     ``rollart[tensorboard]``     ``RUN/tensorboard/`` event files
mlflow          ``rollart[mlflow]``          file store ``file://RUN/mlruns``
wandb           ``rollart[wandb]``           offline run under ``RUN/wandb/`` (sync later
                                             with ``wandb sync RUN/wandb/offline-run-*``)
==============  ===========================  ============================================

A new tracker is a ``Tracker`` subclass (hooks that do nothing by default, taking
``**kwargs``, as Dask's plugins do) listed in ``TRACKERS``. Only numeric, finite
figures are sent (``trainer/batch_sha1`` and NaNs stay in ``metrics.jsonl`` only).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class TrackerError(ValueError):
    """A tracker that is unknown or whose package is not installed."""


def scalars(row: dict) -> dict[str, float]:
    """The figures of a metrics row a tracker gets: numeric and finite, ``step`` aside.

    >>> scalars({"step": 3, "reward/a": 0.5, "trainer/batch_sha1": "ab", "x": float("nan")})
    {'reward/a': 0.5}
    """
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """Nested parameters as ``{"algo.lr": "0.0005", ...}`` (values as text).

    >>> flatten({"algo": {"lr": 0.1}, "tasks": ["a", "b"]})
    {'algo.lr': '0.1', 'tasks': 'a,b'}
    """
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = ",".join(str(x) for x in v)
        else:
            out[key] = str(v)
    return out


class Tracker:
    """Base class: every hook does nothing. Subclasses set ``name`` and ``package``."""

    name = "none"
    package = ""  # the module that must import (the extra is rollart[name])

    def start(self, run_dir: Path, run: str, params: dict, **kwargs) -> None:
        """Once, before step 1: ``params`` = ``{"graph": ..., "resources": ...}``."""

    def log_step(self, step: int, row: dict, **kwargs) -> None:
        """After every trainer step: ``row`` is the ``metrics.jsonl`` row."""

    def finish(self, reward_png: str | None = None, status: str = "finished",
               **kwargs) -> None:
        """Once at the end (``status`` finished / stopped / failed)."""


class TensorBoard(Tracker):
    """Event files under ``RUN/tensorboard`` (``tensorboard --logdir RUN/tensorboard``)."""

    name, package = "tensorboard", "tensorboard"

    def start(self, run_dir, run, params, **kwargs):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        for group, values in params.items():
            text = "\n".join(f"    {k} = {v}" for k, v in flatten(values).items())
            self.writer.add_text(group, text or "    (none)", 0)

    def log_step(self, step, row, **kwargs):
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self, reward_png=None, status="finished", **kwargs):
        if reward_png and Path(reward_png).is_file():
            import matplotlib.image

            img = matplotlib.image.imread(reward_png)[..., :3]  # HWC floats in [0, 1]
            self.writer.add_image("reward", img, dataformats="HWC")
        self.writer.add_text("status", status)
        self.writer.close()


class MLflow(Tracker):
    """One MLflow run in the file store ``file://RUN/mlruns`` (experiment ``rollart``;
    ``mlflow ui --backend-store-uri file://RUN/mlruns``)."""

    name, package = "mlflow", "mlflow"
    MAX_PARAM = 500  # characters of one parameter value (the store's limit is higher)

    def start(self, run_dir, run, params, **kwargs):
        # MLflow 3 keeps the file store behind this switch (its default is a database)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.uri = (Path(run_dir) / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name("rollart")
        exp_id = exp.experiment_id if exp else self.client.create_experiment("rollart")
        run_id = _saved_id(run_dir, self.name)
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=run).info.run_id
            _save_id(run_dir, self.name, run_id)
            from mlflow.entities import Param

            flat = {f"{g}.{k}": v[:self.MAX_PARAM] for g, values in params.items()
                    for k, v in flatten(values).items()}
            items = [Param(k, v) for k, v in flat.items()]
            for i in range(0, len(items), 100):  # the store takes 100 per batch
                self.client.log_batch(run_id, params=items[i:i + 100])
        self.run_id = run_id

    def log_step(self, step, row, **kwargs):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, reward_png=None, status="finished", **kwargs):
        if reward_png and Path(reward_png).is_file():
            self.client.log_artifact(self.run_id, str(reward_png))
        self.client.set_terminated(self.run_id, "FINISHED" if status != "failed" else
                                   "FAILED")


class WandB(Tracker):
    """A Weights & Biases run in offline mode under ``RUN/wandb`` (no network, no login;
    ``wandb sync`` uploads it later)."""

    name, package = "wandb", "wandb"

    def start(self, run_dir, run, params, **kwargs):
        root = Path(run_dir).resolve()
        for key, value in offline_env(root).items():
            os.environ[key] = value
        import uuid

        import wandb

        run_id = _saved_id(run_dir, self.name) or uuid.uuid4().hex[:12]
        _save_id(run_dir, self.name, run_id)
        settings = wandb.Settings(mode="offline", silent=True, console="off",
                                  disable_git=True, disable_code=True, save_code=False,
                                  x_disable_stats=True, x_disable_machine_info=True)
        self.run = wandb.init(project="rollart", name=run, id=run_id, resume="allow",
                              dir=str(root), config=params, settings=settings,
                              reinit="create_new")

    def log_step(self, step, row, **kwargs):
        self.run.log(scalars(row), step=step)

    def finish(self, reward_png=None, status="finished", **kwargs):
        if reward_png and Path(reward_png).is_file():
            import wandb

            self.run.log({"reward_plot": wandb.Image(str(reward_png))})
        self.run.finish(exit_code=1 if status == "failed" else 0)


def offline_env(root: Path) -> dict[str, str]:
    """The environment that keeps wandb offline, silent and inside ``root``."""
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true",
            "WANDB_QUIET": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
            "WANDB_DISABLE_CODE": "true", "WANDB_SAVE_CODE": "false",
            "WANDB_ERROR_REPORTING": "false",
            "WANDB_CONFIG_DIR": str(root / "wandb" / "config"),
            "WANDB_CACHE_DIR": str(root / "wandb" / "cache"),
            "WANDB_DATA_DIR": str(root / "wandb" / "data"),
            "WANDB_ARTIFACT_DIR": str(root / "wandb" / "artifacts")}


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoard, MLflow, WandB)}


def _ids_path(run_dir) -> Path:
    return Path(run_dir) / "trackers.json"


def _saved_id(run_dir, name: str) -> str | None:
    """The tracker run a resumed run continues (``RUN/trackers.json``)."""
    try:
        return json.loads(_ids_path(run_dir).read_text()).get(name)
    except (OSError, ValueError):
        return None


def _save_id(run_dir, name: str, run_id: str) -> None:
    try:
        ids = json.loads(_ids_path(run_dir).read_text())
    except (OSError, ValueError):
        ids = {}
    ids[name] = run_id
    _ids_path(run_dir).write_text(json.dumps(ids, indent=1))


def parse_report_to(report_to) -> list[str]:
    """``"tensorboard,mlflow"`` or a list -> names; ``None``/``"none"`` -> ``[]``."""
    if report_to is None:
        return []
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [str(n).strip().lower() for n in items if str(n).strip()]
    return [] if names in (["none"], []) else list(dict.fromkeys(names))


def make_trackers(report_to) -> "Trackers":
    """The trackers ``report_to`` names, their packages checked now (before a cluster
    starts): an unknown name or a missing package is a ``TrackerError`` saying what
    to change."""
    import importlib

    out = []
    for name in parse_report_to(report_to):
        cls = TRACKERS.get(name)
        if cls is None:
            raise TrackerError(f"--report-to {name}: unknown tracker; choose from "
                               f"{', '.join(TRACKERS)} (comma-separated)")
        try:
            importlib.import_module(cls.package)
        except ImportError as e:
            raise TrackerError(f"--report-to {name} needs the {cls.package} package "
                               f"({e}): pip install 'rollart[{name}]'") from None
        out.append(cls())
    return Trackers(out)


class Trackers(Tracker):
    """Several trackers as one; a tracker that fails is logged and left out from then
    on (reporting never stops a run)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, hook: str, *args, **kwargs) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, hook)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - reporting never stops a run
                logger.warning("tracker %s failed in %s (%s: %s); it is left out from now "
                               "on", t.name, hook, type(e).__name__, e)
                self.trackers.remove(t)

    def start(self, run_dir, run, params, **kwargs):
        self._each("start", run_dir, run, params, **kwargs)

    def log_step(self, step, row, **kwargs):
        self._each("log_step", step, row, **kwargs)

    def finish(self, reward_png=None, status="finished", **kwargs):
        self._each("finish", reward_png, status, **kwargs)
