"""``Trainer``: the Dask actor on the TRAIN pool that turns buffered trajectories into
new policy versions.

One ``train_step``: pull ``groups_per_step`` complete groups no older than
``version - alpha`` from the ``SampleBuffer`` (``taken`` for the step) → group-normalised
advantages → clipped GRPO loss against the behaviour log-probs (optional KL to the
initial policy) → AdamW with gradient clipping → publish ``version + 1`` to the
``WeightStore`` → confirm to the buffer (``mark_trained``: the batch is ``trained``).
Compute runs in a thread the actor owns, so the worker's event loop stays free for
heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch

from rollart.buffer.buffer import TAKE_KEY
from rollart.buffer.schema import batch_digest, batch_metrics, from_table  # noqa: F401 (re-exported)
from rollart.model import load_tokenizer
from rollart.runtime.devices import worker_device
from rollart.runtime.resources import set_worker_threads, usable_cores
from rollart.policy.staleness import StalenessBound
from rollart.trainer.advantages import compute_advantages
from rollart.trainer.backend import TorchBackend
from rollart.trainer.losses import (grpo_loss, rescore_stale, shared_prompt_logprobs,
                                     shares_prompts, target_logprobs)
from rollart.trainer.state import TrainerState
from rollart.trainer.warmup import run_warmup
from rollart.weights import WeightStore
from rollart.weights import lora

logger = logging.getLogger(__name__)


def with_threads(threads: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on ``threads`` torch threads, then the thread's count as it
    was. Call it in the thread that computes: under OpenMP the count is per thread, so
    setting it from another thread (the actor's event loop) would not reach the trainer's
    executor."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


def leave_dead_gang() -> None:
    """Leave the process group of a trainer gang this process held a rank of (and
    megatron's parallel state over it), if any: every trainer calls it as it is built.

    The default process group is the process's, not an actor's: the worker of a gang's
    rank keeps it when the gang dies (rank 0's worker lost, the gang failed), and the
    next trainer built there, a one-process trainer or a rank of the next gang, would
    take itself for that group's rank: ``save_pretrained`` writes neither config nor
    weights on a rank other than 0 (transformers' ``should_save_on_this_rank``), and a
    collective waits on peers that are gone. A trainer is built in a process only when
    the gang there is over (the gang fails as one and forms anew: new actors), so the
    group is left whole. A world of one (the one-process Megatron trainer's own group)
    is kept."""
    import sys

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    logger.info("leaving the process group of a dead trainer gang (rank %d of %d) before "
                "a new trainer starts in this process", dist.get_rank(), dist.get_world_size())
    state = sys.modules.get("megatron.core.parallel_state")  # imported only if used
    if state is not None and state.model_parallel_is_initialized():
        state.destroy_model_parallel()
    dist.destroy_process_group()


class Trainer(TrainerState):
    """Holds the policy being trained and its optimizer.

    ``algo`` is a ``rollart.GRPO``; ``temperature`` must match the sampling temperature
    so that new and behaviour log-probs are comparable.
    """

    warmup_done = 0  # warm-up steps done: the driver reads it for its bar (an attribute
    # a Dask actor serves must exist on the class)
    #: a group's members (equal prompts) are trained with their prompt computed once
    #: (``_parts``); the result is the per-row forward's (up to float rounding)
    share_prompts = True

    def __init__(self, model_path: str, store_url: str, algo, *, temperature: float = 1.0,
                 threads: int | None = None, seed: int = 0, lora: dict | None = None,
                 backend: TorchBackend | None = None):
        leave_dead_gang()  # before the policy is built: a Megatron one joins a group
        # how the policy is held (rollart.trainer.backend): the HF model's, or another's
        self.backend = backend if backend is not None else TorchBackend()
        set_worker_threads(threads)
        torch.manual_seed(seed)
        self.algo = algo
        self.temperature = temperature
        self.model_path = str(model_path)
        self.device = worker_device()  # its worker's GPU, else the CPU
        self.model = self._load_policy(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.store = WeightStore(store_url)
        self.version = 0
        self.ref_model = None
        # LoRA (Policy.lora, as peft options; rollart.weights.lora): the peft model once
        # wrapped (self.model is then its inner model, adapted layers injected), the store
        # version holding the base the adapters apply to (-1: the model folder's), and
        # whether a warm-up changed the base since
        self.lora, self.peft = lora, None
        self.base_version, self._base_dirty = -1, False
        self.bytes_published = 0  # the newest version's, as stored
        self.optimizer = self._make_optimizer()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollart-trainer")
        self.busy_seconds = 0.0
        self.waited_seconds = 0.0
        self.stepping = False  # a train_step is running
        self._warmup_stop = threading.Event()  # set by stop_warmup: the run was stopped

    def _load_policy(self, model_path: str):
        """The model being trained (the backend's: ``rollart.trainer.backend``), on this
        worker's device (``rollart.runtime.devices.worker_device``)."""
        return self.backend.load_policy(model_path, self.device)

    def _hf_state_dict(self) -> dict:
        """The policy's weights under Hugging Face names, as the weight store holds them
        (in host memory: the store writes bytes)."""
        return self.backend.hf_state_dict(self.model)

    def _frozen_copy(self):
        """A copy of the current policy, the KL reference."""
        return self.backend.frozen_copy(self.model)

    def _put_weights(self) -> None:
        """Publish ``self.version``: every weight, or with LoRA the adapter only (the
        warmed base first, once, as a full version of its own: the adapters apply to
        it; an unwarmed one is the model folder's, which every engine loads)."""
        if self.lora is None:
            self.bytes_published = self.store.put(self.version, self._hf_state_dict())
            return
        if self.peft is None:
            if self._base_dirty:
                self.bytes_published = self.store.put(self.version, self._hf_state_dict())
                self.base_version, self._base_dirty = self.version, False
                self._wrap()
                return
            self._wrap()
        self.bytes_published = self.store.put(self.version, lora.adapter_state(self.peft),
                                              lora.metadata(self.base_version, self.lora))

    def _wrap(self) -> None:
        """LoRA: wrap the policy in a fresh adapter; only the adapter trains from now on
        (the optimizer is rebuilt on it)."""
        self.peft = lora.wrap(self.model, self.lora)
        self.model = self.peft.get_base_model()
        self.optimizer = self._make_optimizer()

    def _gc(self) -> list[int]:
        return self.store.gc(3, protect=(self.base_version,) if self.lora else ())

    def _make_optimizer(self):
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: adapters
        return torch.optim.AdamW(params, lr=self.algo.lr,
                                 weight_decay=self.algo.weight_decay, betas=(0.9, 0.99))

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        finally:
            self.busy_seconds += time.perf_counter() - t0

    # -- actor methods ------------------------------------------------------------------
    async def warmup(self, tasks, steps: int, batch_size: int, lr: float, seed: int = 0,
                     threads: int | None = None, bare_tool_steps: int = 0,
                     episode_threads: int | None = None, obs_weight: float = 1.0,
                     **conversation):
        """Supervised warm-up before RL (see ``rollart.trainer.warmup``), in
        the rollout's conversation format (``Policy.conversation_options()``), on
        ``threads`` torch threads (``Policy.warmup_threads``; None: every core this
        process may use). The warm-up runs before anything else of the run computes
        (rollout waits for the first weights), so the trainer's own thread limit, sized
        for sharing the host with rollout, is lifted for it and restored after.
        ``bare_tool_steps`` (``Policy.warmup_bare_tool_steps``) come first; the progress
        counter counts both stages. ``stop_warmup`` ends it after the step in progress
        (the run was asked to stop). ``obs_weight`` 0: the loss on the model's turns only
        (a pretrained model's demonstrations, ``Policy.warmup_pretrained``)."""
        losses = await self._run(with_threads, threads or usable_cores(), run_warmup,
                                 self.model, self.tokenizer, list(tasks), steps=steps,
                                 batch_size=batch_size, lr=lr, seed=seed,
                                 bare_tool_steps=bare_tool_steps,
                                 episode_threads=episode_threads, obs_weight=obs_weight,
                                 on_step=self._warmup_step, stop=self._warmup_stop,
                                 **conversation)
        self.optimizer = self._make_optimizer()  # RL starts with fresh optimizer state
        self._base_dirty = self.lora is not None  # LoRA: publish this base once
        return {"warmup/loss_first": losses[0] if losses else None,
                "warmup/loss_last": losses[-1] if losses else None,
                "warmup/steps": len(losses)}

    def _warmup_step(self, n: int) -> None:
        self.warmup_done = n

    async def stop_warmup(self) -> None:
        """End the warm-up in progress (or the next one) after its current step: the run
        was asked to stop (``Run.stop``); served on the worker's event loop while the
        warm-up computes in the trainer's thread."""
        self._warmup_stop.set()

    async def publish(self) -> int:
        """Put the current weights into the store as ``self.version``."""
        await self._publish()
        if self.algo.kl_coef > 0 and self.ref_model is None and self.lora is None:
            self.ref_model = self._frozen_copy().eval()  # LoRA: the adapter turned off
        return self.version

    async def train_step(self, buffer, step: int, timeout: float | None = None) -> dict:
        """Pull a bounded-stale batch, update the policy, publish the next version."""
        self.stepping = True
        try:
            return await self._train_step(buffer, step, timeout)
        finally:
            self.stepping = False

    async def _train_step(self, buffer, step: int, timeout: float | None) -> dict:
        t0 = time.perf_counter()
        min_version = StalenessBound(self.algo.alpha).min_version(self.version)
        table = await buffer.get_table(self.algo.groups_per_step, min_version,
                                       timeout=timeout, trained_step=step)
        batch = await self._run(from_table, table)  # off the event loop, as compute is
        waited = time.perf_counter() - t0
        self.waited_seconds += waited
        rescored = rescore_stale(batch, min_version) \
            if self.algo.stale_groups == "rescore" else 0
        metrics = await self._compute(batch)
        metrics["trainer/rescored_tokens"] = rescored
        trained_on = self.version
        self.version += 1
        await self._publish()
        await self._confirm(buffer, step, (table.schema.metadata or {}).get(TAKE_KEY))
        await self._run(self._gc)
        metrics.update(batch_metrics(batch, trained_on))
        metrics["weights/bytes_published"] = self.bytes_published
        metrics.update({"step": step, "version": self.version,
                        "trainer/wait_s": waited, "trainer/step_s": time.perf_counter() - t0})
        return metrics

    async def _publish(self) -> None:
        """Publish ``self.version`` (a gang's ranks each write their buckets:
        ``rollart.trainer.gang``)."""
        await self._run(self._put_weights)

    async def _compute(self, batch) -> dict:
        """One optimizer step on ``batch`` (a gang's rank 0 spreads it over its ranks:
        ``rollart.trainer.gang``)."""
        return await self._run(self._update, batch)

    async def _confirm(self, buffer, step: int, take: bytes | None) -> None:
        """Tell the buffer that step ``step``'s update is published: the batch it handed
        out as ``take`` is ``trained``. A buffer lost meanwhile is not this step's
        failure: its recovered successor settles the batch at the next ``get_table``
        (this trainer's version is then newer than the one the batch was taken for)."""
        try:
            await buffer.mark_trained(step, take.decode() if take else None)
        except Exception as e:  # noqa: BLE001 - settled by the next get_table
            logger.warning("step %d: confirming the trained batch failed (%r); the next "
                           "get_table settles it", step, e)

    async def restore_latest(self) -> int:
        """Load the newest version published to the weight store (a Trainer re-created
        after its worker was lost); returns that version. Unreadable versions are skipped.
        The optimizer state and KL reference stay as they are: a fresh trainer's (moments
        restart; the reference is then this version), or a checkpoint's loaded just
        before (``load_state(truncate=False)``: its moments, and the run's reference)."""
        if self.lora is not None:
            self.version = await self._run(self._restore_adapter)
            return self.version
        version, state = await self._run(self.store.get_newest_readable)
        self._load_hf(self.model, state)  # HF names: a Megatron policy converts them
        self.version = version
        if self.algo.kl_coef > 0 and self.ref_model is None:
            self.ref_model = self._frozen_copy().eval()
        return version

    def _restore_adapter(self) -> int:
        """LoRA ``restore_latest``: the newest version's adapter, on its base (loaded from
        the store first when it is not the model folder's and not held yet)."""
        version, state, meta = self.store.get_newest_readable(meta=True)
        base = lora.base_of(meta)
        if base is None:  # the newest is the warmed base itself (no adapter trained yet)
            base, state = version, None
        if self.peft is None:
            if base >= 0:
                self._load_hf(self.model, self.store.get(base))
            self.base_version, self._base_dirty = base, False
            self._wrap()
        if state is not None:
            lora.load_adapter(self.peft, state)
        return version

    async def save(self, path: str) -> str:
        """Write the policy as a Hugging Face model folder (model + tokenizer); with LoRA
        a peft adapter folder (``AutoPeftModelForCausalLM`` loads it), whose base is the
        model folder or, after a warm-up, the full model in ``PATH/base``."""
        await self._run(self._save_hf, path)
        return path

    async def save_state(self, url: str) -> dict:
        """Write this trainer's part of a checkpoint under ``url`` (see
        ``rollart.control.checkpoint``): ``model/``, ``ref_model.safetensors``, ``trainer.pt``.
        Returns their manifest entries."""
        return await self._run(self._save_state, url)

    async def load_state(self, url: str, truncate: bool = True) -> int:
        """Restore weights, optimizer, version and RNG from a checkpoint at ``url``;
        returns the restored version. ``truncate``: remove the store's versions newer
        than the checkpoint's (``--resume``: a lost run's later updates are redone, and
        their rows set aside with them). A trainer replaced mid-run passes False: those
        versions hold updates whose rows are ``trained``, and it continues from the
        newest of them (``rollart.control.supervisor.Supervisor``)."""
        return await self._run(self._load_state, url, truncate)

    async def stats(self) -> dict:
        return {"version": self.version, "busy_s": self.busy_seconds,
                "waited_s": self.waited_seconds, "stepping": self.stepping}

    # -- compute (trainer thread) -------------------------------------------------------
    def _update(self, batch) -> dict:
        """One optimizer step on ``batch``: the token-mean GRPO loss over the whole batch,
        its gradient accumulated over micro-batches (``_parts``)."""
        adv = compute_advantages([t.reward for t in batch], [t.group_id for t in batch],
                                 scale=self.algo.scale_rewards)
        pad = self.tokenizer.pad_token_id
        parts = self._parts(batch)
        collated = [collate_shared([batch[i] for i in rows], pad) if shared
                    else collate([batch[i] for i in rows], pad) for rows, shared in parts]
        counts = [float(_loss_mask(c).sum()) for c in collated]
        loss_sum, stats = self._backward(
            [(rows, c, n) for (rows, _), c, n in zip(parts, collated, counts)], adv,
            max(sum(counts), 1.0))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   self.algo.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        stats.update({"trainer/loss": loss_sum, "trainer/grad_norm": float(grad_norm),
                      "trainer/tokens": int(sum(counts)),
                      "trainer/micro_batches": len(parts), "trainer/ranks": 1,
                      "trainer/shared_prompt_rows": sum(len(r) for r, s in parts if s),
                      "trainer/adv_abs_mean": float(adv.abs().mean())})
        return dict(stats)

    def _backward(self, plan: list, adv: torch.Tensor, total: float, scale: float = 1.0
                  ) -> tuple[float, dict]:
        """Zero the gradients, then forward and backward each micro-batch of ``plan``
        (``(rows, collated tensors, trained tokens)``), its token-mean loss weighted by
        its tokens over ``total`` (the whole batch's) and by ``scale`` (a gang's rank
        count: FSDP2 averages over ranks). Returns the weighted loss and statistics."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, stats = 0.0, defaultdict(float)
        for rows, tensors, n in plan:
            loss, part_stats = self._loss(tensors, adv[rows])
            share = n / total  # each part's token mean, weighted by its tokens
            (loss * (share * scale)).backward()
            loss_sum += loss.item() * share
            for k, v in part_stats.items():
                stats[k] += v * share
        return loss_sum, stats

    def _parts(self, batch) -> list[tuple[list[int], bool]]:
        """The batch's micro-batches: ``(rows, shared)``.

        Rows whose prompts are equal (a GRPO group's members) go together, ``shared``:
        their prompt is computed once (``shared_prompt_logprobs``), in parts whose prompt
        plus padded responses stay within ``micro_batch_tokens``. The other rows, and all
        of them when ``share_prompts`` is off or the model cannot share
        (``shares_prompts``: e.g. the Megatron backend's), go in length-sorted parts
        (``micro_batches``)."""
        budget = self.algo.micro_batch_tokens
        alone = list(range(len(batch)))
        parts: list[tuple[list[int], bool]] = []
        if self.share_prompts and shares_prompts(self.model) and \
                (self.ref_model is None or shares_prompts(self.ref_model)):
            groups: dict[tuple, list[int]] = defaultdict(list)
            for i, t in enumerate(batch):
                if t.prompt_ids and t.response_ids:
                    groups[tuple(t.prompt_ids)].append(i)
            shared = {i for rows in groups.values() if len(rows) > 1 for i in rows}
            alone = [i for i in alone if i not in shared]
            for prompt, rows in groups.items():
                if len(rows) < 2:
                    continue
                room = max(budget - len(prompt), 1) if budget > 0 else 0
                for cut in micro_batches([len(batch[i].response_ids) for i in rows], room):
                    parts.append(([rows[k] for k in cut], True))
        lengths = [len(batch[i].prompt_ids) + len(batch[i].response_ids) for i in alone]
        parts += [([alone[k] for k in cut], False)
                  for cut in micro_batches(lengths, budget) if cut]
        return parts

    def _loss(self, tensors, adv):
        """The GRPO loss (token mean) and its statistics on one collated micro-batch:
        ``collate``'s tensors, or ``collate_shared``'s (a shared prompt), moved to the
        policy's device."""
        tensors = tuple(t.to(self.device) for t in tensors)
        adv = adv.to(self.device)
        if len(tensors) == 5:
            prompt, resp, attn, mask, behaviour = tensors
            need = mask > 0

            def logprobs(model):
                return shared_prompt_logprobs(model, prompt, resp, attn, need,
                                              self.temperature)
        else:
            ids, attn, mask, behaviour = tensors
            mask, behaviour, need = mask[:, 1:], behaviour[:, 1:], mask[:, 1:] > 0

            def logprobs(model):
                return target_logprobs(model, ids, attn, need, self.temperature)
        logp = logprobs(self.model)
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp = logprobs(self.ref_model)
        elif self.peft is not None and self.algo.kl_coef > 0:  # the base: adapter off
            with torch.no_grad(), self.peft.disable_adapter():
                ref_logp = logprobs(self.model)
        return grpo_loss(logp, behaviour, adv, mask,
                         clip_eps=self.algo.clip_eps, ref_logp=ref_logp,
                         kl_coef=self.algo.kl_coef, off_policy=self.algo.off_policy,
                         is_cap=self.algo.is_cap)


def _loss_mask(tensors) -> torch.Tensor:
    """The trained tokens of a collated micro-batch (``collate`` or ``collate_shared``)."""
    return tensors[3] if len(tensors) == 5 else tensors[2][:, 1:]


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices sorted by length, cut so that each part's padded size (rows × its
    longest row) stays within ``max_tokens`` (a row longer than that goes alone);
    ``max_tokens == 0``: one part in the original order."""
    if max_tokens <= 0:
        return [list(range(len(lengths)))]
    parts: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if parts and (len(parts[-1]) + 1) * lengths[i] <= max_tokens:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


def collate_shared(batch, pad_id: int):
    """``(prompt, responses, attention, loss_mask, behaviour_logp)`` of rows that share
    their prompt: ``prompt`` ``[1, P]``, the rest ``[B, R]`` right-padded responses
    (position ``j`` describes response token ``j``)."""
    width = max(len(t.response_ids) for t in batch)
    B = len(batch)
    prompt = torch.tensor([list(batch[0].prompt_ids)], dtype=torch.long)
    resp = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.float32)
    behaviour = torch.zeros((B, width), dtype=torch.float32)
    for i, t in enumerate(batch):
        r = len(t.response_ids)
        resp[i, :r] = torch.tensor(t.response_ids, dtype=torch.long)
        attn[i, :r] = 1
        mask[i, :r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        behaviour[i, :r] = torch.tensor(t.logprobs, dtype=torch.float32)
    return prompt, resp, attn, mask, behaviour


def collate(batch, pad_id: int):
    """Right-padded ``(ids, attention, loss_mask, behaviour_logp)`` tensors.

    All four are ``[B, T]`` aligned with ``ids``: position ``t`` describes token ``t``.
    """
    length = max(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    B = len(batch)
    ids = torch.full((B, length), pad_id, dtype=torch.long)
    attn = torch.zeros((B, length), dtype=torch.long)
    mask = torch.zeros((B, length), dtype=torch.float32)
    behaviour = torch.zeros((B, length), dtype=torch.float32)
    for i, t in enumerate(batch):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[i, :p + r] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attn[i, :p + r] = 1
        mask[i, p:p + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        behaviour[i, p:p + r] = torch.tensor(t.logprobs, dtype=torch.float32)
    return ids, attn, mask, behaviour
