"""Pool declarations, cluster start-up with tagged workers, and the tag check."""

import sys

import pytest
from distributed import Client, LocalCluster

from rollart.runtime.resources import (Pool, Resources, ResourcesError, ResourceTagError, check_tags,
                               cluster_tags, load_resources, workers_with)
from rollart.types import ALL_TAGS, CPU_ENV, H20, H800, REWARD, TRAIN


def test_default_resources_declare_every_role():
    res = load_resources()
    assert res.source.endswith("resources/local.py")
    assert set(res.tags()) == set(ALL_TAGS)
    specs = res.worker_specs()
    assert len(specs) == 5
    carried = [t for s in specs.values() for t in s["options"]["resources"]]
    assert sorted(carried) == sorted(ALL_TAGS)  # BUFFER rides on the trainer's worker


def test_address_and_scheduler_file():
    assert load_resources("tcp://127.0.0.1:8786").address == "tcp://127.0.0.1:8786"
    assert load_resources("scheduler").address.startswith("tcp://")


def test_local_cluster_workers_carry_their_tags(local_cluster):
    tags = cluster_tags(local_cluster)
    assert sorted(t for r in tags.values() for t in r) == sorted(ALL_TAGS)
    for tag in ALL_TAGS:
        assert len(workers_with(local_cluster, tag)) == 1
    check_tags(local_cluster, {t: 1 for t in ALL_TAGS}, "resources/local.py")


def test_missing_tag_is_a_clear_error(local_cluster):
    with pytest.raises(ResourceTagError) as e:
        check_tags(local_cluster, {"A100": 1}, "resources/local.py", needed_by="graph 'x'")
    msg = str(e.value)
    assert "'A100'" in msg and "resources/local.py" in msg and "graph 'x'" in msg
    with pytest.raises(ResourceTagError, match="slots"):
        check_tags(local_cluster, {H800: 4}, "resources/local.py")


def test_cluster_without_a_tag_is_refused_before_submitting():
    with LocalCluster(n_workers=1, processes=False, resources={H800: 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(ResourceTagError, match="'TRAIN'"):
            check_tags(client, {H800: 1, TRAIN: 1}, "resources/mine.py")


@pytest.mark.parametrize("body, match", [
    ("x = 1\n", "defines no resources"),
    ("def resources():\n    return 3\n", "returned int"),
    ("def resources(:\n", "could not load"),
    ("from rollart.runtime.resources import Pool, Resources\n"
     "def resources():\n    return Resources(pools=(Pool('a', tag='X', kind='gpu'),))\n",
     "kind 'gpu' is unknown"),
    ("from rollart.runtime.resources import Resources\ndef resources():\n    return Resources()\n",
     "at least one Pool"),
])
def test_malformed_resources_files(tmp_path, body, match):
    f = tmp_path / "bad.py"
    f.write_text(body)
    with pytest.raises(ResourcesError, match=match) as e:
        load_resources(str(f))
    assert "bad.py" in str(e.value)


def test_unknown_resources_name_lists_known():
    with pytest.raises(ResourcesError, match="local"):
        load_resources("no-such-pool")


def test_pool_validation():
    with pytest.raises(ResourcesError, match="threads"):
        Pool("a", tag=CPU_ENV, kind="cpu_env", threads=0)
    with pytest.raises(ResourcesError, match="repeat"):
        Resources(pools=(Pool("a", tag=H20, kind="bandwidth_gpu"),
                         Pool("a", tag=REWARD, kind="reward")))


def _mmapped_blocks_for_4_mib():
    """(MALLOC_MMAP_THRESHOLD_ as this process sees it, glibc blocks a 4 MiB malloc
    mmapped): glibc's own count, ``mallinfo2().hblks``."""
    import ctypes
    import os

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblks
    buf = ctypes.create_string_buffer(4 << 20)
    after = libc.mallinfo2().hblks
    del buf
    return os.environ.get("MALLOC_MMAP_THRESHOLD_"), after - before


def _one_process_worker(cls=None):
    if cls is None:  # rollart's own pools
        res = Resources(pools=(Pool("env", tag=CPU_ENV, kind="cpu_env"),), processes=True,
                        dashboard_address=":0")
        cluster = res.make_cluster()
    else:
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                               dashboard_address=":0")
    with cluster, Client(cluster) as client:
        (got,) = client.run(_mmapped_blocks_for_4_mib).values()
    return got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_worker_processes_keep_big_tensors_out_of_mmap(monkeypatch):
    from rollart.runtime.resources import MMAP_THRESHOLD

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    # Dask's own nanny: its MALLOC_TRIM_THRESHOLD_ freezes the mmap threshold at 128 KiB
    assert _one_process_worker(cls=LocalCluster) == (None, 1)
    # rollart's: 4 MiB comes from the heap, not a fresh mmap (and a page fault per page)
    assert _one_process_worker() == (str(MMAP_THRESHOLD), 0)
    # a value in the environment wins
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert _one_process_worker() == ("131072", 1)


@pytest.mark.slow
def test_a_cluster_rollart_made_lets_its_workers_exit_on_their_own(caplog):
    """The end of a run is a scale to zero: a worker process slow to exit (here: an
    exit handler that takes 6 s, as a process that loaded torch and a model can on a busy
    machine) is let exit, not killed after 4 s as ``SpecCluster`` does."""
    import atexit
    import logging
    import time

    from distributed import Client

    from rollart.runtime.resources import Pool, Resources
    from rollart.types import CPU_ENV

    res = Resources(pools=(Pool("env", tag=CPU_ENV, kind="cpu_env", workers=1, threads=1),),
                    processes=True, dashboard_address=":0")
    with caplog.at_level(logging.INFO, logger="distributed.nanny"):
        with res.make_cluster() as cluster, Client(cluster) as client:
            client.run(lambda: atexit.register(time.sleep, 6))
            t0 = time.monotonic()
        took = time.monotonic() - t0
    assert not [r for r in caplog.records if "still alive" in r.getMessage()], caplog.text
    assert not [r for r in caplog.records if "killed by signal" in r.getMessage()]
    assert took >= 6, took  # it waited for the worker's own exit
