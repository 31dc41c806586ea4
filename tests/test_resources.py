"""Pool declarations, cluster start-up with tagged workers, and the tag check."""

import pytest
from distributed import Client, LocalCluster

from rollart.resources import (Pool, Resources, ResourcesError, ResourceTagError, check_tags,
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
    ("from rollart.resources import Pool, Resources\n"
     "def resources():\n    return Resources(pools=(Pool('a', tag='X', kind='gpu'),))\n",
     "kind 'gpu' is unknown"),
    ("from rollart.resources import Resources\ndef resources():\n    return Resources()\n",
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
