"""The trainer gang (``rollart.trainer.gang``): two FSDP2 ranks over gloo, each in its own
Dask worker process, step exactly as the one-process trainer does on the same batch."""

import asyncio
import json

import pytest
import torch

from rollart.config.graph import GRPO
from rollart.trainer.gang import balance
from rollart.testing import random_batch
from rollart.types import TRAIN

distributed = pytest.importorskip("distributed")


def _batch(vocab: int) -> list:
    """Three groups of three, each sharing its prompt, uneven lengths."""
    return random_batch(vocab, groups=3, shared_prompt=True)


def test_balance_spreads_tokens_and_keeps_every_row_once():
    lengths = [9, 3, 7, 7, 2, 8, 1]
    shares = balance(lengths, 3)
    assert sorted(i for s in shares for i in s) == list(range(7))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)
    assert balance([4], 2) == [[0], []]  # a rank may get nothing: it steps with weight 0
    import doctest

    from rollart.trainer import fsdp
    assert doctest.testmod(fsdp).failed == 0


@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_a_two_rank_step_equals_the_one_process_trainer(kl, mg_model_dir, train_pool, tmp_path):
    from rollart.buffer import SampleBuffer
    from rollart.runtime.handles import handle
    from rollart.trainer import Trainer
    from rollart.trainer.gang import GangTrainer
    from rollart.weights import WeightStore

    client = train_pool
    a, b = sorted(client.scheduler_info()["workers"])
    algo = GRPO(group_size=3, groups_per_step=3, lr=1e-2, kl_coef=kl, micro_batch_tokens=40)
    ref = Trainer(mg_model_dir, str(tmp_path / "ref"), algo)
    batch = _batch(ref.model.config.vocab_size)
    asyncio.run(ref.publish())
    want = ref._update(batch)
    # a tied head is published once, as the input embedding (without_tied_head)
    from rollart.trainer.backend import without_tied_head
    assert "lm_head.weight" in ref.model.state_dict()
    ref_weights = {k: v.detach().clone()
                   for k, v in without_tied_head(ref.model, ref.model.state_dict()).items()}

    store = str(tmp_path / "gang")
    gang = handle(client.submit(GangTrainer, mg_model_dir, store, algo, ranks=2, actor=True,
                                bucket_bytes=40_000, workers=[a],
                                resources={TRAIN: 1}).result())
    buf = handle(client.submit(SampleBuffer, None, actor=True, workers=[a]).result())
    for t in batch:
        buf.put(t, 3).result()
    assert gang.publish().result() == 0
    got = gang.train_step(buf, 1).result()

    assert got["trainer/ranks"] == 2 and want["trainer/ranks"] == 1
    assert got["trainer/tokens"] == want["trainer/tokens"]
    assert got["trainer/loss"] == pytest.approx(want["trainer/loss"], rel=1e-5, abs=1e-6)
    assert got["trainer/grad_norm"] == pytest.approx(want["trainer/grad_norm"], rel=1e-5)
    for k in ("trainer/clip_frac", "trainer/kl"):
        if k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-7), k
    assert got["version"] == 1
    # AdamW's first step is about lr × sign(gradient): where a gradient is near 0, float
    # rounding (two ranks sum in another order) moves that element differently. So: the
    # step moved the weights by about lr, nearly every element agrees to 2e-6, none by more
    # than a twentieth of lr (a rank's share lost or counted twice flips many signs)
    published, before = WeightStore(store).get(1), WeightStore(store).get(0)
    assert set(published) == set(ref_weights)
    # version 1 is buckets written by both ranks (bucket k by rank k mod 2), no gathered copy
    from rollart.weights.store import BUCKETS, header_metadata
    ws = WeightStore(store)
    names = json.loads(header_metadata(ws._read(ws._name(1)))[BUCKETS])
    writers = [header_metadata(ws._read(n))["rollart.rank"] for n in names]
    assert len(names) > 2 and writers == [str(k % 2) for k in range(len(names))]
    assert got["weights/bytes_published"] == sum(len(ws._read(n)) for n in names)
    diff = torch.cat([(published[k] - v).abs().flatten() for k, v in ref_weights.items()])
    moved = torch.cat([(v - before[k]).abs().flatten() for k, v in ref_weights.items()])
    assert float(moved.median()) > algo.lr / 2
    assert float((diff > 2e-6).float().mean()) < 1e-3
    assert float(diff.max()) < algo.lr / 20


