"""What the weight-store tests share: whether the ``mooncake`` extra works here (else
they skip; .ci/run installs it and fails when it does not work), short read leases, and
the ``store`` fixtures' store for a backend. The ``master`` fixture is in conftest.py."""

import itertools

import pytest

from rollart.weights import WeightStore
from rollart.weights import mooncake as mc

LEASE_MS = 300  # short Mooncake read leases so GC tests need not wait 10 s
_names = itertools.count()


def mooncake_or_skip() -> None:
    try:
        mc.import_store()
    except mc.MooncakeError as e:
        pytest.skip(f"Mooncake extra not installed: {e}")


def backend_store(request, tmp_path, prefix: str, segment_mb: int) -> WeightStore:
    """The ``store`` fixtures' store: fsspec in ``tmp_path``, or a fresh prefix on the
    module's Mooncake master (the ``master`` fixture)."""
    if request.param == "fsspec":
        return WeightStore(str(tmp_path / "w"))
    m = request.getfixturevalue("master")
    return WeightStore(m.url(f"{prefix}-{next(_names)}", segment_mb=segment_mb,
                             buffer_mb=32))
