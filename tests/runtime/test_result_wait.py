"""``rollart.runtime.waits.result_unless``: a coroutine with a synchronous Dask client waits on a
future from a thread that its waiter can release. With a plain ``fut.result()`` there
(a trajectory's remote reward, a serverless batch), a wait whose result could no longer
arrive (the cluster closing under a cancelled trajectory: its client's loop gone) kept
its thread for good; the loop's teardown waits for such threads, so the in-process
cluster's close raised "join timed out" and the process never exited (CI, the dashboard
test; py-spy: two ``to_thread`` workers in ``Future.result``, the IO loop in
``shutdown_default_executor``). Real in-process Dask cluster."""

import asyncio
import threading
import time

import pytest
from distributed import Client, LocalCluster

from rollart.runtime.waits import result_unless


GATE = threading.Event()  # the in-process worker's task waits on it (an Event does not pickle)


def _wait_for() -> str:
    GATE.wait(60)
    return "released"


def _raise_timeout():
    raise TimeoutError("the reward's own time-out")


@pytest.fixture
def cluster():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=":0") as c, Client(c) as client:
        yield c, client


def test_result_unless_gives_the_value_and_the_tasks_own_errors(cluster):
    _, client = cluster
    never = threading.Event()
    assert result_unless(client.submit(sum, [1, 2, 3]), never) == 6
    with pytest.raises(TimeoutError, match="own time-out"):
        result_unless(client.submit(_raise_timeout, pure=False), never)


def test_a_wait_given_up_releases_its_thread():
    GATE.clear()
    stop = threading.Event()
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=":0") as c, Client(c) as client:
        fut = client.submit(_wait_for, pure=False)
        out = {}

        def wait():
            try:
                out["value"] = result_unless(fut, stop, poll=0.1)
            except BaseException as e:  # noqa: BLE001 - inspected below
                out["error"] = e

        waiting = threading.Thread(target=wait)
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and not out  # the task runs: the wait goes on
        stop.set()
        waiting.join(5)
        assert not waiting.is_alive() and isinstance(out["error"], asyncio.CancelledError)
        GATE.set()
        assert fut.result(timeout=30) == "released"
