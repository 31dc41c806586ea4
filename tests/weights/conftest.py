"""A real ``mooncake_master`` on loopback for each weight-store test module that asks for
one (``stores.py`` has the rest of what the modules share)."""

import pytest
from stores import LEASE_MS, mooncake_or_skip  # tests/weights/

from rollart.weights import mooncake as mc


@pytest.fixture(scope="module")
def master():
    mooncake_or_skip()
    with mc.MooncakeMaster(lease_ms=LEASE_MS) as m:
        yield m
