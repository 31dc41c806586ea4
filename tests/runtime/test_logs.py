"""Dask's INFO logs stay out of a notebook unless asked for (``rollart.runtime.logs``):
a cluster rollart makes, as a notebook makes it, logs nothing below WARNING from
``distributed``; ``dask_logs="info"`` (or ``ROLLART_DASK_LOGS=info``) brings them back."""

import logging
from dataclasses import replace

import pytest
from distributed import Client

import rollart
from rollart.runtime.logs import LOGGERS


class Records(logging.Handler):
    """Every record the ``distributed`` loggers emit (they do not propagate to root)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def info(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" for r in self.records
                if r.levelno < logging.WARNING]


@pytest.fixture
def dask_records(monkeypatch):
    """A fresh notebook's state: ``distributed`` at INFO, as importing it leaves it,
    no level asked for; the levels and environment come back afterwards."""
    monkeypatch.delenv("ROLLART_DASK_LOGS", raising=False)
    monkeypatch.setenv("DASK_LOGGING__DISTRIBUTED", "info")
    monkeypatch.delenv("DASK_LOGGING__DISTRIBUTED")
    levels = {n: logging.getLogger(n).level for n in LOGGERS}
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    handler = Records()
    logging.getLogger("distributed").addHandler(handler)
    yield handler
    logging.getLogger("distributed").removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _notebook_cell(**kwargs) -> None:
    res = replace(rollart.load_resources(), processes=False, dashboard_address=":0")
    with res.make_cluster(**kwargs) as cluster, Client(cluster) as client:
        assert client.submit(sum, [1, 2]).result() == 3


def test_a_notebook_cluster_logs_no_dask_info(dask_records):
    _notebook_cell()
    assert dask_records.info() == []


def test_dask_info_logs_when_asked(dask_records, monkeypatch):
    _notebook_cell(dask_logs="info")
    assert any("distributed.scheduler" in r for r in dask_records.info()), dask_records.records
    dask_records.records.clear()
    monkeypatch.setenv("ROLLART_DASK_LOGS", "info")
    _notebook_cell()
    assert any("distributed.scheduler" in r for r in dask_records.info()), dask_records.records
