"""What every rank of a trainer gang does (``rollart.trainer.gang`` has the gang and its
rank 0): join the process group, take rank 0's policy and shard it with FSDP2, train its
share of a step, write its buckets of a published version, write its own shards of a
checkpoint (``_save_shards``: torch.distributed.checkpoint, nothing gathered) and read
its own shard of a checkpoint's AdamW state when the gang forms (``_shard``). The work
runs in the rank's trainer thread; every method that holds a collective is called on
every rank, in the same order.

``GangMember`` is the ``Trainer`` that both ``GangRank`` (ranks 1..N-1, each a Dask actor
on its TRAIN worker, started by rank 0) and ``GangTrainer`` (rank 0) build on. What is
FSDP2's is its backend, a part it holds (``FsdpBackend``: ``shard``,
``publish_state``/``whole``, ``grad_norm``, ``loss_scale``; ``full_optimizer`` for a
gathered checkpoint); the Megatron gang (``rollart.trainer.megatron_gang``) holds another
backend and keeps the rest: joining, the token-weighted step over the data-parallel
shares, the buckets (its checkpoints are gathered: ``backend.sharded_checkpoints``). The
plain helpers: ``balance`` (token-balanced shares of a batch), ``buckets`` (a version's
cut into buckets, the same on every rank), ``decoder_blocks`` (what ``fully_shard``
wraps), ``leave_gang``.
"""

from __future__ import annotations

import datetime

import torch

from rollart.trainer.shards import DCP_DIR, METADATA, dcp_storage, hash_files
from rollart.trainer.backend import TorchBackend, without_tied_head
from rollart.trainer.trainer import Trainer, _loss_mask, collate, micro_batches

__all__ = ["FsdpBackend", "GangMember", "GangRank", "balance", "buckets", "decoder_blocks",
           "leave_gang"]

def balance(lengths: list[int], n: int) -> list[list[int]]:
    """Row indices split into ``n`` shares of nearly equal total length: longest first,
    each to the share with the fewest tokens so far (ties: the lower rank). Each share in
    row order.

    >>> balance([5, 1, 4, 2, 3], 2)
    [[0, 1, 3], [2, 4]]
    """
    loads = [0] * n
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(n), key=lambda k: (loads[k], k))
        shares[k].append(i)
        loads[k] += lengths[i]
    return [sorted(s) for s in shares]


def buckets(state: dict, bucket_bytes: int) -> list[list[str]]:
    """``state``'s names in order, cut into buckets of at least ``bucket_bytes`` (the last
    may be smaller; a tensor never spans two). Sizes are the whole tensors' (a DTensor's
    global shape), so every rank cuts alike.

    >>> t = torch.zeros(4)  # 16 bytes
    >>> buckets({"a": t, "b": t, "c": t}, 20)
    [['a', 'b'], ['c']]
    """
    out: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        if size >= bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += t.numel() * t.element_size()
    return [b for b in out if b]


