"""The trainer gang: one training rank per ``TRAIN`` worker, data-parallel FSDP2 (the
Megatron backend's tensor x data parallel gang reuses it: ``rollart.trainer.megatron_gang``).

``Pool("trainer", tag=TRAIN, workers=N)`` with N > 1 makes the trainer role a gang
(``rollart.control.stages`` builds ``GangTrainer`` on one TRAIN worker, with the number
of ranks). ``GangTrainer`` is rank 0 and speaks for the gang: the driver calls it as it
calls the one-process ``Trainer`` (``train_step``, ``publish``, ``save``, ...). It starts
one ``GangRank`` actor on each other TRAIN worker (pinned there) when it first publishes,
opens the rendezvous (a ``TCPStore`` on its own host, on a port the OS picks as it binds),
and every rank joins the process group (gloo for a policy on the CPU, NCCL on a GPU) within
``join_timeout`` s, or the error names the rank that did not and the setting to raise.
Every rank then takes rank 0's weights and KL reference (``Algo.kl_coef > 0``) by
broadcast and shards the policy with ``fully_shard`` per decoder block and at the root
over an explicit device mesh.

A step: rank 0 pulls the batch and computes the advantages over all of it, splits the
rows into N token-balanced shares (``balance``) and sends each rank its own; every rank
runs the same number of micro-batches (a rank with fewer repeats one with weight 0, so
the collectives line up), weighting each by its tokens over the whole batch's (a sum
reduced across ranks): the loss and gradient are the one-process trainer's, the token
mean over the whole batch. FSDP2 averages gradients over ranks, so each rank scales its
loss by N. The gradient norm is clipped over the whole model (the sharded norms reduced),
then AdamW steps on each rank's shard. The ranks' statistics are summed in one
all-reduce; rank 0 reports the step row, with ``trainer/ranks`` (and ``trainer/tp`` = 1,
``trainer/dp`` = N).

Publishing a version (``_write_buckets``): the policy's HF-named tensors, in order, are
cut into buckets of about ``bucket_bytes`` (``buckets``); every rank gathers each tensor
whole (``full_tensor``), and bucket k's tensors are kept and written to the weight store
by rank k mod N only (``WeightStore.put_bucket``), so no rank holds a second full copy.
Rank 0 then writes the manifest that makes them a version (``put_manifest``): a reader
never sees a partial one. Readers fetch the buckets in parallel (``WeightStore.get``).

Checkpoints are sharded (``torch.distributed.checkpoint``, DCP): every rank writes its own
shards of the policy and of the AdamW state into the checkpoint's ``dcp/`` folder
(``dcp.save`` of ``get_state_dict``: DTensors, nothing gathered; ``_save_shards``), and
its buckets of the HF-named weights as the shards of the checkpoint's ``model/`` folder
(bucket k by rank k mod N, as for publishing), so ``model/`` stays a Hugging Face model
folder (``rollart eval``, export, a resumed run's model path) without a whole copy on
rank 0; rank 0 adds the folder's index, config and tokenizer, the KL reference (frozen
and whole on every rank: written as before) and ``trainer.pt`` (``optimizer_format:
"dcp"``). The checkpoint URL must therefore be one place every TRAIN worker reaches (one
host, a shared file system, an object store). A run resumes on any number of ranks (2 ->
1 and 1 -> 2 tested): DCP reshards. A one-process trainer reads the shards whole with no
process group; a gang's rank 0 reads the weights whole into its unsharded policy (every
rank builds the policy whole before ``fully_shard`` anyway: that, and the broadcast of
rank 0's weights when a gang forms, stay as they were) and leaves the AdamW state, the
larger part, to the ranks: when the gang forms, each reads only its own shard of it
(``_shard`` with ``dcp``). A gang still loads the one-process layout (weights, reference
and moments broadcast from rank 0 as it forms) and the gathered ``"names"`` layout of
older gang checkpoints and of the Megatron gang, whose checkpoints stay gathered
(``rollart.trainer.megatron_gang``: its TP shards are plain tensors DCP cannot reshard).

Readers: an inference worker streams a bucketed version into its engine bucket by bucket
(``WeightStore.iter_buckets``; about two buckets in memory beyond the model), and on a
Mooncake store with ``relay_mb`` set the readers serve the buckets to each other
(``rollart.weights.relay``), so the trainer's side serves about one copy a version.

Not built yet, and said where a user meets it: LoRA in a gang (a ``GraphError`` at start:
``rollart.config.preflight.check_gang``); a KL reference sharded like the policy (every
rank holds it whole).

Faults: a rank that fails a step (its worker SIGKILLed, a collective broken or timed out
after ``join_timeout``) fails the gang as a whole: rank 0 returns to the newest published
weights, a new gang forms on the TRAIN workers alive (waiting for a restarted one) and
the step runs again on its batch (``GangTrainer._compute``; ``trainer/gang_restarts``
counts it, and the step's ``trainer/gang_events`` says which rank's worker was replaced
by which, for the run's ``recovery.json``). Rank 0's own worker lost is the trainer role
lost: the driver replaces it as it replaces a one-process trainer, with a gang of the
same size (``rollart.control.stages``), whose rank 0 forms a new gang. The worker of a
rank of the dead gang holds that gang's process group until a new trainer starts there
(``rollart.trainer.trainer.leave_dead_gang``). A gang short of TRAIN workers says so on
the driver's console within seconds and gives up after ``join_timeout`` s with
``GangWaitError`` (``rollart.trainer.gang_faults``, which also keeps the record of the
restarts).
"""