def test_a_gang_short_of_train_workers_says_how_many_and_what_to_do(mg_model_dir, train_pool,
                                                                     tmp_path):
    """Three ranks declared, two TRAIN workers alive: rank 0 waits ``join_timeout`` for
    the third, then says how many are missing and which setting bounds the wait."""
    from rollart.runtime.handles import handle
    from rollart.trainer.gang import GangTrainer

    client = train_pool
    a = sorted(client.scheduler_info()["workers"])[0]
    gang = handle(client.submit(GangTrainer, mg_model_dir, str(tmp_path / "w"),
                                GRPO(group_size=2, groups_per_step=1), actor=True,
                                ranks=3, join_timeout=2.0,
                                workers=[a], resources={TRAIN: 1}).result())
    with pytest.raises(Exception, match=r"the trainer gang has 3 ranks but only 2 TRAIN "
                                        r"workers are alive after 2 s; start 1 more \(or "
                                        r"raise Dask's config rollart.waits.start\)"):
        gang.publish().result()


def _break_once(method: str) -> None:
    """(on a worker) The next ``GangRank.<method>`` call there does its work, then fails
    as gloo does when a peer dies ("Connection closed by peer")."""
    from rollart.trainer.fsdp import GangRank

    original = getattr(GangRank, method)

    async def broken(self, *args):
        setattr(GangRank, method, original)
        await original(self, *args)
        raise RuntimeError("[gloo] Connection closed by peer (planted)")

    setattr(GangRank, method, broken)


