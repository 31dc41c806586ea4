"""Everything a local run starts listens on 127.0.0.1 by default; Dask TLS (a
``distributed.security.Security``) encrypts and authenticates the cluster: a client
without the certificates is refused."""

from dataclasses import replace

import pytest

from rollart.control.prepare import open_client
from rollart.runtime.resources import load_resources


def _listening_hosts(cluster, client) -> set[str]:
    from urllib.parse import urlparse

    info = client.scheduler_info()
    addrs = [cluster.scheduler_address, *info["workers"], client.dashboard_link]
    return {urlparse(a).hostname for a in addrs}


@pytest.mark.slow
def test_local_cluster_binds_loopback_by_default():
    from distributed import Client

    res = replace(load_resources(), processes=False, dashboard_address=":0")
    assert res.host == "127.0.0.1"
    with res.make_cluster() as cluster, Client(cluster) as client:
        assert _listening_hosts(cluster, client) == {"127.0.0.1"}
        assert client.submit(sum, [1, 2]).result() == 3


@pytest.mark.slow
def test_tls_cluster_with_temporary_certificates():
    pytest.importorskip("cryptography")
    from distributed import Client
    from distributed.security import Security

    sec = Security.temporary()
    res = replace(load_resources(), processes=False, dashboard_address=":0", security=sec)
    with res.make_cluster() as cluster, Client(cluster) as client:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        assert all(a.startswith("tls://") for a in client.scheduler_info()["workers"])
        assert client.submit(sum, [1, 2]).result() == 3
        with pytest.raises(ConnectionError, match="security=Security.*(TLS|ssl)"):
            open_client(cluster.scheduler_address, timeout=3)  # no certificates: refused
        with open_client(cluster.scheduler_address, security=sec, timeout=10) as other:
            assert other.submit(sum, [3, 4]).result() == 7


@pytest.mark.slow
def test_a_refused_client_does_not_stall_the_next_one(monkeypatch):
    """The half-built ``Client`` of a refused connection is collected where it failed.
    Left to the cycle collector, it could be finalized in the next client's new IO loop
    thread, whose start holds the lock the finalizer needs: that start waited 10 s and
    failed with a bare AssertionError (seen in CI). The collector is made to run there."""
    pytest.importorskip("cryptography")
    import gc

    import distributed.utils
    from distributed import Client
    from distributed.security import Security

    factory = distributed.utils.get_loop_factory

    def collect_then_factory():  # runs first thing in each new client's IO loop thread
        gc.collect()
        return factory()

    sec = Security.temporary()
    res = replace(load_resources(), processes=False, dashboard_address=":0", security=sec)
    with res.make_cluster() as cluster, Client(cluster):
        for _ in range(2):
            with pytest.raises(ConnectionError):
                open_client(cluster.scheduler_address, timeout=3)
            monkeypatch.setattr(distributed.utils, "get_loop_factory", collect_then_factory)
            with open_client(cluster.scheduler_address, security=sec, timeout=10) as other:
                assert other.submit(sum, [3, 4]).result() == 7
            monkeypatch.setattr(distributed.utils, "get_loop_factory", factory)


def test_remote_address_with_security_is_accepted():
    from distributed.security import Security

    res = replace(load_resources("tls://10.0.0.1:8786"), security=Security())
    assert res.address == "tls://10.0.0.1:8786" and res.security is not None
