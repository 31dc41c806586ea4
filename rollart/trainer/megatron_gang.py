"""The Megatron trainer gang: N ranks laid out as tensor x data parallel, ``tp × dp = N``.

``Pool("trainer", tag=TRAIN, workers=N)`` with ``Policy.trainer_backend = "megatron"``
(``rollart.control.stages`` builds ``MegatronGangTrainer`` with ``tp`` from
``Policy.trainer_parallel``). The gang itself is ``rollart.trainer.gang``'s: rank 0
(``MegatronGangTrainer``) speaks for it, starts ``MegatronGangRank`` on the other TRAIN
workers, joins them in one process group, splits each step's batch into token-balanced
shares (``balance``), publishes HF-named buckets (bucket k by rank k mod N, manifest
last), writes checkpoints (gathered, in the one-process layout: below) and forms again
after a lost rank.
What differs from FSDP2 is the backend both hold, ``MegatronGangBackend`` (a part in
place of ``rollart.trainer.fsdp.FsdpBackend``):

* forming (``shard``): every rank takes rank 0's HF weights, KL reference and (from a
  checkpoint) AdamW moments by broadcast, then initialises megatron's ``parallel_state``
  for ``tp`` over the gang's group (the same call on every rank, so every rank creates
  every subgroup in the same order: TP groups are consecutive ranks, ``[0, 1], [2, 3]``
  for tp 2 and N 4; DP groups strided) and builds its ``MegatronLM`` (its TP shard of
  every column- and row-parallel weight; norms replicated) and a plain torch AdamW on
  its own parameters;
* a step: the batch is cut into ``dp`` shares; rank r trains share ``r // tp`` (the
  ranks of a TP group see the same rows and compute one forward together). Each
  micro-batch's token-mean loss is weighted by its tokens over the whole batch's (token
  counts summed over the DP group), so the sum of the shares' gradients is the
  one-process trainer's; gradients are sum-reduced over the DP group (``reduce_grads``;
  micro-batch counts are equal on every rank, so the TP collectives line up). The norm
  for the clip is TP-aware (``grad_norm``): squares of TP-sharded parameters' gradients
  summed over the TP group, replicated ones (megatron's ``tensor_model_parallel`` unset:
  the norms) counted once;
* publishing (``publish_state``): every rank gathers the HF-named weights over its TP
  group (``MegatronLM.hf_state_dict``), then writes its buckets;
* checkpoints: gathered, not sharded (``sharded_checkpoints = False``): rank 0 writes
  the published weights (``model/``), the KL reference (kept under HF names since the
  gang formed: ``ref_hf``) and the AdamW moments gathered over TP under HF names
  (``named_moments``, ``optimizer_format: "names"``), which a one-process
  ``MegatronTrainer`` (2 -> 1) or a gang of another layout loads. The torch gang's
  ``torch.distributed.checkpoint`` shards do not fit here: each rank's parameters are
  its TP shard as plain tensors under megatron's names, not DTensors DCP could reshard
  to another TP size, so rank 0's memory still bounds the model a Megatron gang can
  checkpoint. A torch gang's sharded checkpoint is refused by the Megatron backend
  (``MegatronBackend.read_dcp``: resume it with the torch backend).

megatron's ``parallel_state`` and torch's default process group are per process: a rank
leaves any earlier gang's (``leave``) before building a policy, and rank 0 returns to a
one-process group (TP 1) when the gang fails or loads a checkpoint (``_unshard``).
"""

from __future__ import annotations

import logging

import torch

from rollart.trainer.fsdp import GangRank, leave_gang
from rollart.trainer.gang import GangTrainer
from rollart.trainer.megatron import MegatronBackend

logger = logging.getLogger(__name__)

__all__ = ["MegatronGangBackend", "MegatronGangRank", "MegatronGangTrainer"]


