"""The Megatron trainer gang: N ranks laid out as tensor x data parallel, ``tp × dp = N``.

``Pool("trainer", tag=TRAIN, workers=N)`` with ``Policy.trainer_backend = "megatron"``
(``rollart.control.stages`` builds ``MegatronGangTrainer`` with ``tp`` from
``Policy.trainer_parallel``). The gang itself is ``rollart.trainer.gang``'s: rank 0
(``MegatronGangTrainer``) speaks for it, starts ``MegatronGangRank`` on the other TRAIN
workers, joins them in one process group, splits each step's batch into token-balanced
shares (``balance``), publishes HF-named buckets (bucket k by rank k mod N, manifest
last), writes checkpoints (gathered, in the one-process layout: below) and forms again
after a lost rank.
What differs from FSDP2 is in ``_MegatronRanked``'s hooks:

* forming (``_shard``): every rank takes rank 0's HF weights, KL reference and (from a
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
  one-process trainer's; gradients are sum-reduced over the DP group (``_reduce_grads``;
  micro-batch counts are equal on every rank, so the TP collectives line up). The norm
  for the clip is TP-aware (``_grad_norm``): squares of TP-sharded parameters' gradients
  summed over the TP group, replicated ones (megatron's ``tensor_model_parallel`` unset:
  the norms) counted once;
* publishing (``_publish_state``): every rank gathers the HF-named weights over its TP
  group (``MegatronLM.hf_state_dict``), then writes its buckets;
* checkpoints: gathered, not sharded (``sharded_checkpoints = False``): rank 0 writes
  the published weights (``model/``), the KL reference (kept under HF names since the
  gang formed: ``_ref_hf``) and the AdamW moments gathered over TP under HF names
  (``named_moments``, ``optimizer_format: "names"``), which a one-process
  ``MegatronTrainer`` (2 -> 1) or a gang of another layout loads. The torch gang's
  ``torch.distributed.checkpoint`` shards do not fit here: each rank's parameters are
  its TP shard as plain tensors under megatron's names, not DTensors DCP could reshard
  to another TP size, so rank 0's memory still bounds the model a Megatron gang can
  checkpoint. A torch gang's sharded checkpoint is refused by the Megatron backend
  (``MegatronTrainer._read_dcp``: resume it with the torch backend).

megatron's ``parallel_state`` and torch's default process group are per process: a rank
leaves any earlier gang's (``_leave``) before building a policy, and rank 0 returns to a
one-process group (TP 1) when the gang fails or loads a checkpoint (``_unshard``).
"""

from __future__ import annotations

import logging

import torch

from rollart.trainer.fsdp import GangRank, _Ranked
from rollart.trainer.gang import GangTrainer
from rollart.trainer.megatron import MegatronTrainer

logger = logging.getLogger(__name__)

__all__ = ["MegatronGangRank", "MegatronGangTrainer"]