def test_a_gang_that_fails_in_publishing_or_saving_forms_again(mg_model_dir, train_pool,
                                                               tmp_path):
    """Issue 54 (the Megatron gang's kill cell): a rank that fails while the gang
    publishes fails the gang as one, as in a step; the step's update is made again on a
    new gang from the published weights, on the same batch, and published (the gloo
    error was the run's error). A rank that fails while the gang writes a checkpoint:
    rank 0 writes it alone (the published weights, one-process layout), and the next
    step forms the gang again."""
    import sys

    import cloudpickle

    from rollart.buffer import SampleBuffer
    from rollart.runtime.handles import handle
    from rollart.trainer.gang import GangTrainer
    from rollart.weights import WeightStore

    from rollart.model import load_model
    from rollart.trainer import Trainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _break_once
    client = train_pool
    a, b = sorted(client.scheduler_info()["workers"])
    store = str(tmp_path / "w")
    gang = handle(client.submit(GangTrainer, mg_model_dir, store,
                                GRPO(group_size=3, groups_per_step=3), ranks=2, actor=True,
                                bucket_bytes=40_000, workers=[a],
                                resources={TRAIN: 1}).result())
    buf = handle(client.submit(SampleBuffer, None, actor=True, workers=[a]).result())
    with open(f"{mg_model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    for t in _batch(vocab):
        buf.put(t, 3).result()
    assert gang.publish().result() == 0
    client.run(_break_once, "write_buckets", workers=[b])
    out = gang.train_step(buf, 1).result()
    assert out["version"] == 1 and out["trainer/ranks"] == 2, out
    assert out["trainer/gang_restarts"] == 1
    [event] = out["trainer/gang_events"]
    assert event["role"] == "trainer" and "publishing v1" in event["gang_restart"]
    assert WeightStore(store).latest() == 1
    assert len(gang.stats().result()["ranks"]) == 2

    client.run(_break_once, "save_shards", workers=[b])
    ckpt = str(tmp_path / "ckpt")
    gang.save_state(ckpt).result()
    assert torch.load(f"{ckpt}/trainer.pt", weights_only=False)["optimizer_format"] != "dcp"
    saved, v1 = load_model(f"{ckpt}/model").state_dict(), WeightStore(store).get(1)
    assert all(torch.equal(saved[k], v) for k, v in v1.items())
    one = Trainer(mg_model_dir, str(tmp_path / "one"), GRPO(group_size=3, groups_per_step=3))
    assert asyncio.run(one.load_state(ckpt)) == 1
    for t in random_batch(vocab, groups=3, shared_prompt=True, seed=5):
        buf.put(t, 3).result()
    out = gang.train_step(buf, 2).result()
    assert out["trainer/ranks"] == 2 and out["trainer/gang_restarts"] == 2, out


@pytest.mark.slow
def test_the_cli_trains_on_a_two_worker_train_pool_and_resumes_on_one(train_on_two_ranks):
    """``rollart train gridnav --resources FILE`` with ``Pool(tag=TRAIN, workers=2)``: the
    trainer is a two-rank gang, every step row says so, the run's model folder loads,
    and its checkpoint resumes on the default resources' one TRAIN worker."""
    import json

    from rollart.app.cli import main
    from rollart.model import load_model

    run, rows = train_on_two_ranks("checkpoint_every=2")
    assert {r["trainer/ranks"] for r in rows} == {2}
    assert all(r["trainer/tokens"] > 0 for r in rows)
    load_model(str(run / "model"))
    # its checkpoint is sharded (each rank's DCP shard file; model/ in shards with an
    # index) and resumes on one TRAIN worker (resources/local.py), whose model path is
    # the checkpoint's model/ folder
    ckpt = run / "checkpoints" / "step-00000002"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(
        p.name for p in (ckpt / "dcp").iterdir())
    assert (ckpt / "model" / "model.safetensors.index.json").exists()
    assert (run / "model" / "model.safetensors.index.json").exists()
    assert main(["train", "--resume", str(run), "--steps", "3", "--eval-seeds", "0",
                 "--no-progress"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["trainer/ranks"]) for r in rows] == [(1, 2), (2, 2), (3, 1)]
    load_model(str(run / "model"))  # written again by the one-process trainer


@pytest.mark.slow
def test_a_pretrained_models_warm_up_runs_before_the_gang_forms(train_on_two_ranks,
                                                                tiny_model, capsys):
    """``Policy.warmup_pretrained`` on a two-rank gang: rank 0 warms the model folder up
    alone (the gang forms at the first RL step, from rank 0's weights), saves it as
    ``warmup_model``, and the gang then trains from it."""
    from safetensors.torch import load_file

    run, rows = train_on_two_ranks("policy.warmup_pretrained=true", "policy.warmup_steps=2")
    assert "warm-up: 2 demonstration steps" in capsys.readouterr().out
    assert {r["trainer/ranks"] for r in rows} == {2}
    before = load_file(f"{tiny_model}/model.safetensors")
    warm = load_file(str(run / "warmup_model" / "model.safetensors"))
    assert any(not torch.equal(before[k], warm[k]) for k in before), "the warm-up moved nothing"


def test_what_a_gang_cannot_do_yet_is_a_graph_error():
    from rollart import LoRA
    from rollart.config.graph import Graph, GraphError, Policy
    from rollart.config.preflight import check_gang

    lora = Graph(name="g", tasks=("gridnav",), policy=Policy(lora=LoRA(rank=4)))
    check_gang(lora, 1, "r.py")  # one rank: LoRA trains
    check_gang(Graph(name="g", tasks=("gridnav",)), 2, "r.py")
    with pytest.raises(GraphError, match="Policy.lora with 2 TRAIN workers") as e:
        check_gang(lora, 2, "r.py")
    assert "Pool(tag='TRAIN', workers=1) in r.py" in str(e.value)
    # the Megatron backend is a gang too: tests/trainer/test_megatron_gang.py


def _close(a: dict, b: dict, lr: float) -> float:
    """The share of elements of ``a`` and ``b`` (state dicts) more than 2e-6 apart; none
    may be more than lr/20 apart (see the step test: AdamW's near-zero gradients). A
    published version leaves out the tied head (the input embedding's tensor)."""
    assert set(b) - set(a) <= {"lm_head.weight"}, set(b) ^ set(a)
    diff = torch.cat([(a[k] - v).abs().flatten() for k, v in b.items() if k in a])
    assert float(diff.max()) < lr / 20
    return float((diff > 2e-6).float().mean())


def test_a_checkpoint_resumes_on_another_number_of_ranks(mg_model_dir, train_pool, tmp_path):
    """1 -> 2: a one-process trainer's checkpoint, loaded by a two-rank gang, steps as the
    one-process trainer goes on; 2 -> 1: the gang's sharded checkpoint
    (torch.distributed.checkpoint, each rank its own AdamW shard) loaded by a one-process
    trainer steps as the gang goes on; 2 -> 2: a new gang loads it (each rank reading its
    own shard of the moments as it forms) and steps as the gang goes on. Without the
    moments the step is visibly another one (the moments are what is tested)."""
    from rollart.buffer import SampleBuffer
    from rollart.model import load_model
    from rollart.runtime.handles import handle
    from rollart.trainer import Trainer
    from rollart.trainer.gang import GangTrainer
    from rollart.weights import WeightStore

    client = train_pool
    a, b = sorted(client.scheduler_info()["workers"])
    algo = GRPO(group_size=3, groups_per_step=3, lr=1e-2, kl_coef=0.05, alpha=8,
                micro_batch_tokens=40)

    def one(ckpt=None, store="one"):
        t = Trainer(mg_model_dir, str(tmp_path / store), algo)
        if ckpt:
            asyncio.run(t.load_state(ckpt))
        else:
            asyncio.run(t.publish())
        return t

    def step(t, batch) -> dict:
        t._update(batch)
        return {k: v.detach().clone() for k, v in t.model.state_dict().items()}

    def gang_on(store, batches):
        g = handle(client.submit(GangTrainer, mg_model_dir, str(tmp_path / store), algo,
                                 ranks=2, actor=True, bucket_bytes=40_000, workers=[a],
                                 resources={TRAIN: 1}).result())
        buf = handle(client.submit(SampleBuffer, None, actor=True, workers=[a]).result())
        for t in batches:
            buf.put(t, 3).result()
        return g, buf

    vocab = one().model.config.vocab_size
    b1, b2, b3 = (random_batch(vocab, groups=3, shared_prompt=True, seed=s) for s in (1, 2, 3))
    first = one()
    step(first, b1)
    first.version = 1
    ckpt1 = str(tmp_path / "ckpt1")
    asyncio.run(first.save_state(ckpt1))
    want2 = step(first, b2)

    gang, buf = gang_on("gang", b2 + b3)
    assert gang.load_state(ckpt1).result() == 1
    assert gang.publish().result() == 1
    assert gang.train_step(buf, 2).result()["trainer/ranks"] == 2
    assert _close(WeightStore(str(tmp_path / "gang")).get(2), want2, algo.lr) < 1e-3  # 1 -> 2

    ckpt2 = str(tmp_path / "ckpt2")
    files = gang.save_state(ckpt2).result()
    gang.train_step(buf, 3).result()
    want3 = WeightStore(str(tmp_path / "gang")).get(3)
    # the run's model folder, also written in shards by both ranks; a stale whole-model
    # file of an earlier save there is removed (from_pretrained would prefer it)
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"stale")
    assert gang.save(str(final)).result() == str(final)
    assert not (final / "model.safetensors").exists()
    assert len(list(final.glob("model-*-of-*.safetensors"))) > 2
    saved = load_model(str(final)).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in want3.items())
    assert _close(step(one(ckpt2, "two"), b3), want3, algo.lr) < 1e-3  # 2 -> 1
    fresh = one(ckpt2, "three")
    fresh.optimizer = fresh._make_optimizer()  # the weights without the moments
    assert _close(step(fresh, b3), want3, 1.0) > 0.1

    gang2, buf2 = gang_on("gang2", b3)  # 2 -> 2: each rank reads its shard of the moments
    assert gang2.load_state(ckpt2).result() == 2
    ckpt2b = str(tmp_path / "ckpt2b")  # saved before any step: the moments are kept
    gang2.save_state(ckpt2b).result()
    moments = [one(c, f"m{i}").optimizer.state_dict()["state"] for i, c in
               enumerate((ckpt2, ckpt2b))]
    assert all(torch.equal(moments[0][i]["exp_avg"], moments[1][i]["exp_avg"])
               for i in moments[0]) and moments[0]
    assert gang2.publish().result() == 2
    gang2.train_step(buf2, 3).result()
    assert _close(WeightStore(str(tmp_path / "gang2")).get(3), want3, algo.lr) < 1e-3

    # a lost rank 0 replaced as the supervisor does (load_state(truncate=False), then the
    # newest published weights, v3): the checkpoint's moments on v3, as one process does
    import shutil
    for d in ("gang3", "one3"):
        shutil.copytree(tmp_path / "gang", tmp_path / d)
    b4 = random_batch(vocab, groups=3, shared_prompt=True, seed=4)
    alone = Trainer(mg_model_dir, str(tmp_path / "one3"), algo)
    asyncio.run(alone.load_state(ckpt2, truncate=False))
    assert asyncio.run(alone.restore_latest()) == 3
    want4 = step(alone, b4)
    gang3, buf3 = gang_on("gang3", b4)
    assert gang3.load_state(ckpt2, truncate=False).result() == 2
    assert gang3.restore_latest().result() == 3
    assert gang3.train_step(buf3, 4).result()["trainer/ranks"] == 2
    assert _close(WeightStore(str(tmp_path / "gang3")).get(4), want4, algo.lr) < 1e-3

    # ckpt2 is sharded, with no whole copy on rank 0: every rank wrote its own DCP shard
    # file of the policy and of the AdamW state, trainer.pt holds no optimizer state, and
    # model/ is the HF folder of the published weights in shards written by both ranks
    import os

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    state = torch.load(os.path.join(ckpt2, "trainer.pt"), weights_only=False)
    assert state["optimizer_format"] == "dcp" and state["optimizer"] is None
    meta = dcp.FileSystemReader(os.path.join(ckpt2, "dcp")).read_metadata()
    by_file: dict = {}
    for index, info in meta.storage_data.items():
        by_file.setdefault(info.relative_path, set()).add(index.fqn.split(".")[0])
    assert by_file == {"__0_0.distcp": {"model", "optimizer"},
                       "__1_0.distcp": {"model", "optimizer"}}
    exp_avg = [i for i in meta.storage_data if i.fqn.startswith("optimizer.state.")
               and i.fqn.endswith(".exp_avg")]
    assert {meta.storage_data[i].relative_path for i in exp_avg} == set(by_file)
    assert {n for n in files if n.startswith("dcp/")} == {"dcp/.metadata",
                                                          *(f"dcp/{f}" for f in by_file)}
    shards = sorted(f for f in os.listdir(os.path.join(ckpt2, "model"))
                    if f.endswith(".safetensors"))
    assert len(shards) > 2 and f"model/{shards[0]}" in files
    index = json.load(open(os.path.join(ckpt2, "model", "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == shards
    for name, shard in index["weight_map"].items():
        with safe_open(os.path.join(ckpt2, "model", shard), "pt") as f:
            assert name in f.keys()
    published = WeightStore(str(tmp_path / "gang")).get(2)
    folder = load_model(os.path.join(ckpt2, "model")).state_dict()
    assert all(torch.equal(folder[k], v) for k, v in published.items())


def test_a_sharded_checkpoint_missing_a_rank_s_shard_says_which(mg_model_dir, train_pool,
                                                                tmp_path):
    """A gang's sharded checkpoint whose rank-1 shard file is gone (a checkpoint URL local
    to each worker's host, a partial copy) fails the load naming the file, the rank and
    the fix, never a half-loaded trainer."""
    import os

    from rollart.runtime.handles import handle
    from rollart.trainer import Trainer
    from rollart.trainer.gang import GangTrainer

    client = train_pool
    a = sorted(client.scheduler_info()["workers"])[0]
    algo = GRPO(group_size=3, groups_per_step=3, lr=1e-2)
    gang = handle(client.submit(GangTrainer, mg_model_dir, str(tmp_path / "w"), algo,
                                ranks=2, actor=True, workers=[a],
                                resources={TRAIN: 1}).result())
    gang.publish().result()
    ckpt = str(tmp_path / "ckpt")
    gang.save_state(ckpt).result()
    t = Trainer(mg_model_dir, str(tmp_path / "one"), algo)
    asyncio.run(t.load_state(ckpt))  # whole, it loads
    pytest.importorskip("megatron.core")
    from rollart.trainer.megatron import MegatronTrainer
    with pytest.raises(ValueError, match=r"which the Megatron backend does not load: resume "
                                         r"it with the backend it was trained with \(--set "
                                         r"policy.trainer_backend=torch\)"):
        asyncio.run(MegatronTrainer(mg_model_dir, str(tmp_path / "mg"), algo).load_state(ckpt))
    os.remove(os.path.join(ckpt, "dcp", "__1_0.distcp"))
    with pytest.raises(ValueError, match=r"missing __1_0.distcp \(written by rank 1 of "
                                         r"the gang that saved it\).*every TRAIN worker "
                                         r"reaches"):
        asyncio.run(Trainer(mg_model_dir, str(tmp_path / "two"), algo).load_state(ckpt))
    os.remove(os.path.join(ckpt, "dcp", ".metadata"))
    with pytest.raises(ValueError, match=r"has no .metadata .*the save did not finish"):
        asyncio.run(Trainer(mg_model_dir, str(tmp_path / "three"), algo).load_state(ckpt))