from __future__ import annotations

import asyncio
import datetime
import logging

import torch

from rollart.trainer.advantages import compute_advantages
from rollart.trainer.fsdp import GangMember, GangRank, balance, buckets, decoder_blocks
from rollart.trainer.gang_faults import GangWaitError, Restarts, wait_for_workers
from rollart.trainer.trainer import Trainer

logger = logging.getLogger(__name__)

__all__ = ["GangRank", "GangTrainer", "GangWaitError", "balance", "buckets",
           "decoder_blocks"]


class GangTrainer(GangMember):
    """Rank 0 of a gang of ``ranks`` ranks, one per TRAIN worker (module docstring)."""

    rank_class = GangRank  # the other ranks' actor (the Megatron gang: its own)

    def __init__(self, *args, ranks: int = 2, join_timeout: float = 300.0,
                 bucket_bytes: int = 256 << 20, **kwargs):
        super().__init__(*args, **kwargs)
        if self.lora is not None:
            raise ValueError("Policy.lora on a trainer gang is not supported yet: train "
                             "LoRA on one TRAIN worker (Pool(tag=TRAIN, workers=1))")
        self.world = int(ranks)
        self.gang: list[str] = []  # the other ranks' workers, chosen at each form
        self.join_timeout = float(join_timeout)
        self.members: list = []
        self.restarts = Restarts()  # the gang's restarts, reported with the steps
        self._forms = 0
        # the step being made, (batch, its metrics row), until it is published: a gang
        # that fails in publishing makes its update again (``_publish``)
        self._step: tuple | None = None
        self.short = False  # the last form found too few TRAIN workers
        self.bucket_bytes = int(bucket_bytes)
        self._gathered_optimizer: dict | None = None  # while a checkpoint is written
        self._weight_map: dict | None = None  # while a sharded one is: HF name -> file
        # a sharded checkpoint's dcp/ folder whose AdamW state the ranks read, each its
        # own shard, when the gang next forms (loaded by rank 0 while unsharded)
        self._dcp_moments: str | None = None

    async def _publish(self) -> None:
        """Every rank writes its buckets of ``self.version`` (``_write_buckets``), then
        rank 0 the manifest that makes them a version. A rank that fails it (its worker
        lost, a collective broken: gloo's "Connection closed by peer") fails the gang
        as one, as in a step: before the version was made, so the step's update is lost
        with the gang; within a step (``_compute`` left ``_step``) it is made again on
        a new gang from the published weights, on the same batch, and published (a
        second failure, and one outside a step, is the caller's). The lost rank was
        the run's error (issue 54: the Megatron gang's kill cell)."""
        if not self.sharded:
            return await super()._publish()
        try:
            await self._write_version()
        except Exception as e:  # noqa: BLE001 - any rank's failure fails the gang
            step, self._step = self._step, None
            self.version -= 1
            await self._failed(f"publishing v{self.version + 1}", e)
            if step is None:
                raise
            batch, out = step
            redo = await self._compute(batch)  # the same update, on a new gang
            self._step = None
            out["trainer/gang_events"] += redo["trainer/gang_events"]  # the step's row
            out["trainer/gang_restarts"] = self.restarts.count
            self.version += 1
            await self._write_version()
        self._step = None

    async def _write_version(self) -> None:
        """Every rank's buckets of ``self.version``, then the manifest (``_publish``)."""
        parts = await self._all([self._run(self._write_buckets, self.version,
                                           self.bucket_bytes),
                                 *(m.write_buckets(self.version, self.bucket_bytes)
                                   for m in self.members)],
                                "did not write its weight buckets")
        written = sorted(b for part in parts for b in part)
        await self._run(self.store.put_manifest, self.version, [n for _, n, _ in written])
        self.bytes_published = sum(size for _, _, size in written)

    def _save_hf(self, path: str) -> None:
        """The policy as a model folder. Sharded (``_save_sharded``, ``save``): only what
        rank 0 adds to the weight shards the ranks wrote: the index, config, tokenizer
        (``_save_index``). Otherwise (the Megatron gang's checkpoint and final model) the
        newest published version, read whole from the weight store, in an unsharded
        copy."""
        if not self.sharded:
            return super()._save_hf(path)
        if self._weight_map is not None:
            return self._save_index(path, self._weight_map)
        from rollart.model import load_model

        model = load_model(self.model_path)
        model.load_state_dict(self.store.get(self.version), strict=False)
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    async def save(self, path: str) -> str:
        """The policy as a Hugging Face model folder at ``path``; on a sharded gang each
        rank writes its buckets of the weights as the folder's shards, rank 0 the index,
        config and tokenizer (nothing gathered on rank 0)."""
        if not (self.sharded and self.backend.sharded_checkpoints):
            return await super().save(path)
        try:
            parts = await self._all([self._run(self._save_shards, path, self.bucket_bytes,
                                               False),
                                     *(m.save_shards(path, self.bucket_bytes, False)
                                       for m in self.members)],
                                    "did not write its model shards")
        except Exception as e:  # noqa: BLE001 - a rank lost: rank 0 writes it alone
            await self._failed(f"saving {path}", e)
            return await super().save(path)
        weight_map = {name: f for _, part in parts for name, f in part.items()}
        await self._run(_drop_stale_weights, path, set(weight_map.values()))
        await self._run(self._save_index, path, weight_map)
        return path

    def _save_index(self, path: str, weight_map: dict) -> None:
        """A model folder's files besides its weight shards: ``model.safetensors.index.json``
        (HF's map of names to shard files, which ``from_pretrained`` follows), the
        config (and generation config) and the tokenizer."""
        import json
        import os

        total = sum(v.numel() * v.element_size()  # a DTensor's numel is the whole tensor's
                    for v in self._publish_state().values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        self.model.config.save_pretrained(path)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    async def publish(self) -> int:
        version = await super().publish()
        if not self.sharded:
            await self._form()
        return version

    async def save_state(self, url: str) -> dict:
        """A checkpoint of the gang. Sharded (``backend.sharded_checkpoints``): every rank
        writes its shards of the policy and AdamW state (``dcp/``, torch.distributed.checkpoint)
        and its buckets of the HF-named weights (``model/``'s shards); rank 0 adds the
        model folder's index, config and tokenizer, the KL reference (frozen, held whole
        by every rank: written as the one-process trainer does) and ``trainer.pt``
        (``optimizer_format: "dcp"``, no optimizer state in it). Nothing is gathered on
        rank 0. Gathered (the Megatron gang): the one-process trainer's layout, with the
        whole AdamW state under parameter names gathered from every rank
        (``optimizer_format: "names"``). Either resumes on any number of ranks. A rank
        that fails it fails the gang (``_failed``, as in a step) and rank 0 writes the
        checkpoint alone, in the one-process layout: the published weights (the step
        was published) with the moments started again; the next step forms the gang
        (``save`` likewise)."""
        if not self.sharded and self._dcp_moments is not None:
            if not self.short:
                await self._form()  # the moments of the checkpoint loaded: the ranks' to read
            else:  # too few workers to form (the run stops): read here, whole
                await self._run(self._read_dcp, self._dcp_moments, model=False,
                                optimizer=True)
                self._dcp_moments = None
        if not self.sharded:
            return await super().save_state(url)
        if self.backend.sharded_checkpoints:
            return await self._save_sharded(url)
        try:
            state = (await self._all([self._run(self._full_optimizer),
                                      *(m.full_optimizer() for m in self.members)],
                                     "did not gather the optimizer state"))[0]
        except Exception as e:  # noqa: BLE001 - a rank lost: rank 0 writes it alone
            await self._failed(f"writing checkpoint {url}", e)
            return await Trainer.save_state(self, url)
        self._gathered_optimizer = state
        try:
            return await super().save_state(url)
        finally:
            self._gathered_optimizer = None

    async def _save_sharded(self, url: str) -> dict:
        """Every rank's shards (``_save_shards``, together), then rank 0's files
        (``Trainer._save_state``, whose ``model/`` is then only the index, config and
        tokenizer: ``_save_hf``); returns all their manifest entries."""
        try:
            parts = await self._all([self._run(self._save_shards, url, self.bucket_bytes),
                                     *(m.save_shards(url, self.bucket_bytes)
                                       for m in self.members)],
                                    "did not write its checkpoint shards")
        except Exception as e:  # noqa: BLE001 - a rank lost: rank 0 writes it alone
            await self._failed(f"writing checkpoint {url}", e)
            return await Trainer.save_state(self, url)
        files, self._weight_map = {}, {}
        for part, weight_map in parts:
            files.update(part)
            self._weight_map.update(weight_map)
        await self._run(_drop_stale_weights, f"{url.rstrip('/')}/model",
                        set(self._weight_map.values()))
        try:
            files.update(await super().save_state(url))
        finally:
            self._weight_map = None
        return files

    def _optimizer_state(self) -> tuple[dict | None, str]:
        if self.sharded:
            if self.backend.sharded_checkpoints:
                return None, "dcp"
            return self._gathered_optimizer, "names"
        return super()._optimizer_state()

    def _load_dcp_optimizer(self, path: str) -> None:
        """Rank 0 loads a sharded checkpoint unsharded (the weights whole, as every rank
        builds the policy whole before it shards it); its AdamW state is left for the
        ranks to read, each its own shard, when the gang forms (``_form``)."""
        self._dcp_moments = path

    async def load_state(self, url: str, truncate: bool = True) -> int:
        """As the one-process trainer's, into rank 0's unsharded policy; the gang forms
        again at the next step, with these weights and reference, and these moments:
        broadcast from rank 0 (a one-process layout checkpoint) or read by every rank,
        its own shard (a sharded one)."""
        self._dcp_moments = None
        if self.sharded:
            await self._run(self._unshard)
        return await super().load_state(url, truncate)

    async def restore_latest(self) -> int:
        if self.sharded:
            await self._run(self._unshard)
        return await super().restore_latest()

    async def _form(self) -> None:
        """Start the other ranks, rendezvous, and shard the published version on all."""
        from distributed import get_client, get_worker

        from rollart.runtime.handles import handle
        from rollart.types import TRAIN

        client = get_client()
        try:
            self.gang = await wait_for_workers(client, get_worker().address, self.world,
                                               self.join_timeout)
        except GangWaitError:
            self.short = True
            raise
        self.short = False
        self._forms += 1
        futs = [client.submit(self.rank_class, self.model_path, self.store.url, self.algo,
                              temperature=self.temperature, threads=1, actor=True,
                              **self._rank_kwargs(),
                              workers=[addr], allow_other_workers=False,
                              resources={TRAIN: 1},
                              key=f"GangRank-{i}-{id(self)}-{self._forms}-{addr}")
                for i, addr in enumerate(self.gang, start=1)]
        self._futures = futs  # keeps the members alive as long as rank 0
        self.members = []
        for i, (fut, addr) in enumerate(zip(futs, self.gang), start=1):
            try:
                self.members.append(handle(await asyncio.wait_for(fut, self.join_timeout)))
            except (asyncio.TimeoutError, TimeoutError) as e:
                raise TimeoutError(self._late(i, addr, "did not start")) from e
        host = get_worker().address.split("://")[-1].rsplit(":", 1)[0]
        store = await self._run(self._open, host)
        joins = [m.join(host, store.port, i, self.world, self.join_timeout)
                 for i, m in enumerate(self.members, start=1)]
        await self._all([self._run(self._join, host, store.port, 0, self.world,
                                   self.join_timeout, store), *joins],
                        "did not join the gang")
        moments = bool(self.optimizer.state)  # a checkpoint's, loaded before the gang
        dcp = self._dcp_moments  # or a sharded checkpoint's: every rank reads its shard
        await self._all([self._run(self._shard, moments, dcp),
                         *(m.shard(moments, dcp) for m in self.members)],
                        "did not shard the policy")
        self._dcp_moments = None
        logger.info("trainer gang of %d ranks formed (rendezvous %s:%d)", self.world, host,
                    store.port)
        self.restarts.formed(get_worker().address, self.gang, self.world, self.version)

    async def stats(self) -> dict:
        """The one-process trainer's, and ``ranks``: the workers of rank 0, 1, ... of the
        gang formed last (rank 0's alone before it forms)."""
        from distributed import get_worker

        out = await super().stats()
        out["ranks"] = [get_worker().address, *self.gang]
        return out

    def _rank_kwargs(self) -> dict:
        """What the other ranks' constructor takes besides the trainer's arguments."""
        return {}

    def _open(self, host: str):
        """The rendezvous: a ``TCPStore`` on a port of ``host`` the OS picks as it binds
        (never a fixed one, and no window in which another process takes it)."""
        import torch.distributed as dist

        return dist.TCPStore(host, 0, self.world, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=self.join_timeout))

    def _late(self, rank: int, addr: str, what: str) -> str:
        return (f"trainer rank {rank} on {addr} {what} within {self.join_timeout:.0f} s; "
                f"raise Dask's config rollart.waits.start (the gang's join time-out) or "
                f"check that worker")

    async def _all(self, calls: list, what: str) -> list:
        """Await every rank's call (rank 0 first); a failure or time-out names the rank."""
        tasks = [asyncio.ensure_future(c) for c in calls]
        for t in tasks:  # a rank failing after another: its error was reported already
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        done, pending = await asyncio.wait(tasks, timeout=self.join_timeout + 30,
                                           return_when=asyncio.FIRST_EXCEPTION)
        for p in pending:
            p.cancel()
        failed = [(r, t.exception()) for r, t in enumerate(tasks)
                  if t in done and t.exception() is not None]
        if failed:
            rank, e = failed[0]
            if isinstance(e, OSError):  # a lost worker: the caller's rule for it holds
                raise e
            raise RuntimeError(f"trainer rank {rank} on {self._where(rank)} {what}: "
                               f"{e!r}") from e
        if pending:
            rank = next(r for r, t in enumerate(tasks) if t in pending)
            raise TimeoutError(self._late(rank, self._where(rank), what))
        return [t.result() for t in tasks]

    def _where(self, rank: int) -> str:
        return self.gang[rank - 1] if rank else "rank 0's worker"

    async def _compute(self, batch) -> dict:
        """One step over the gang (``_gang_step``). A rank that fails it (its worker
        lost, a collective broken or timed out) fails the gang as a whole (torchelastic's
        rule): rank 0 goes back to the newest published weights (the step's update was
        not published; the optimizer's moments start again, as for a trainer replaced
        without a checkpoint), a new gang forms on the TRAIN workers alive, and the step
        runs again on the same batch, once."""
        self._step = None
        for attempt in (0, 1):
            if not self.sharded:  # also a gang rebuilt after a loss restored, unpublished
                await self._form()  # GangWaitError: too few workers, the run's to handle
            try:
                out = await self._gang_step(batch)
            except Exception as e:  # noqa: BLE001 - any rank's failure fails the gang
                if attempt:
                    raise
                await self._failed("a step", e)
                continue
            out["trainer/gang_events"] = self.restarts.take()
            self._step = (batch, out)
            return out

    async def _failed(self, what: str, error: BaseException) -> None:
        """The gang failed as a whole in ``what``: back to the published ``self.version``,
        unsharded; the next step forms a new gang."""
        from distributed import get_worker

        logger.warning("the trainer gang failed in %s (%r); forming it again from the "
                       "published v%d", what, error, self.version)
        self.restarts.failed([get_worker().address, *self.gang], f"{what}: {error!r}")
        await self._run(self._unshard)

    def _unshard(self) -> None:
        """The policy unsharded again, at ``self.version``'s published weights."""
        state = self.store.get(self.version)
        try:
            self._leave()  # before the policy is built again (Megatron's needs a group)
        except Exception as e:  # noqa: BLE001 - a broken group: _join starts anew
            logger.warning("leaving the failed gang's process group: %r", e)
        self.model = self._load_policy(self.model_path)
        self._load_hf(self.model, state)
        self.model.eval()
        self.optimizer = self._make_optimizer()  # the moments were sharded: they start again
        self.sharded = False
        ref = self.backend.whole_reference()  # Megatron's: its TP shards left with the gang
        if ref is not None:
            self.ref_model = self._frozen_copy().eval()
            self._load_hf(self.ref_model, ref)

    async def _gang_step(self, batch) -> dict:
        """The advantages over the whole batch, each rank its token-balanced share
        (``balance``), the statistics summed over ranks."""
        from rollart.buffer.schema import to_record_batch
        import pyarrow as pa
        adv = compute_advantages([t.reward for t in batch], [t.group_id for t in batch],
                                 scale=self.algo.scale_rewards)
        shares = balance([len(t.prompt_ids) + len(t.response_ids) for t in batch], self.dp)
        # a rank with no share steps on a filler row with weight 0, in step with the rest;
        # the ranks of one tensor-parallel group (r // tp) get the same share
        sent = [([batch[i] for i in rows or [0]], adv[rows].tolist() if rows else [0.0],
                 len(rows)) for rows in shares]
        sent = [sent[r // self.tp] for r in range(self.world)]
        (rows, a, real), rest = sent[0], sent[1:]
        calls = [self._run(self._share_update, rows, torch.tensor(a), real)]
        calls += [m.step(pa.Table.from_batches([to_record_batch(rows)]), a, real)
                  for m, (rows, a, real) in zip(self.members, rest)]
        out = (await self._all(calls, "failed in the step"))[0]
        out["trainer/adv_abs_mean"] = float(adv.abs().mean())
        out["trainer/gang_restarts"] = self.restarts.count
        return out


def _drop_stale_weights(folder: str, keep: set[str]) -> None:
    """Remove weight files of an earlier save from the model folder ``folder`` (a URL)
    that are not among ``keep`` (this save's shards): ``from_pretrained`` would prefer a
    stale ``model.safetensors`` to the index."""
    import re

    import fsspec

    fs, root = fsspec.core.url_to_fs(folder)
    if not fs.exists(root):
        return
    for p in fs.ls(root, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name not in keep and re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", name):
            fs.rm(p)
