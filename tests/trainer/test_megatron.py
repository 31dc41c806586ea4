"""Megatron-core backend: HF<->Megatron conversion, forward, loss and grads vs the torch
trainer, tensor parallelism over gloo. Needs ``megatron-core`` (extra ``megatron``)."""

import asyncio
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollart.config.graph import GRPO
from rollart.testing import random_batch
from rollart.trainer.megatron import hf_to_megatron, megatron_to_hf
from rollart.types import Trajectory

needs_megatron = pytest.mark.megatron


def _qwen2(tied: bool, vocab: int = 37, kv_heads: int = 2, seed: int = 0):
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                      max_position_embeddings=128, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # break the symmetric init so every layout slip shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_conversion_round_trip_is_exact(tp, tied):
    model = _qwen2(tied)  # vocab 37 is not a multiple of 2: padded, then cut off
    hf = model.state_dict()
    shards = [hf_to_megatron(hf, model.config, tp_rank=r, tp_size=tp) for r in range(tp)]
    rows = sum(s["embedding.word_embeddings.weight"].shape[0] for s in shards)
    assert rows == (38 if tp == 2 else 37)
    back = megatron_to_hf(shards, model.config)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_conversion_rejects_tp_that_does_not_divide_heads():
    model = _qwen2(True)
    with pytest.raises(ValueError, match="must divide"):
        hf_to_megatron(model.state_dict(), model.config, tp_rank=0, tp_size=3)


def _batch(vocab: int, seed: int = 0) -> list[Trajectory]:
    return random_batch(vocab, seed=seed)


@needs_megatron
def test_megatron_forward_matches_hf_and_exports_the_same_weights(mg_model_dir):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")
    from rollart.model import load_model
    from rollart.trainer.megatron import load_megatron_model

    hf = load_model(mg_model_dir)
    mg = load_megatron_model(mg_model_dir)
    ids = torch.randint(0, hf.config.vocab_size, (3, 11))
    with torch.no_grad():
        a, b = hf(input_ids=ids).logits, mg(input_ids=ids).logits
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
    exported = mg.hf_state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(exported[k], v), k


