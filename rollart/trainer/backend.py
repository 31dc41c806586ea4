"""``TorchBackend``: how a one-process ``Trainer`` holds its policy, a part it holds.

A trainer (``rollart.trainer.trainer.Trainer``) holds one backend, ``trainer.backend``,
and asks it whatever depends on the policy's layout: build the policy from a Hugging Face
model folder, read and load its weights under Hugging Face names (the weight store's and
the checkpoint's), copy it for the KL reference, write it as a model folder, load AdamW
moments saved under parameter names or as a sharded checkpoint. ``TorchBackend`` is the
Hugging Face model's; ``rollart.trainer.megatron.MegatronBackend`` a megatron
``GPTModel``'s. A trainer gang's backend adds how the policy is sharded over the gang's
ranks (``rollart.trainer.fsdp.FsdpBackend``, ``rollart.trainer.megatron_gang``).
The backend keeps no trainer state: each call takes the modules it works on.
"""

from __future__ import annotations

import copy

import torch

from rollart.model import HEAD, load_model, ties_head

__all__ = ["TorchBackend", "without_tied_head"]


def without_tied_head(model, state: dict) -> dict:
    """``state`` without ``lm_head.weight`` when ``model``'s head is its input embedding
    (``tie_word_embeddings``): a published version would otherwise carry the embedding
    twice (18% of SmolLM2-135M's bytes). Every reader ties its own head: the engines drop
    a tied head they are sent (``check_state_dict``), and a trainer or a model folder
    built from the same config shares the one tensor."""
    return {k: v for k, v in state.items() if k != HEAD} if ties_head(model) else state


class TorchBackend:
    """The Hugging Face model as the policy (``transformers``' model class)."""

    #: ranks per tensor-parallel group (a gang's layout; one process: 1)
    tp = 1

    def load_policy(self, model_path: str, device) -> torch.nn.Module:
        """The model being trained, on ``device`` (its worker's:
        ``rollart.runtime.devices.worker_device``)."""
        return load_model(model_path, device=device)

    def hf_state_dict(self, model) -> dict:
        """``model``'s weights under Hugging Face names, as the weight store holds them (in
        host memory: the store writes bytes; a tied head left out: ``without_tied_head``)."""
        return {k: v.detach().cpu()
                for k, v in without_tied_head(model, model.state_dict()).items()}

    def frozen_copy(self, model):
        """A copy of ``model``, the KL reference."""
        return copy.deepcopy(model)

    def save_pretrained(self, model, path: str, model_path: str) -> None:
        """``model``'s weights and config as a model folder at ``path`` (``model_path``:
        the folder it was built from)."""
        model.save_pretrained(path)

    def hf_weights(self, module) -> dict:
        """``module``'s state under Hugging Face names, as a checkpoint holds it."""
        return module.state_dict()

    def load_hf(self, module, state: dict) -> None:
        """Load Hugging Face-named ``state`` into ``module``."""
        module.load_state_dict(state, strict=False)

    def load_named_optimizer(self, model, optimizer, state: dict) -> None:
        """Load an optimizer state in the ``"names"`` layout (keyed by Hugging Face
        parameter names; a gang's checkpoint) into ``optimizer``."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state)

    def read_dcp(self, model, optimizer, path: str, *, weights: bool, moments: bool,
                 sharded: bool = False) -> None:
        """Load ``model``'s weights and/or ``optimizer``'s AdamW state from the sharded
        checkpoint folder ``path`` (``rollart.trainer.fsdp.GangMember._save_shards``) with
        ``torch.distributed.checkpoint.load``, which reshards: a ``sharded`` rank of a
        gang reads only its own shards (a collective over the gang), an unsharded policy
        (the one-process trainer, or rank 0 before a gang forms) reads whole tensors
        alone, with no process group (``no_dist``)."""
        import warnings

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
            set_optimizer_state_dict)

        from rollart.trainer.shards import check_dcp, dcp_storage

        check_dcp(path)
        want = {}
        if weights:
            want["model"] = get_model_state_dict(model)
        if moments:  # an AdamW without moments yet: a zero step (lr 0) makes its slots
            want["optimizer"] = get_optimizer_state_dict(model, optimizer)
        alone = not (sharded and dist.is_initialized())
        with warnings.catch_warnings():  # alone is meant: no process group to use
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(want, storage_reader=dcp_storage(path, write=False), no_dist=alone)
        if weights:
            set_model_state_dict(model, want["model"])
        if moments:
            set_optimizer_state_dict(model, optimizer, want["optimizer"])
