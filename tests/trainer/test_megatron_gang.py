"""The Megatron trainer gang (``rollart.trainer.megatron_gang``): two ranks over gloo, each
in its own Dask worker process, laid out as TP=2 or DP=2, step as the one-process
``MegatronTrainer`` does on the same batches; its checkpoint resumes on one process."""

import asyncio
import json

import pytest
import torch

from rollart.config.graph import GRPO
from rollart.testing import random_batch
from rollart.types import TRAIN

distributed = pytest.importorskip("distributed")
pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")

pytestmark = pytest.mark.megatron


def _far(a: dict, b: dict, lr: float) -> float:
    """The share of elements of state dicts ``a`` and ``b`` more than 2e-6 apart. AdamW's
    first steps are about lr × sign(gradient): an element whose gradient is float noise
    (k_proj.bias's is exactly 0 in exact arithmetic: softmax shift invariance) may move
    the other way, so k_proj biases are left out and no other element may be more than a
    twentieth of lr apart. With a clip that binds the gradients are small enough that
    AdamW's eps matters: one process with the clip and one without differ in 66% of the
    elements after one step; TP's other summation order moves ~0.05% (measured)."""
    keys = [k for k in b if not k.endswith("k_proj.bias")]
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in keys])
    assert float(diff.max()) < lr / 20
    return float((diff > 2e-6).float().mean())


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2-dp1", "tp1-dp2"])
def test_two_megatron_ranks_step_as_one_process(tp, mg_model_dir, train_pool, tmp_path):
    """Two steps of a two-rank gang (KL on, a clip that binds) equal two steps of the
    one-process MegatronTrainer: loss, grad norm (TP-aware: the replicated norms counted
    once; DP: the shares' gradients summed), weights. The clip binds with a different
    factor each step, so a missing or wrong clip shows in the second step's weights. The
    gang's checkpoint after step 1 (moments gathered over TP under HF names) loaded by a
    one-process MegatronTrainer steps to the gang's version 2 (2 -> 1), and so does the
    gang that loads it (1 -> 2)."""
    from rollart.buffer import SampleBuffer
    from rollart.runtime.handles import handle
    from rollart.trainer.megatron import MegatronTrainer
    from rollart.trainer.megatron_gang import MegatronGangTrainer
    from rollart.weights import WeightStore
    from rollart.weights.store import BUCKETS, header_metadata

    client = train_pool
    a = sorted(client.scheduler_info()["workers"])[0]
    algo = GRPO(group_size=3, groups_per_step=3, lr=1e-2, kl_coef=0.05, alpha=4,
                max_grad_norm=0.05, micro_batch_tokens=40)
    ref = MegatronTrainer(mg_model_dir, str(tmp_path / "ref"), algo)
    vocab = ref.model.hf_config.vocab_size
    b1, b2 = (random_batch(vocab, groups=3, shared_prompt=True, seed=s) for s in (1, 2))
    asyncio.run(ref.publish())
    want = [ref._update(b1)]
    want_w = [ref._hf_state_dict()]
    want.append(ref._update(b2))
    want_w.append(ref._hf_state_dict())
    assert all(w["trainer/grad_norm"] > 2 * algo.max_grad_norm for w in want)  # it binds
    assert want[1]["trainer/kl"] > 0  # the reference is in the second step's loss

    store = str(tmp_path / "gang")
    gang = handle(client.submit(MegatronGangTrainer, mg_model_dir, store, algo, ranks=2,
                                tp=tp, bucket_bytes=40_000, actor=True, workers=[a],
                                resources={TRAIN: 1}).result())
    buf = handle(client.submit(SampleBuffer, None, actor=True, workers=[a]).result())
    for t in b1 + b2:
        buf.put(t, 3).result()
    assert gang.publish().result() == 0
    got = [gang.train_step(buf, 1).result()]
    ckpt = str(tmp_path / "ckpt")
    gang.save_state(ckpt).result()
    got.append(gang.train_step(buf, 2).result())

    ws = WeightStore(store)
    # the second step starts from the first's float-noise differences (an element or two
    # in a thousand), which its gradient carries further: a looser bound there
    for g, w, weights, v, bound in zip(got, want, want_w, (1, 2), (1e-3, 1e-2)):
        assert (g["trainer/ranks"], g["trainer/tp"], g["trainer/dp"]) == (2, tp, 2 // tp)
        assert g["version"] == v
        assert g["trainer/tokens"] == w["trainer/tokens"]
        assert g["trainer/loss"] == pytest.approx(w["trainer/loss"], rel=1e-5, abs=1e-6)
        assert g["trainer/grad_norm"] == pytest.approx(w["trainer/grad_norm"], rel=1e-5)
        assert g["trainer/kl"] == pytest.approx(w["trainer/kl"], rel=1e-4, abs=1e-8)
        published = ws.get(v)
        assert set(published) == set(weights)
        assert _far(published, weights, algo.lr) < bound
    moved = torch.cat([(ws.get(2)[k] - ws.get(1)[k]).abs().flatten() for k in want_w[1]])
    assert float(moved.median()) > algo.lr / 2
    # version 2 is buckets written by both ranks (bucket k by rank k mod 2)
    names = json.loads(header_metadata(ws._read(ws._name(2)))[BUCKETS])
    writers = [header_metadata(ws._read(n))["rollart.rank"] for n in names]
    assert len(names) > 2 and writers == [str(k % 2) for k in range(len(names))]

    # 2 -> 1: the gang's checkpoint on one process steps to the gang's version 2
    one = MegatronTrainer(mg_model_dir, str(tmp_path / "one"), algo)
    assert asyncio.run(one.load_state(ckpt)) == 1
    one._update(b2)
    assert _far(one._hf_state_dict(), ws.get(2), algo.lr) < 1e-3
    fresh = MegatronTrainer(mg_model_dir, str(tmp_path / "fresh"), algo)
    asyncio.run(fresh.load_state(ckpt))
    fresh.optimizer = fresh._make_optimizer()  # the weights without the moments
    fresh._update(b2)
    diff = torch.cat([(fresh._hf_state_dict()[k] - v).abs().flatten()
                      for k, v in ws.get(2).items()])
    assert float((diff > 2e-6).float().mean()) > 0.1  # the moments are what is tested

    # 1 -> 2 on the same gang: it loads that checkpoint (back to one process), forms again
    # (the moments cut into TP shards on every rank) and steps to version 2 again
    v2 = ws.get(2)
    assert gang.load_state(ckpt).result() == 1
    assert gang.publish().result() == 1
    again_buf = handle(client.submit(SampleBuffer, None, actor=True, workers=[a]).result())
    for t in b2:
        again_buf.put(t, 3).result()
    again = gang.train_step(again_buf, 2).result()
    assert again["trainer/loss"] == pytest.approx(got[1]["trainer/loss"], rel=1e-6)
    assert _far(WeightStore(store).get(2), v2, algo.lr) < 1e-3


def test_a_layout_that_does_not_make_the_train_workers_is_a_graph_error():
    from rollart import TrainerParallel
    from rollart.config.graph import Graph, GraphError, Policy
    from rollart.config.overrides import apply_overrides
    from rollart.config.preflight import check_gang

    mg = Graph(name="g", tasks=("gridnav",), policy=Policy(trainer_backend="megatron"))
    assert TrainerParallel().layout(1) == (1, 1)  # one TRAIN worker: one process
    assert TrainerParallel().layout(4) == (1, 4)
    assert TrainerParallel(tp=2).layout(4, "megatron") == (2, 2)
    assert TrainerParallel(tp=2, dp=1).layout(2, "megatron") == (2, 1)
    two = apply_overrides(mg, ["policy.trainer_parallel.tp=2"])
    assert two.policy.trainer_parallel == TrainerParallel(tp=2)
    check_gang(two, 2, "r.py")
    check_gang(mg, 2, "r.py")  # the Megatron backend on a gang: no longer refused
    for graph, ranks, what in [
            (two, 3, r"tp=2 x dp=1 = 2 ranks, but the trainer has 3 TRAIN worker\(s\): "
                     r"make tp x dp = 3"),
            (two, 1, r"tp=2 x dp=1 = 2 ranks, but the trainer has 1 TRAIN worker"),
            (apply_overrides(two, ["policy.trainer_parallel.dp=2"]), 2,
             r"tp=2 x dp=2 = 4 ranks, but the trainer has 2 TRAIN worker\(s\).*"
             r"Pool\(tag='TRAIN', workers=4\)")]:
        with pytest.raises(GraphError, match=what) as e:
            check_gang(graph, ranks, "r.py")
        assert "TRAIN workers of r.py" in str(e.value)
    with pytest.raises(GraphError, match="the torch backend has no tensor parallelism.*"
                                         "trainer_backend='megatron'"):
        Policy(trainer_parallel=TrainerParallel(tp=2))
    with pytest.raises(GraphError, match="the torch backend has no tensor parallelism"):
        apply_overrides(Graph(name="g", tasks=("gridnav",)), ["policy.trainer_parallel.tp=2"])
    with pytest.raises(GraphError, match=r"TrainerParallel.tp must be an int ≥ 1"):
        TrainerParallel(tp=0)
    with pytest.raises(GraphError, match=r"TrainerParallel.dp must be an int ≥ 1 or None"):
        TrainerParallel(dp=0)
    assert Policy(**two.to_dict()["policy"]).trainer_parallel == TrainerParallel(tp=2)


def test_a_tp_size_that_does_not_divide_the_models_heads_is_refused_before_start(
        mg_model_dir):
    """Each TP rank holds whole heads: a TP size that does not divide the model's
    attention and KV heads is a GraphError at preflight, naming the divisors."""
    import json
    from pathlib import Path

    from rollart import TrainerParallel
    from rollart.config.graph import Graph, GraphError, Policy
    from rollart.config.preflight import check_gang

    cfg = json.loads((Path(mg_model_dir) / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert (heads, kv) == (4, 4)

    def graph(tp):
        return Graph(name="g", tasks=("gridnav",), policy=Policy(
            trainer_backend="megatron", trainer_parallel=TrainerParallel(tp=tp)))

    check_gang(graph(2), 2, "test", mg_model_dir)  # 2 divides both
    with pytest.raises(GraphError, match=r"tensor parallel size 3 must divide the 4 attention "
                                         r"heads and 4 KV heads; pick a divisor: \[1, 2, 4\]"):
        check_gang(graph(3), 3, "test", mg_model_dir)
    check_gang(graph(3), 3, "test")  # no model folder known yet: the gang says it later


@pytest.mark.slow
def test_the_cli_trains_a_tensor_parallel_megatron_gang(train_on_two_ranks):
    """``rollart train gridnav`` on two TRAIN workers with the Megatron backend and
    ``--set policy.trainer_parallel.tp=2``: every step row says two ranks, TP 2, DP 1,
    and the run's model folder loads."""
    from rollart.model import load_model

    run, rows = train_on_two_ranks("policy.trainer_backend=megatron",
                                   "policy.trainer_parallel.tp=2")
    assert {(r["trainer/ranks"], r["trainer/tp"], r["trainer/dp"]) for r in rows} == {(2, 2, 1)}
    assert all(r["trainer/tokens"] > 0 and r["trainer/grad_norm"] > 0 for r in rows)
    load_model(str(run / "model"))