def decoder_blocks(model) -> list:
    """The model's repeated blocks, each sharded on its own: modules whose class the
    model names in ``_no_split_modules`` (Hugging Face's list of its decoder layers), else
    the members of its longest ``ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def leave_gang() -> None:
    """Leave this process's gang, if any (its process group destroyed)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class FsdpBackend(TorchBackend):
    """How the ranks of a torch gang hold the Hugging Face policy: FSDP2 over all ranks
    (a part ``GangMember`` holds, ``trainer.backend``; ``rollart.trainer.megatron_gang``
    has Megatron's)."""

    tp = 1  # ranks per tensor-parallel group (FSDP2: every rank its own share)
    #: checkpoints sharded with torch.distributed.checkpoint (``GangMember._save_shards``)
    sharded_checkpoints = True

    def leave(self) -> None:
        """Leave this process's gang, if any."""
        leave_gang()

    def shard(self, t: GangMember, optimizer_state: bool, dcp: str | None = None) -> None:
        """Every rank of ``t``'s gang takes rank 0's weights and KL reference (broadcast,
        tensor by tensor, before sharding), then shards every decoder block and the root
        over all ranks; with ``optimizer_state``, rank 0's AdamW moments (a one-process
        layout checkpoint's) reach every rank's shard (``set_optimizer_state_dict``,
        broadcast from rank 0); with ``dcp`` (a sharded checkpoint's folder), every rank
        reads its own shard of the moments from it (``_read_dcp``: nothing gathered on
        rank 0)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        for w in t.model.state_dict().values():
            dist.broadcast(w.data, 0)
        if t.algo.kl_coef > 0:
            if t.ref_model is None:  # members: rank 0's reference comes next
                t.ref_model = t._frozen_copy().eval()
            for w in t.ref_model.state_dict().values():
                dist.broadcast(w.data, 0)
        full = None
        if optimizer_state and t.rank == 0:
            full = get_optimizer_state_dict(t.model, t.optimizer,
                                            options=StateDictOptions(full_state_dict=True))
        mesh = init_device_mesh(t._device().type, (t.world,))
        for block in decoder_blocks(t.model):
            fully_shard(block, mesh=mesh)
        fully_shard(t.model, mesh=mesh)
        t.optimizer = t._make_optimizer()
        t.sharded = True
        if dcp is not None:
            t._read_dcp(dcp, model=False, optimizer=True)
        elif optimizer_state:
            set_optimizer_state_dict(t.model, t.optimizer, full or {},
                                     options=StateDictOptions(full_state_dict=True,
                                                              broadcast_from_rank0=True))

    def whole_reference(self) -> dict | None:
        """The KL reference under HF names, to rebuild it whole when the gang is left
        (FSDP2: none needed, every rank held it whole)."""
        return None

    def publish_state(self, model) -> dict:
        """The policy's HF-named tensors, in the same order on every rank (FSDP2: its
        state dict of DTensors, each gathered whole by ``whole`` as it is written; a
        tied head left out, ``rollart.trainer.backend.without_tied_head``)."""
        return without_tied_head(model, model.state_dict())

    def whole(self, t) -> torch.Tensor:
        """One tensor of ``publish_state`` whole (a collective for a DTensor)."""
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t

    def full_optimizer(self, model, optimizer, rank: int) -> dict:
        """The whole AdamW state under parameter names (a collective: every rank calls
        it; rank 0 gets the dict, the others ``{}``)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    # -- one step (trainer thread) --------------------------------------------------------
    def dp_group(self):
        """The process group over which shares differ (FSDP2: every rank, ``None``)."""
        return None

    def loss_scale(self, world: int) -> float:
        """FSDP2 averages gradients over ranks: each rank's loss is scaled by N."""
        return float(world)

    def reduce_grads(self, model, dp: int) -> None:
        """After the backward: FSDP2 has reduced the gradients already."""

    def grad_norm(self, params: list, device) -> torch.Tensor:
        """The whole model's gradient norm (a sharded one reduced over the ranks)."""
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


