"""Advantages, the GRPO loss, batch collation, the warm-up and the Trainer actor."""

import doctest
import math
import random

import pytest
import torch

import rollart.trainer.advantages as advantages_mod
from rollart.env.trajectory import TokenLog
from rollart.env.tasks import BUILTIN_TASKS
from rollart.config.graph import GRPO
from rollart.model import load_tokenizer
from rollart.trainer import collate, compute_advantages, grpo_loss
from rollart.trainer.warmup import play_random, warmup_batch
from rollart.testing import trajectory


def test_advantages_doctest():
    assert doctest.testmod(advantages_mod).failed == 0


def test_advantages_are_group_normalised():
    adv = compute_advantages([1, 0, 0, 0, 5, 5], ["a", "a", "a", "a", "b", "b"])
    a = adv[:4]
    assert abs(float(a.mean())) < 1e-6 and float(a[0]) > 0 > float(a[1])
    assert adv[4:].abs().max() == 0  # equal rewards: no signal


def test_advantage_scales_weigh_a_penalty_only_group_against_a_success_group():
    rewards = [1, 0, 0, 0, 0, 0, 0, -0.1]  # a success; then a group with one penalty
    groups = ["a"] * 4 + ["b"] * 4
    by = {s: compute_advantages(rewards, groups, scale=s) for s in ("group", "batch", "none")}
    # group: each group's advantages have unit spread, so the penalty weighs as the success
    assert float(by["group"][7]) == pytest.approx(-float(by["group"][0]), rel=1e-4)
    # batch / none: the rewards' own scale between groups (10x), centred per group
    for s in ("batch", "none"):
        a = by[s]
        assert float(a[0]) == pytest.approx(-10 * float(a[7]), rel=1e-4)
        assert abs(float(a[:4].sum())) < 1e-6 and abs(float(a[4:].sum())) < 1e-6
    assert float(by["none"][0]) == pytest.approx(0.75)
    std = torch.tensor(rewards, dtype=torch.float64).std(unbiased=False).item()
    assert float(by["batch"][0]) == pytest.approx(0.75 / std, rel=1e-4)
    assert compute_advantages(rewards, groups, scale=True).tolist() == by["group"].tolist()
    with pytest.raises(ValueError, match="scale must be one of"):
        compute_advantages(rewards, groups, scale="std")


def test_loss_on_policy_equals_negative_mean_advantage():
    logp = torch.log(torch.full((2, 3), 0.5, requires_grad=True))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    for mode in ("decoupled", "tis", "ppo"):
        loss, stats = grpo_loss(logp, logp.detach(), adv, mask, off_policy=mode)
        assert loss.item() == pytest.approx(-(1 + 1 - 2) / 3 * (-math.log(2) if mode == "tis"
                                                                 else 1))
        assert stats["trainer/clip_frac"] == 0
        assert stats["trainer/behaviour_ratio_mean"] == pytest.approx(1)


def test_loss_clips_large_ratios_and_pushes_the_right_way():
    logp = torch.zeros(1, 1, requires_grad=True)
    behaviour = torch.tensor([[-1.0]])  # ratio e ≈ 2.7 > 1.2: clipped for positive A
    loss, stats = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 1),
                            off_policy="ppo")
    assert stats["trainer/clip_frac"] == 1
    loss.backward()
    assert logp.grad.abs().item() == 0  # clipped: no gradient
    logp2 = torch.full((1, 1), -1.0, requires_grad=True)
    loss2, _ = grpo_loss(logp2, behaviour, torch.tensor([1.0]), torch.ones(1, 1),
                         off_policy="ppo")
    loss2.backward()
    assert logp2.grad.item() < 0  # positive advantage raises the token's log-prob


def test_default_correction_stops_pushing_a_stale_token_that_already_rose():
    """The default (``GRPO().off_policy`` and ``grpo_loss``'s) is "ppo": a good token whose
    probability rose past 1 + ε since it was generated gets no further push, where
    "decoupled" (one optimizer step a batch: its own ratio is 1) pushes it twice as hard."""
    assert GRPO().off_policy == "ppo"
    behaviour, adv, mask = torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1)
    grads = {}
    for mode in (None, "decoupled"):
        logp = torch.zeros(1, 1, requires_grad=True)  # π/μ = e
        kw = {} if mode is None else {"off_policy": mode}
        grpo_loss(logp, behaviour, adv, mask, **kw)[0].backward()
        grads[mode] = logp.grad.item()
    assert grads[None] == 0 and grads["decoupled"] == pytest.approx(-2.0)