@needs_megatron
def test_loss_and_grads_match_the_torch_trainer(mg_model_dir, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")
    from rollart.trainer import Trainer
    from rollart.trainer.megatron import MegatronTrainer

    algo = GRPO(group_size=3, groups_per_step=2, lr=1e-3, kl_coef=0.05)
    ref = Trainer(mg_model_dir, str(tmp_path / "a"), algo)
    mg = MegatronTrainer(mg_model_dir, str(tmp_path / "b"), algo)
    batch = _batch(ref.model.config.vocab_size)
    with torch.no_grad():  # move off the KL reference, so the KL term is not 0
        for trainer in (ref, mg):
            asyncio.run(trainer.publish())  # publish version 0 and freeze the reference
            for p in trainer.model.parameters():
                p.mul_(1.02)
    s_ref, s_mg = ref._update(batch), mg._update(batch)
    assert s_mg["trainer/kl"] == pytest.approx(s_ref["trainer/kl"], rel=1e-4)
    assert s_ref["trainer/kl"] > 0
    assert s_mg["trainer/loss"] == pytest.approx(s_ref["trainer/loss"], abs=1e-5)
    assert s_mg["trainer/grad_norm"] == pytest.approx(s_ref["trainer/grad_norm"], rel=1e-4)
    assert s_ref["trainer/grad_norm"] > 0
    grads = {k: p.grad for k, p in mg.model.gpt.named_parameters()}
    hf_grads = megatron_to_hf([grads], ref.model.config)
    for k, p in ref.model.named_parameters():
        assert torch.allclose(hf_grads[k], p.grad, atol=1e-6, rtol=1e-4), k
    # One AdamW step later the weights agree; Adam's first step is ≈ lr·sign(grad), so an
    # element whose true gradient is ~0 (float noise) may move the other way: bounded by
    # 2·lr, and rare (k_proj.bias has an exactly-zero gradient: softmax shift invariance).
    stepped_ref, stepped_mg = ref._hf_state_dict(), mg._hf_state_dict()
    for k, v in stepped_ref.items():
        diff = (stepped_mg[k] - v).abs()
        assert float(diff.max()) <= 2.01 * algo.lr, k
        if not k.endswith("k_proj.bias"):
            assert float((diff < 1e-5).float().mean()) > 0.98, k


def _tp_child(rank: int, world: int, init: str, model_dir: str, out: str) -> None:
    """One TP rank: forward + GRPO loss + backward; rank 0 saves logits, loss, grads."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rollart.model import load_model, load_tokenizer
    from rollart.trainer import collate, compute_advantages, grpo_loss, token_logprobs
    from rollart.trainer.megatron import MegatronLM, init_parallel

    init_parallel(world, rank=rank, world_size=world, init_method=init)
    hf = load_model(model_dir)
    model = MegatronLM(hf.config, hf.state_dict())
    loss, logits = _grpo_loss(model, load_tokenizer(model_dir).pad_token_id,
                              _batch(hf.config.vocab_size), collate, compute_advantages,
                              grpo_loss, token_logprobs)
    loss.backward()
    grads = {k: p.grad for k, p in model.gpt.named_parameters()}
    shards = [None] * world
    dist.all_gather_object(shards, grads, group=parallel_state.get_tensor_model_parallel_group())
    if rank == 0:
        torch.save({"loss": loss.detach(), "logits": logits.detach(),
                    "grads": megatron_to_hf(shards, hf.config)}, out)
    dist.barrier()
    dist.destroy_process_group()


def _grpo_loss(model, pad_id, batch, collate, compute_advantages, grpo_loss, token_logprobs):
    ids, attn, mask, behaviour = collate(batch, pad_id)
    adv = compute_advantages([t.reward for t in batch], [t.group_id for t in batch])
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp = token_logprobs(logits, ids[:, 1:])
    loss, _ = grpo_loss(logp, behaviour[:, 1:], adv, mask[:, 1:])
    return loss, logits


@needs_megatron
@pytest.mark.slow
def test_tensor_parallel_2_over_gloo_matches_hf(mg_model_dir, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")
    import torch.multiprocessing as mp

    from rollart.model import load_model, load_tokenizer
    from rollart.trainer import collate, compute_advantages, grpo_loss, token_logprobs

    out = str(tmp_path / "tp.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {"OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.spawn(_tp_child, args=(2, init, mg_model_dir, out), nprocs=2, join=True)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    got = torch.load(out)
    hf = load_model(mg_model_dir)
    hf.train()
    loss, logits = _grpo_loss(hf, load_tokenizer(mg_model_dir).pad_token_id,
                              _batch(hf.config.vocab_size), collate, compute_advantages,
                              grpo_loss, token_logprobs)
    loss.backward()
    real = collate(_batch(hf.config.vocab_size), 0)[1][:, :-1].bool()  # pads differ, unused
    assert torch.allclose(got["logits"][real], logits.detach()[real], atol=1e-5)
    assert float(got["loss"]) == pytest.approx(float(loss), abs=1e-5)
    for k, p in hf.named_parameters():
        assert torch.allclose(got["grads"][k], p.grad, atol=1e-6, rtol=1e-4), k


def test_policy_names_its_engine_and_trainer_backend():
    from rollart.config.graph import GraphError, Policy
    from rollart.trainer import Trainer, trainer_class
    from rollart.trainer.megatron import MegatronTrainer

    assert Policy().engine == "torch" and Policy().trainer_backend == "torch"
    assert Policy(engine="vllm", trainer_backend="megatron").engine == "vllm"
    with pytest.raises(GraphError, match="Policy.engine"):
        Policy(engine="sglang")
    with pytest.raises(GraphError, match="Policy.trainer_backend"):
        Policy(trainer_backend="deepspeed")
    assert trainer_class("torch") is Trainer and trainer_class("megatron") is MegatronTrainer


@needs_megatron
@pytest.mark.slow
def test_pipeline_trains_with_the_megatron_backend(local_cluster, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")
    from rollart import GRPO, Graph, Policy, train
    from rollart.weights import WeightStore

    graph = Graph(name="t-megatron", tasks=("gridnav",), mode="sync", steps=2,
                  policy=Policy(warmup_steps=5, trainer_backend="megatron"),
                  algo=GRPO(group_size=2, groups_per_step=2))
    result = train(graph, client=local_cluster, run_dir=tmp_path / "run", progress=False,
                   eval_seeds=0)
    assert [r["step"] for r in result.metrics] == [1, 2]
    assert all(r["trainer/grad_norm"] > 0 for r in result.metrics)
    assert WeightStore(f"{result.run_dir}/weights").latest() == 2