class GangMember(Trainer):
    """What every rank of the gang does: a ``Trainer`` whose backend also shards the
    policy over the gang (``FsdpBackend``, or another: ``rollart.trainer.megatron_gang``)."""

    share_prompts = False  # a shared prompt is two forwards: the ranks' collectives must line up
    rank, world, sharded = 0, 1, False

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("backend", FsdpBackend())
        super().__init__(*args, **kwargs)

    @property
    def tp(self) -> int:
        """Ranks per tensor-parallel group (the backend's layout; FSDP2: 1)."""
        return self.backend.tp

    @property
    def dp(self) -> int:
        """The data-parallel size: how many shares a batch is split into (rank r trains
        share ``r // tp``)."""
        return self.world // self.tp

    def _leave(self) -> None:
        """Leave this process's gang, if any (its process group destroyed)."""
        self.backend.leave()

    # -- joining and sharding (trainer thread) -------------------------------------------
    def _join(self, host: str, port: int, rank: int, world: int, timeout: float,
              store=None) -> None:
        """Join the gang's process group at rank 0's rendezvous ``host:port`` (rank 0
        passes the ``store`` it opened: ``GangTrainer._open``)."""
        import torch.distributed as dist

        self._leave()  # a gang before this one, in this process
        wait = datetime.timedelta(seconds=timeout)
        if store is None:
            store = dist.TCPStore(host, port, world, is_master=False, timeout=wait)
        if self._device().type == "cuda":
            torch.cuda.set_device(self._device())
        backend = "nccl" if self._device().type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=wait)
        self.rank, self.world = rank, world

    def _device(self) -> torch.device:
        """Where the policy's weights are: NCCL and a CUDA mesh for a GPU, else gloo and
        a CPU mesh (the trainer actor's policy is on the CPU unless placed on a GPU)."""
        return next(self.model.parameters()).device

    def _shard(self, optimizer_state: bool, dcp: str | None = None) -> None:
        """Take rank 0's policy and shard it over the gang (the backend's ``shard``)."""
        self.backend.shard(self, optimizer_state, dcp)

    def _write_buckets(self, version: int, bucket_bytes: int) -> list[tuple[int, str, int]]:
        """This rank's buckets of ``version`` in the weight store (``_buckets_here``).
        Returns ``(k, name, bytes)`` of the buckets written here."""
        return [(k, *self.store.put_bucket(version, k, part, {
                    "rollart.rank": str(self.rank), "rollart.bucket": str(k)}))
                for k, _, part in self._buckets_here(bucket_bytes)]

    def _buckets_here(self, bucket_bytes: int):
        """Yield ``(k, how many buckets, tensors)`` for each bucket this rank writes: the
        policy's HF-named tensors cut in order into buckets of about ``bucket_bytes``
        (``buckets``, the same on every rank); bucket k is rank k mod N's. Each tensor
        is gathered whole (``full_tensor``, a collective) by every rank, kept only by
        its bucket's writer and dropped once written: no rank holds more than a bucket
        beyond its shard. Every rank must consume the whole generator."""
        state = self._publish_state()
        cut = buckets(state, bucket_bytes)
        for k, names in enumerate(cut):
            mine, part = k % self.world == self.rank, {}
            for name in names:
                whole = self.backend.whole(state[name])
                if mine:
                    part[name] = whole.detach().to("cpu")
            if mine:
                yield k, len(cut), part

    # -- sharded checkpoints (trainer thread; every rank, together) ----------------------
    def _save_shards(self, url: str, bucket_bytes: int, state: bool = True
                     ) -> tuple[dict, dict]:
        """This rank's part of a sharded checkpoint at ``url`` (a collective):

        * ``dcp/``: its shards of the policy and of the AdamW state, written by
          ``torch.distributed.checkpoint.save`` from ``get_state_dict`` (DTensors, not
          gathered: a rank writes its own ``__<rank>_<i>.distcp``; the coordinator,
          rank 0, the ``.metadata`` that maps every shard to its file);
        * ``model/``: its buckets of the HF-named weights as the model folder's shards
          ``model-<k+1>-of-<K>.safetensors`` (``_buckets_here``: bucket k by rank k mod
          N, no rank holding more than a bucket beyond its shard).

        Without ``state``, only the weight shards, into the model folder ``url`` itself
        (``GangTrainer.save``). Returns the manifest entries of the files this rank
        wrote or hashed (the ``dcp/`` files are hashed in parallel, file i by rank i mod
        N) and the model folder's ``weight_map`` part (HF name -> shard file)."""
        import fsspec
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save as st_save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from rollart.runtime.storage import write_bytes
        from rollart.weights.store import _untie

        files, weight_map, url = {}, {}, url.rstrip("/")
        if state:
            model, optim = get_state_dict(self.model, self.optimizer)
            path = f"{url}/{DCP_DIR}"
            meta = dcp.save({"model": model, "optimizer": optim},
                            storage_writer=dcp_storage(path, write=True))
            del model, optim
            names = sorted({i.relative_path for i in meta.storage_data.values()})
            files.update(hash_files(path, names[self.rank::self.world], DCP_DIR))
            if self.rank == 0:
                files.update(hash_files(path, [METADATA], DCP_DIR))
        folder, prefix = (f"{url}/model", "model/") if state else (url, "")
        fs, root = fsspec.core.url_to_fs(folder)
        fs.makedirs(root, exist_ok=True)
        for k, n, part in self._buckets_here(bucket_bytes):
            shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            entry = write_bytes(folder, shard, st_save(_untie(part),
                                                       metadata={"format": "pt"}))
            files.update({prefix + shard: entry[shard]})
            weight_map.update({name: shard for name in part})
        return files, weight_map

    def _publish_state(self) -> dict:
        """The policy's HF-named tensors, in the same order on every rank (the backend's:
        each gathered whole by its ``whole`` as it is written)."""
        return self.backend.publish_state(self.model)

    def _full_optimizer(self) -> dict:
        """The whole AdamW state under parameter names (a collective: every rank calls
        it; rank 0 gets the dict, the others ``{}``)."""
        return self.backend.full_optimizer(self.model, self.optimizer, self.rank)

    # -- one step (trainer thread) --------------------------------------------------------
    def _share_update(self, batch, adv: torch.Tensor, real: int) -> dict:
        """This rank's part of one optimizer step: ``batch``'s first ``real`` rows are its
        share (the rest one filler row, weight 0, for a rank with no share). Every rank
        of one tensor-parallel group has the same share; token counts, micro-batch counts
        and statistics are reduced over the data-parallel group (the backend's
        ``dp_group``), so each share counts once. Returns the step's statistics, summed
        over shares."""
        import torch.distributed as dist

        pad = self.tokenizer.pad_token_id
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in batch]
        parts = [p for p in micro_batches(lengths, self.algo.micro_batch_tokens) if p]
        collated = [collate([batch[i] for i in rows], pad) for rows in parts]
        counts = [float(_loss_mask(c).sum()) if real else 0.0 for c in collated]
        head = torch.tensor([sum(counts), len(parts)], dtype=torch.float64,
                            device=self._device())  # NCCL reduces on the GPU
        total, most, group = head.clone(), head.clone(), self.backend.dp_group()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        total_tokens = max(float(total[0]), 1.0)
        plan = list(zip(parts, collated, counts))
        plan += [(parts[0], collated[0], 0.0)] * (int(most[1]) - len(parts))  # weight 0
        scale = self.backend.loss_scale(self.world)
        loss_sum, stats = self._backward(plan, adv, total_tokens, scale=scale)
        self.backend.reduce_grads(self.model, self.dp)
        params = [p for p in self.model.parameters() if p.grad is not None]
        # the whole model's norm, from every rank's part
        norm = self.backend.grad_norm(params, self._device())
        torch.nn.utils.clip_grads_with_norm_(params, self.algo.max_grad_norm, norm)
        self.optimizer.step()
        self.model.eval()
        keys = sorted(stats)
        summed = torch.tensor([loss_sum, len([n for _, _, n in plan if n > 0])]
                              + [stats[k] for k in keys], dtype=torch.float64,
                              device=self._device())
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        out = {"trainer/loss": float(summed[0]), "trainer/grad_norm": float(norm),
               "trainer/tokens": int(total[0]), "trainer/micro_batches": int(summed[1]),
               "trainer/shared_prompt_rows": 0, "trainer/ranks": self.world,
               "trainer/tp": self.tp, "trainer/dp": self.dp,
               **{k: float(v) for k, v in zip(keys, summed[2:].tolist())}}
        return out



