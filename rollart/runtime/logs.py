"""How much Dask says: the level of ``distributed``'s loggers where rollart makes the cluster.

Importing ``distributed`` sets its loggers to INFO, so a notebook that starts a cluster
fills with "State start", "Start worker", "Register worker" lines. rollart sets them to
WARNING wherever it makes the cluster (``Resources.make_cluster``, so also ``train``
without a client) and in the CLI (``rollart.app.cli.quiet``), unless asked for more:
the ``dask_logs=`` argument, else the ``ROLLART_DASK_LOGS`` environment variable (e.g.
``info``), else a level you set in ``DASK_LOGGING__DISTRIBUTED``. The level is also put
in ``DASK_LOGGING__DISTRIBUTED``, so worker processes started afterwards inherit it.

>>> dask_log_level("info"), dask_log_level("nonsense")
('INFO', 'WARNING')
"""

from __future__ import annotations

import logging
import os

ENV = "ROLLART_DASK_LOGS"  #: the environment variable that asks for another level
DASK_ENV = "DASK_LOGGING__DISTRIBUTED"  #: Dask's own (its config), read by worker processes
#: the loggers that say what a cluster does as it starts and runs: set to the level
LOGGERS = ("distributed", "distributed.scheduler", "distributed.worker", "distributed.nanny",
           "distributed.core", "distributed.http", "distributed.deploy",
           "distributed.deploy.spec")


def dask_log_level(asked: str | None = None) -> str:
    """The level name: ``asked``, else ``$ROLLART_DASK_LOGS``, else
    ``$DASK_LOGGING__DISTRIBUTED``, else ``WARNING`` (an unknown name: ``WARNING``)."""
    level = (asked or os.environ.get(ENV) or os.environ.get(DASK_ENV) or "warning").upper()
    return level if isinstance(getattr(logging, level, None), int) else "WARNING"


def set_dask_logs(asked: str | None = None) -> str:
    """Set ``distributed``'s loggers in this process to ``dask_log_level(asked)``
    (``LOGGERS``; its other loggers set below that level are raised to it) and ``DASK_LOGGING__DISTRIBUTED`` for the worker
    processes started after; returns the level name."""
    level = dask_log_level(asked)
    os.environ[DASK_ENV] = level.lower()
    try:  # importing distributed configures its loggers (INFO): set the levels after it
        import distributed  # noqa: F401
    except ImportError:
        pass
    value = getattr(logging, level)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(value)
    for name in list(logging.root.manager.loggerDict):
        child = logging.getLogger(name)
        if name.startswith("distributed.") and child.level and child.level < value:
            child.setLevel(value)
    return level