def test_a_token_the_trainer_rescored_is_pushed_as_if_on_policy():
    """``GRPO.stale_groups="rescore"``: a token of a group kept past the bound has its
    behaviour log-prob marked ``RESCORE`` (``rescore_stale``) and ``grpo_loss`` takes the
    weights being trained as its μ, as a rollout worker re-scoring it at that version
    would: the push its true, older μ would have clipped away comes back, and the
    unmarked token next to it keeps its own μ."""
    from rollart.trainer.losses import rescore_stale

    t = trajectory("t", "g", [1], [5, 6, 7], mask=[1, 1, 0], logprobs=[-1.0, -1.0, 0.0],
                   versions=[0, 3, -1])
    assert rescore_stale([t], min_version=2) == 1 and t.logprobs[0] == math.inf
    assert t.logprobs[1:] == [-1.0, 0.0]
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    grads = {}
    for name, behaviour in (("old", [[-1.0, -1.0]]), ("rescored", [t.logprobs[:2]])):
        logp = torch.zeros(1, 2, requires_grad=True)  # π/μ = e for the old μ: clipped
        loss, stats = grpo_loss(logp, torch.tensor(behaviour), adv, mask)
        loss.backward()
        grads[name] = logp.grad[0].tolist()
        assert not math.isnan(loss.item())
    assert grads["old"] == [0.0, 0.0]
    assert grads["rescored"][0] == pytest.approx(-0.5) and grads["rescored"][1] == 0.0
    assert rescore_stale([t], min_version=0) == 0  # nothing older than the bound
    # a NaN from an engine is not read as re-scored: the loss shows it
    loss, _ = grpo_loss(torch.zeros(1, 1), torch.tensor([[math.nan]]), adv, torch.ones(1, 1))
    assert math.isnan(loss.item())


@pytest.mark.parametrize("mode", ["decoupled", "tis"])
def test_stale_tokens_keep_a_truncated_importance_weighted_gradient(mode):
    # behaviour policy gave the token prob e^-1, the current policy gives it e^0:
    # π/μ = e ≈ 2.72 is truncated to is_cap = 2, and the token still gets a gradient.
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, stats = grpo_loss(logp, torch.tensor([[-1.0]]), torch.tensor([1.0]),
                            torch.ones(1, 1), off_policy=mode, is_cap=2.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-2.0)
    assert stats["trainer/is_truncated_frac"] == 1
    # a mildly stale token (π/μ = 1.5 < cap) is weighted by exactly that ratio
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, _ = grpo_loss(logp, torch.tensor([[-math.log(1.5)]]), torch.tensor([1.0]),
                        torch.ones(1, 1), off_policy=mode, is_cap=2.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.5)


def test_unknown_off_policy_mode():
    with pytest.raises(ValueError, match="off_policy"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1),
                  off_policy="vtrace")


def test_kl_penalty_is_zero_at_reference_and_positive_elsewhere():
    logp = torch.tensor([[-1.0, -2.0]])
    _, s0 = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=logp,
                      kl_coef=0.1)
    _, s1 = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=logp - 0.5,
                      kl_coef=0.1)
    assert s0["trainer/kl"] == pytest.approx(0) and s1["trainer/kl"] > 0


def _traj(prompt, response, mask, lp, group="g", reward=1.0):
    return trajectory("t", group, prompt, response, mask=mask, logprobs=lp,
                      versions=[0 if m else -1 for m in mask], reward=reward)