class GangRank(GangMember):
    """Rank ≥ 1 of the gang, started by ``GangTrainer`` on its own TRAIN worker."""

    async def join(self, host: str, port: int, rank: int, world: int, timeout: float) -> int:
        await self._run(self._join, host, port, rank, world, timeout)
        return rank

    async def shard(self, optimizer_state: bool, dcp: str | None = None) -> None:
        """Take rank 0's policy and shard it with the other ranks (``_shard``)."""
        await self._run(self._shard, optimizer_state, dcp)

    async def write_buckets(self, version: int, bucket_bytes: int) -> list:
        """This rank's part of publishing ``version`` (``_write_buckets``)."""
        return await self._run(self._write_buckets, version, bucket_bytes)

    async def save_shards(self, url: str, bucket_bytes: int, state: bool = True
                          ) -> tuple[dict, dict]:
        """This rank's part of a sharded checkpoint or model folder (``_save_shards``)."""
        return await self._run(self._save_shards, url, bucket_bytes, state)

    async def full_optimizer(self) -> bool:
        """This rank's part of gathering the optimizer state (for rank 0's checkpoint)."""
        await self._run(self._full_optimizer)
        return True

    async def step(self, table, adv: list[float], real: int) -> None:
        """This rank's part of a step (``_share_update``) on the rows of ``table``."""
        from rollart.buffer.schema import from_table

        batch = await self._run(from_table, table)
        await self._run(self._share_update, batch, torch.tensor(adv), real)