class _MegatronRanked(_Ranked):
    """What every rank of a Megatron gang does differently from FSDP2 (module docstring)."""

    _ref_hf: dict | None = None  # rank 0: the KL reference under HF names, once formed

    def _load_policy(self, model_path: str):
        self._leave()  # an earlier gang's group and parallel state in this process
        return super()._load_policy(model_path)

    def _leave(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        super()._leave()

    # -- forming ------------------------------------------------------------------------
    def _shard(self, optimizer_state: bool, dcp: str | None = None) -> None:
        """Rank 0's weights, reference and moments to every rank (broadcast under HF
        names, from the one-process policy each rank built), then megatron's parallel
        state for ``tp`` over the gang and each rank's TP shard of the policy. (``dcp``,
        a sharded checkpoint's moments, never comes: a Megatron trainer refuses such a
        checkpoint when it loads it, ``MegatronTrainer._read_dcp``.)"""
        from megatron.core import parallel_state

        from rollart.trainer.megatron import (MegatronLM, _cpu_workarounds,
                                              load_named_moments, named_moments)

        cfg = self.model.hf_config
        hf = self.model.hf_state_dict()  # the TP 1 policy built before the gang
        _broadcast(hf)
        ref = None
        if self.algo.kl_coef > 0:
            ref = (self.ref_model.hf_state_dict() if self.rank == 0
                   else {k: v.clone() for k, v in hf.items()})
            _broadcast(ref)
        named = None
        if optimizer_state:
            named = named_moments(self.model, self.optimizer) if self.rank == 0 else None
            named = _broadcast_named(named, hf)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        _cpu_workarounds()
        if torch.cuda.is_available():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        if parallel_state.get_data_parallel_rank() != self.rank // self.tp:
            raise RuntimeError(f"rank {self.rank}: megatron put it in data-parallel group "
                               f"{parallel_state.get_data_parallel_rank()}, not "
                               f"{self.rank // self.tp}; the shares would not line up")
        self.model = MegatronLM(cfg, hf)
        self.model.eval()
        if ref is not None:
            self.ref_model = MegatronLM(cfg, ref).eval()
            self._ref_hf = ref if self.rank == 0 else None
        self.optimizer = self._make_optimizer()
        if named is not None:
            load_named_moments(self.model, self.optimizer, named)
        self.sharded = True

    # -- a step -------------------------------------------------------------------------
    def _dp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _loss_scale(self) -> float:
        return 1.0  # gradients are summed over the DP group, not averaged

    def _reduce_grads(self) -> None:
        """Sum every gradient over the DP group (one flat buffer). A parameter without a
        gradient gets zeros, so every rank reduces the same buffer (a GPTModel uses all
        of its parameters in every forward)."""
        import torch.distributed as dist

        if self.dp == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._dp_group())
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def _grad_norm(self, params: list) -> torch.Tensor:
        """The whole model's gradient norm: each rank's squares of TP-sharded parameters'
        gradients and, on TP rank 0 only, of the replicated ones (the norms: every TP
        rank holds the same), summed over the TP group."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros((), dtype=torch.float64, device=self._device())
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM,
                            group=parallel_state.get_tensor_model_parallel_group())
        return squares.sqrt().to(params[0].grad.dtype if params else torch.float32)

    # -- publishing and checkpoints -----------------------------------------------------
    def _publish_state(self) -> dict:
        """The HF-named weights, gathered over this rank's TP group (a collective)."""
        return self.model.hf_state_dict()

    def _full_optimizer(self) -> dict:
        """The AdamW moments under HF names, gathered over TP (every rank calls it; rank 0
        gets the ``"names"`` dict, the others ``{}``)."""
        from rollart.trainer.megatron import named_moments

        named = named_moments(self.model, self.optimizer)
        return (named or {"state": {}, "param_groups": []}) if self.rank == 0 else {}

    def _hf_weights(self, module) -> dict:
        if self.sharded and module is self.ref_model and self._ref_hf is not None:
            return self._ref_hf  # the reference's TP shards need a collective: kept whole
        return super()._hf_weights(module)


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


class MegatronGangTrainer(_MegatronRanked, GangTrainer, MegatronTrainer):
    """Rank 0 of a Megatron gang of ``ranks`` ranks, ``tp`` per tensor-parallel group
    (module docstring)."""

    rank_class = None  # set below: MegatronGangRank
    #: its checkpoints stay gathered in the one-process layout (module docstring): its
    #: parameters are each rank's TP shard as a plain tensor, under megatron's names,
    #: not DTensors that torch.distributed.checkpoint could reshard to another TP size
    sharded_checkpoints = False

    def __init__(self, *args, tp: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp = int(tp)
        if self.tp < 1 or self.world % self.tp:
            raise ValueError(f"a Megatron gang of {self.world} ranks cannot have tensor "
                             f"parallel size {self.tp}: tp x dp must be {self.world} "
                             f"(Policy.trainer_parallel)")

    def _rank_kwargs(self) -> dict:
        return {"tp": self.tp}

    def _unshard(self) -> None:
        """Back to one process (TP 1) at the published weights; the KL reference rebuilt
        from its HF-named copy (its TP shards went with the gang's groups)."""
        super()._unshard()
        if self._ref_hf is not None:
            self.ref_model = self._frozen_copy().eval()
            self._load_hf(self.ref_model, self._ref_hf)


class MegatronGangRank(_MegatronRanked, GangRank, MegatronTrainer):
    """Rank ≥ 1 of a Megatron gang, started by ``MegatronGangTrainer``."""

    def __init__(self, *args, tp: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp = int(tp)


MegatronGangTrainer.rank_class = MegatronGangRank