def test_collate_aligns_tokens_masks_and_logprobs():
    a = _traj([5, 6], [7, 8, 9], [1, 0, 1], [-0.1, 0.0, -0.3])
    b = _traj([5], [7], [1], [-0.2])
    ids, attn, mask, beh = collate([a, b], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert beh[0, 4].item() == pytest.approx(-0.3) and beh[1, 1].item() == pytest.approx(-0.2)


def test_warmup_examples_mark_only_actions(tiny_model):
    tok = load_tokenizer(tiny_model)
    log = play_random(BUILTIN_TASKS["guess"], tok, 7, random.Random(0))
    assert isinstance(log, TokenLog)
    actions = [t for t, m in zip(log.response_ids, log.loss_mask) if m]
    assert tok.eos_token_id in actions
    words = tok.decode([t for t in actions if t != tok.eos_token_id]).split()
    assert words and all(w in "123456789" for w in words)
    ids, attn, mask = warmup_batch(list(BUILTIN_TASKS.values()), tok, 4, random.Random(1))
    assert ids.shape == attn.shape == mask.shape and mask.sum() > 0


def test_trainer_actor_steps_from_buffer_and_publishes(local_cluster, tiny_model, tmp_path):
    from rollart.buffer import SampleBuffer
    from rollart.testing import unique_key
    from rollart.trainer import Trainer
    from rollart.types import CPU_ENV, TRAIN
    from rollart.weights import WeightStore

    c = local_cluster
    store = str(tmp_path / "weights")
    trainer_key = unique_key("trainer-test")
    trainer = c.submit(Trainer, tiny_model, store, GRPO(group_size=2, groups_per_step=2),
                       actor=True, resources={TRAIN: 1}, key=trainer_key).result()
    buf = c.submit(SampleBuffer, None, actor=True, resources={CPU_ENV: 1},
                   key=unique_key("buffer-test")).result()
    assert trainer.publish().result() == 0
    v0 = WeightStore(store).get(0)
    for g in range(2):
        for i in range(2):
            t = _traj([3, 4], [5, 1], [1, 1], [-3.0, -3.0], group=f"g{g}", reward=float(i))
            t.traj_id = f"g{g}-{i}"
            buf.put(t, 2).result()
    m = trainer.train_step(buf, 1, timeout=30).result()
    assert m["version"] == 1 and m["step"] == 1 and m["trainer/batch_size"] == 4
    assert m["reward/gridnav"] == 0.5 and m["trainer/staleness_max"] == 0
    assert WeightStore(store).latest() == 1
    v1 = WeightStore(store).get(1)
    assert any(not torch.equal(v0[k], v1[k]) for k in v0)
    assert buf.counts().result()["trained"] == 4
    where = c.run(lambda dask_worker: list(dask_worker.state.actors))
    trainer_worker = [a for a, keys in where.items() if trainer_key in keys]
    assert c.scheduler_info()["workers"][trainer_worker[0]]["resources"].get(TRAIN) == 1


def test_the_trainer_scales_advantages_as_its_algo_says(tiny_model, tmp_path, monkeypatch):
    from rollart.trainer import Trainer
    from rollart.trainer import trainer as trainer_mod

    seen = []
    real = trainer_mod.compute_advantages

    def spy(rewards, groups, **kw):
        seen.append(kw.get("scale"))
        return real(rewards, groups, **kw)

    monkeypatch.setattr(trainer_mod, "compute_advantages", spy)
    batch = [_traj([3, 4, 5], [6, 7], [1, 1], [-1.0, -1.0], group="g", reward=r)
             for r in (1.0, 0.0)]
    for scale in ("batch", "none"):
        algo = GRPO(group_size=2, groups_per_step=1, scale_rewards=scale)
        Trainer(tiny_model, str(tmp_path / scale), algo, seed=0)._update(batch)
    assert seen == ["batch", "none"]


class _FullLogits(torch.nn.Module):
    """A policy whose forward takes neither ``logits_to_keep`` nor ``use_cache`` (as
    the Megatron wrapper's): full logits, cut by ``target_logprobs`` itself."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("wrap", [False, True])
def test_target_logprobs_are_the_full_forwards_where_needed(tiny_model, wrap):
    """Log-probs (and their gradients) at the needed positions equal the full forward's;
    the columns no row needs are 0 (their logits are never computed: a Hugging Face
    model gets ``logits_to_keep``)."""
    from rollart.model import load_model
    from rollart.trainer.losses import target_logprobs, token_logprobs

    torch.manual_seed(0)
    model = load_model(tiny_model)
    policy = _FullLogits(model) if wrap else model
    ids = torch.randint(3, 20, (3, 12))
    attn = torch.ones_like(ids)
    attn[2, 9:] = 0  # right padding
    need = torch.zeros(3, 11, dtype=torch.bool)
    need[0, 4:6] = need[1, 8] = need[2, 2] = True
    got = target_logprobs(policy, ids, attn, need, temperature=0.7)
    full = token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1],
                          ids[:, 1:], 0.7)
    cols = need.any(0)
    assert got.shape == (3, 11) and bool((got[:, ~cols] == 0).all())
    torch.testing.assert_close(got[:, cols], full[:, cols], rtol=1e-5, atol=1e-5)
    grads = []
    for logp in (got, full):
        model.zero_grad()
        (logp * need).sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    nothing = target_logprobs(policy, ids, attn, torch.zeros_like(need))
    assert nothing.requires_grad and float(nothing.detach().abs().sum()) == 0


def test_micro_batches_sort_by_length_and_bound_padded_tokens():
    from rollart.trainer.trainer import micro_batches

    lengths = [30, 5, 12, 40, 7, 100]
    parts = micro_batches(lengths, 64)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert parts[0] == [1, 4, 2]  # shortest first
    for p in parts:
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 64
    assert micro_batches(lengths, 0) == [list(range(6))]


def _one_update(model_dir, weights, batch, kl_coef, tokens, share=True):
    """``Trainer._update`` on ``batch`` from fresh weights: ``(stats, gradients)``; with
    KL, against a reference that differs from the policy."""
    from rollart.trainer import Trainer

    algo = GRPO(group_size=4, groups_per_step=3, kl_coef=kl_coef, micro_batch_tokens=tokens)
    tr = Trainer(model_dir, str(weights), algo, seed=0)
    tr.share_prompts = share
    if kl_coef:
        tr.ref_model = tr._frozen_copy().eval()
        with torch.no_grad():
            for p in tr.ref_model.parameters():
                p.add_(0.01)
    stats = tr._update(batch)
    return stats, {k: p.grad.clone() for k, p in tr.model.named_parameters()
                   if p.grad is not None}


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_micro_batched_update_equals_the_whole_batch_update(tiny_model, tmp_path, kl_coef):
    """Same token-mean loss, same gradient, same step: micro-batches only change how the
    batch is cut (and how much padding is computed)."""
    rng = random.Random(0)
    batch = []
    for g in range(3):
        for i in range(4):
            n_p, n_r = rng.randint(2, 9), rng.randint(1, 12)
            mask = [rng.random() < 0.7 for _ in range(n_r)]
            t = _traj([rng.randint(3, 20) for _ in range(n_p)],
                      [rng.randint(3, 20) for _ in range(n_r)], [int(m) for m in mask],
                      [-rng.random() * 3 if m else 0.0 for m in mask], group=f"g{g}",
                      reward=rng.random())
            batch.append(t)
    (whole, g_whole), (micro, g_micro) = (
        _one_update(tiny_model, tmp_path / f"w{tokens}", batch, kl_coef, tokens)
        for tokens in (0, 24))
    assert whole["trainer/micro_batches"] == 1 and micro["trainer/micro_batches"] > 3
    for k in ("trainer/loss", "trainer/grad_norm", "trainer/clip_frac", "trainer/tokens"):
        assert micro[k] == pytest.approx(whole[k], rel=1e-4, abs=1e-6), k
    if kl_coef:
        assert micro["trainer/kl"] == pytest.approx(whole["trainer/kl"], rel=1e-4)
    assert g_whole and g_micro.keys() == g_whole.keys()
    scale = max(float(g.abs().max()) for g in g_whole.values())
    for k in g_whole:  # the accumulated (clipped) gradient is the whole batch's
        torch.testing.assert_close(g_micro[k], g_whole[k], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("kl_coef,tokens", [(0.0, 0), (0.1, 0), (0.1, 40)])
def test_shared_prompt_update_equals_the_per_row_update(tiny_model, tmp_path, kl_coef,
                                                        tokens):
    """A group's members computed on their prompt's KV (the prompt forwarded once per
    part) give the per-row forward's loss, statistics and gradient; rows without
    a partner, and a group cut into parts by ``micro_batch_tokens``, included."""
    rng = random.Random(1)
    batch = []
    for g in range(3):
        prompt = [rng.randint(3, 20) for _ in range(rng.randint(3, 9))]
        for i in range(4):
            n_r = rng.randint(1, 12)
            mask = [rng.random() < 0.7 for _ in range(n_r)]
            batch.append(_traj(prompt, [rng.randint(3, 20) for _ in range(n_r)],
                               [int(m) for m in mask],
                               [-rng.random() * 3 if m else 0.0 for m in mask],
                               group=f"g{g}", reward=rng.random()))
    batch.append(_traj([5, 6, 7], [8, 9], [1, 1], [-1.0, -2.0], group="solo", reward=1.0))
    (plain, g_plain), (shared, g_shared) = (
        _one_update(tiny_model, tmp_path / f"w{share}", batch, kl_coef, tokens, share)
        for share in (False, True))
    assert plain["trainer/shared_prompt_rows"] == 0
    assert shared["trainer/shared_prompt_rows"] == 12  # every group's members; not "solo"
    if tokens:  # a group's prompt + padded responses over 40 tokens: cut in parts
        assert shared["trainer/micro_batches"] > 4
    for k in ("trainer/loss", "trainer/grad_norm", "trainer/clip_frac", "trainer/tokens"):
        assert shared[k] == pytest.approx(plain[k], rel=1e-4, abs=1e-6), k
    if kl_coef:
        assert shared["trainer/kl"] == pytest.approx(plain["trainer/kl"], rel=1e-4)
    scale = max(float(g.abs().max()) for g in g_plain.values())
    assert g_shared.keys() == g_plain.keys()
    for k in g_plain:
        torch.testing.assert_close(g_shared[k], g_plain[k], rtol=1e-4, atol=1e-5 * scale)


def test_warmup_runs_on_its_own_thread_count_and_restores_the_trainers(tiny_model,
                                                                       tmp_path):
    # the laptop layout gives the trainer 1 thread, sized for sharing the host with
    # rollout; the warm-up runs before rollout computes, on every core (or
    # Policy.warmup_threads), and RL steps then run on the trainer's count again
    import asyncio

    from rollart.runtime.resources import usable_cores
    from rollart.trainer import Trainer

    trainer = Trainer(tiny_model, str(tmp_path / "weights"),
                      GRPO(group_size=2, groups_per_step=2))
    seen = []
    trainer._warmup_step = lambda n: seen.append(torch.get_num_threads())
    in_executor = lambda: trainer._pool.submit(torch.get_num_threads).result()  # noqa: E731
    trainer._pool.submit(torch.set_num_threads, 1).result()
    tasks = [BUILTIN_TASKS["gridnav"]]
    asyncio.run(trainer.warmup(tasks, 2, 2, 1e-3, threads=3))
    assert seen == [3, 3] and in_executor() == 1
    asyncio.run(trainer.warmup(tasks, 1, 2, 1e-3))
    assert seen[-1] == usable_cores() and in_executor() == 1
    trainer._pool.shutdown()


def test_a_tied_head_is_published_once(tiny_model, tmp_path):
    """The built-in model ties its head to its input embedding: a version carries that
    tensor once, and an engine's model loading it gets the trainer's head too."""
    import asyncio

    from rollart import GRPO
    from rollart.model import load_model
    from rollart.trainer import Trainer
    from rollart.weights import WeightStore

    t = Trainer(tiny_model, str(tmp_path / "w"), GRPO())
    assert "lm_head.weight" in t.model.state_dict()
    with torch.no_grad():
        t.model.get_input_embeddings().weight.add_(1.0)  # not the folder's weights
    asyncio.run(t.publish())
    state = WeightStore(str(tmp_path / "w")).get(0)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    emb = t.model.get_input_embeddings().weight
    assert t.bytes_published < sum(v.numel() * v.element_size()
                                   for v in t.model.state_dict().values())
    engine_model = load_model(tiny_model)
    engine_model.load_state_dict(state, strict=False)
    assert torch.equal(engine_model.get_output_embeddings().weight, emb)
