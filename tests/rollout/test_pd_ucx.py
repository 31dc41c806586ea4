"""PD disaggregation over UCX: the same equivalence as ``test_pd.py`` on a cluster
started with the ``ucxx`` protocol (extra ``ucx``; on CPU UCX uses loopback TCP)."""

import os

import pytest

pytest.importorskip("distributed_ucxx", reason="the ucx extra (distributed-ucxx) is not "
                    "installed")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from rollart.policy.affinity import Affinity  # noqa: E402
from rollart.rollout import InferenceWorker, LLMProxy  # noqa: E402
from rollart.testing import ProxyHost, tagged_cluster  # noqa: E402
from rollart.types import H20, H800, GenRequest  # noqa: E402

pytestmark = pytest.mark.ucx


def test_pd_over_ucxx_equals_colocated(model_dir, tmp_path):
    with tagged_cluster(H800, H20, "CPU_ENV", protocol="ucxx") as c:
        actors = {t: c.submit(InferenceWorker, model_dir, str(tmp_path / "w"), pool=t,
                              actor=True, resources={t: 1}).result() for t in (H800, H20)}
        assert all(a.stats().result()["address"].startswith("ucxx://")
                   for a in actors.values())
        proxy = LLMProxy([(a, t) for t, a in actors.items()],
                         routes={"pd": Affinity(prefill=H800, decode=H20),
                                 "colo": Affinity(pools=(H20,))})
        host = c.submit(ProxyHost, proxy, actor=True, resources={"CPU_ENV": 1}).result()
        req = GenRequest([4, 5, 6, 7, 8, 9, 10], max_new_tokens=8, temperature=0.0)
        pd = host.generate("a", req, "pd").result()
        colo = host.generate("b", req, "colo").result()
        assert pd.token_ids == colo.token_ids and pd.logprobs == colo.logprobs
        assert actors[H20].stats().result()["kv_received"] == 1
        for a in actors.values():
            a.close().result()