class MegatronGangBackend(MegatronBackend):
    """How every rank of a Megatron gang holds the policy, differently from FSDP2 (module
    docstring): the part ``MegatronGangTrainer`` and ``MegatronGangRank`` hold."""

    #: its checkpoints stay gathered in the one-process layout (module docstring): its
    #: parameters are each rank's TP shard as a plain tensor, under megatron's names,
    #: not DTensors that torch.distributed.checkpoint could reshard to another TP size
    sharded_checkpoints = False

    def __init__(self, tp: int = 1):
        self.tp = int(tp)  # ranks per tensor-parallel group
        self.ref_hf: dict | None = None  # rank 0: the KL reference under HF names, once formed
        self._ref_shards = None  # the KL reference's TP shards, while the gang holds them

    def load_policy(self, model_path: str, device):
        self.leave()  # an earlier gang's group and parallel state in this process
        return super().load_policy(model_path, device)

    def leave(self) -> None:
        """Leave megatron's parallel state and this process's gang, if any."""
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        leave_gang()

    # -- forming ------------------------------------------------------------------------
    def shard(self, t, optimizer_state: bool, dcp: str | None = None) -> None:
        """Rank 0's weights, reference and moments to every rank of ``t``'s gang
        (broadcast under HF names, from the one-process policy each rank built), then
        megatron's parallel state for ``tp`` over the gang and each rank's TP shard of the
        policy. (``dcp``, a sharded checkpoint's moments, never comes: a Megatron trainer
        refuses such a checkpoint when it loads it, ``MegatronBackend.read_dcp``.)"""
        from megatron.core import parallel_state

        from rollart.trainer.megatron import (MegatronLM, _cpu_workarounds,
                                              load_named_moments, named_moments)

        cfg = t.model.hf_config
        hf = t.model.hf_state_dict()  # the TP 1 policy built before the gang
        _broadcast(hf)
        ref = None
        if t.algo.kl_coef > 0:
            ref = (t.ref_model.hf_state_dict() if t.rank == 0
                   else {k: v.clone() for k, v in hf.items()})
            _broadcast(ref)
        named = None
        if optimizer_state:
            named = named_moments(t.model, t.optimizer) if t.rank == 0 else None
            named = _broadcast_named(named, hf)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        _cpu_workarounds()
        if torch.cuda.is_available():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        if parallel_state.get_data_parallel_rank() != t.rank // self.tp:
            raise RuntimeError(f"rank {t.rank}: megatron put it in data-parallel group "
                               f"{parallel_state.get_data_parallel_rank()}, not "
                               f"{t.rank // self.tp}; the shares would not line up")
        t.model = MegatronLM(cfg, hf)
        t.model.eval()
        if ref is not None:
            t.ref_model = self._ref_shards = MegatronLM(cfg, ref).eval()
            self.ref_hf = ref if t.rank == 0 else None
        t.optimizer = t._make_optimizer()
        if named is not None:
            load_named_moments(t.model, t.optimizer, named)
        t.sharded = True

    def whole_reference(self) -> dict | None:
        """The KL reference under HF names (rank 0, once formed): its TP shards go with
        the gang's groups, so rank 0 rebuilds it whole from this when it leaves one."""
        self._ref_shards = None
        return self.ref_hf

    # -- a step -------------------------------------------------------------------------
    def dp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def loss_scale(self, world: int) -> float:
        return 1.0  # gradients are summed over the DP group, not averaged

    def reduce_grads(self, model, dp: int) -> None:
        """Sum every gradient over the DP group (one flat buffer). A parameter without a
        gradient gets zeros, so every rank reduces the same buffer (a GPTModel uses all
        of its parameters in every forward)."""
        import torch.distributed as dist

        if dp == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group())
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def grad_norm(self, params: list, device) -> torch.Tensor:
        """The whole model's gradient norm: each rank's squares of TP-sharded parameters'
        gradients and, on TP rank 0 only, of the replicated ones (the norms: every TP
        rank holds the same), summed over the TP group."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros((), dtype=torch.float64, device=device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM,
                            group=parallel_state.get_tensor_model_parallel_group())
        return squares.sqrt().to(params[0].grad.dtype if params else torch.float32)

    # -- publishing and checkpoints -----------------------------------------------------
    def publish_state(self, model) -> dict:
        """The HF-named weights, gathered over this rank's TP group (a collective)."""
        return model.hf_state_dict()

    def whole(self, t) -> torch.Tensor:
        """One tensor of ``publish_state``: whole already (gathered over TP)."""
        return t

    def full_optimizer(self, model, optimizer, rank: int) -> dict:
        """The AdamW moments under HF names, gathered over TP (every rank calls it; rank 0
        gets the ``"names"`` dict, the others ``{}``)."""
        from rollart.trainer.megatron import named_moments

        named = named_moments(model, optimizer)
        return (named or {"state": {}, "param_groups": []}) if rank == 0 else {}

    def hf_weights(self, module) -> dict:
        if module is self._ref_shards and self.ref_hf is not None:
            return self.ref_hf  # the reference's TP shards need a collective: kept whole
        return super().hf_weights(module)


def _broadcast(state: dict) -> None:
    """Every tensor of ``state`` from rank 0, in sorted name order (in place)."""
    import torch.distributed as dist

    for name in sorted(state):
        dist.broadcast(state[name].data, 0)


def _broadcast_named(named: dict | None, like: dict) -> dict:
    """Rank 0's ``"names"`` optimizer state on every rank: its layout as an object, the
    moments tensor by tensor (shaped as the weights of ``like``)."""
    import torch.distributed as dist

    head = [None]
    if named is not None:
        head = [{"param_groups": named["param_groups"], "names": list(named["state"]),
                 "step": next(iter(named["state"].values()))["step"]}]
    dist.broadcast_object_list(head, 0)
    if named is None:
        named = {"param_groups": head[0]["param_groups"],
                 "state": {n: {"step": head[0]["step"].clone(),
                               **{k: torch.zeros_like(like[n]) for k in ("exp_avg",
                                                                          "exp_avg_sq")}}
                           for n in head[0]["names"]}}
    for n in head[0]["names"]:
        for k in ("exp_avg", "exp_avg_sq"):
            dist.broadcast(named["state"][n][k], 0)
    return named


class MegatronGangTrainer(GangTrainer):
    """Rank 0 of a Megatron gang of ``ranks`` ranks, ``tp`` per tensor-parallel group: a
    ``GangTrainer`` holding a ``MegatronGangBackend`` (module docstring)."""

    rank_class = None  # set below: MegatronGangRank

    def __init__(self, *args, tp: int = 1, **kwargs):
        super().__init__(*args, backend=MegatronGangBackend(tp), **kwargs)
        if self.tp < 1 or self.world % self.tp:
            raise ValueError(f"a Megatron gang of {self.world} ranks cannot have tensor "
                             f"parallel size {self.tp}: tp x dp must be {self.world} "
                             f"(Policy.trainer_parallel)")

    def _rank_kwargs(self) -> dict:
        return {"tp": self.tp}


class MegatronGangRank(GangRank):
    """Rank ≥ 1 of a Megatron gang, started by ``MegatronGangTrainer``: a ``GangRank``
    holding a ``MegatronGangBackend``."""

    def __init__(self, *args, tp: int = 1, **kwargs):
        super().__init__(*args, backend=MegatronGangBackend(tp), **kwargs)


MegatronGangTrainer.rank_class = MegatronGangRank
