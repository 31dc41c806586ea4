"""``TrainerState``: what a ``Trainer`` writes and reads, in its compute thread.

``Trainer.save`` (a Hugging Face model folder, or a peft adapter folder with LoRA),
``Trainer.save_state`` / ``load_state`` (its part of a checkpoint,
``rollart.control.checkpoint``: ``model/``, ``base.safetensors``,
``ref_model.safetensors``, ``trainer.pt`` and, from a trainer gang, the sharded ``dcp/``
folder) call these. The backend hooks (``_save_hf``, ``_hf_weights``, ``_load_hf``,
``_optimizer_state``, ``_load_dcp_optimizer``, ``_load_named_optimizer``, ``_read_dcp``)
ask the trainer's backend (``rollart.trainer.backend``) what depends on the policy's
layout; the gang overrides the optimizer's: Hugging Face names on disk whatever the
training backend. The base class of ``Trainer``: it uses the trainer's model, optimizer,
store and version.
"""

from __future__ import annotations

import torch

from rollart.trainer.shards import DCP_DIR
from rollart.weights import lora


class TrainerState:
    """The checkpoint half of ``rollart.trainer.trainer.Trainer`` (module docstring)."""

    # Hugging Face names on disk whatever the training backend (``self.backend``):
    def _save_hf(self, path: str) -> None:
        if self.peft is None:
            self.backend.save_pretrained(self.model, path, self.model_path)
        else:
            self._save_adapter(path)
        self.tokenizer.save_pretrained(path)

    def _save_adapter(self, path: str) -> None:
        base = self.store.get(self.base_version) if self.base_version >= 0 else None
        lora.save_folder(self.peft, path, self.model_path, base, self.tokenizer)

    def _hf_weights(self, module) -> dict:
        return self.backend.hf_weights(module)

    def _load_hf(self, module, state: dict) -> None:
        self.backend.load_hf(module, state)

    def _save_state(self, url: str) -> dict:
        import io
        import tempfile

        from safetensors.torch import save as st_save

        from rollart.runtime.storage import upload_dir, write_bytes
        from rollart.weights.store import _untie

        with tempfile.TemporaryDirectory(prefix="rollart-ckpt-") as tmp:
            if self.peft is not None:  # the adapter; its base travels as base.safetensors
                self.peft.save_pretrained(tmp)
            else:
                self._save_hf(tmp)
            files = upload_dir(tmp, url, "model")
        if self.peft is not None and self.base_version >= 0:
            files.update(write_bytes(url, "base.safetensors",
                                     st_save(_untie(self.store.get(self.base_version)))))
        if self.ref_model is not None:
            ref = {k: v.detach().cpu().contiguous()
                   for k, v in self._hf_weights(self.ref_model).items()}
            files.update(write_bytes(url, "ref_model.safetensors", st_save(_untie(ref))))
        sched = getattr(self, "scheduler", None)
        buf = io.BytesIO()
        optimizer, layout = self._optimizer_state()
        torch.save({"optimizer": optimizer, "optimizer_format": layout,
                    "scheduler": sched.state_dict() if sched is not None else None,
                    "version": self.version, "torch_rng": torch.get_rng_state(),
                    "busy_seconds": self.busy_seconds,
                    "waited_seconds": self.waited_seconds,
                    "lora": self.lora, "lora_base_version": self.base_version}, buf)
        files.update(write_bytes(url, "trainer.pt", buf.getvalue()))
        return files

    def _optimizer_state(self) -> tuple[dict | None, str]:
        """The optimizer's state for ``trainer.pt`` and its layout: ``"ids"`` (torch's
        ``state_dict``, by parameter position), ``"names"`` (by parameter name: a Megatron
        trainer gang's, gathered from its ranks) or ``"dcp"`` (``None`` here: a torch
        trainer gang's, each rank's shard in the checkpoint's ``dcp/`` folder,
        ``rollart.trainer.fsdp.GangMember._save_shards``). Any trainer loads each (the
        Megatron backend: not ``"dcp"``)."""
        return self.optimizer.state_dict(), "ids"

    def _load_dcp_optimizer(self, path: str) -> None:
        """Load the AdamW state of a sharded checkpoint (layout ``"dcp"``, a torch trainer
        gang's: ``rollart.trainer.fsdp``) from its folder ``path`` into
        ``self.optimizer``: here, whole, at once (a gang's rank 0 leaves it to the
        ranks, each its own shard, when the gang forms: ``rollart.trainer.gang``)."""
        self._read_dcp(path, model=False, optimizer=True)

    def _load_named_optimizer(self, state: dict) -> None:
        """Load an optimizer state in the ``"names"`` layout (keyed by Hugging Face
        parameter names; a gang's checkpoint) into ``self.optimizer`` (a backend whose
        parameters have other names converts them: ``rollart.trainer.megatron``)."""
        self.backend.load_named_optimizer(self.model, self.optimizer, state)

    def _load_state(self, url: str, truncate: bool = True) -> int:
        import io

        import fsspec
        from safetensors.torch import load as st_load

        fs, root = fsspec.core.url_to_fs(str(url))
        root = root.rstrip("/")
        with fs.open(f"{root}/trainer.pt", "rb") as f:
            state = torch.load(io.BytesIO(f.read()), weights_only=False)
        adapter = fs.exists(f"{root}/model/adapter_model.safetensors")
        if adapter != (self.lora is not None):
            raise ValueError(
                f"the checkpoint {url} was trained {'with' if adapter else 'without'} LoRA "
                f"and this run {'has' if self.lora else 'has no'} Policy.lora: resume it "
                f"with the graph it was trained with ("
                + ("--set policy.lora.rank=..." if adapter else "--set policy.lora=none")
                + "), or start a new run")
        layout = state.get("optimizer_format", "ids")
        sharded = f"{str(url).rstrip('/')}/{DCP_DIR}"  # layout "dcp": a trainer gang's
        if adapter:
            self._load_adapter_state(fs, root, state)
        elif layout == "dcp":  # the weights as trained, from every rank's shards
            self._read_dcp(sharded, model=True, optimizer=False)
        else:
            with fs.open(f"{root}/model/model.safetensors", "rb") as f:
                self._load_hf(self.model, st_load(f.read()))
        if fs.exists(f"{root}/ref_model.safetensors"):
            with fs.open(f"{root}/ref_model.safetensors", "rb") as f:
                ref = st_load(f.read())
            self.ref_model = self._frozen_copy().eval()
            self._load_hf(self.ref_model, ref)
        self.optimizer = self._make_optimizer()
        if layout == "dcp":
            self._load_dcp_optimizer(sharded)
        elif layout == "names":  # a gang's, gathered (Megatron; a torch gang's before DCP)
            self._load_named_optimizer(state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler") is not None and getattr(self, "scheduler", None):
            self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if truncate:  # versions a lost run published after this
            self.store.truncate(self.version)
        torch.set_rng_state(state["torch_rng"])
        self.busy_seconds = state.get("busy_seconds", 0.0)
        self.waited_seconds = state.get("waited_seconds", 0.0)
        return self.version

    def _read_dcp(self, path: str, *, model: bool, optimizer: bool) -> None:
        """Load the policy's weights and/or AdamW state from the sharded checkpoint folder
        ``path`` (``_save_shards``): ``TorchBackend.read_dcp`` (a sharded rank of a gang
        reads only its own shards, an unsharded policy whole tensors alone)."""
        self.backend.read_dcp(self.model, self.optimizer, path, weights=model,
                              moments=optimizer, sharded=getattr(self, "sharded", False))

    def _load_adapter_state(self, fs, root: str, state: dict) -> None:
        """LoRA ``load_state``: the checkpoint's base (when not the model folder's), a
        fresh adapter on it, then the checkpoint's adapter."""
        from safetensors.torch import load as st_load

        if self.peft is not None:
            raise RuntimeError("load_state on a trainer whose adapter is already wrapped")
        base = int(state.get("lora_base_version", -1))
        if base >= 0:
            with fs.open(f"{root}/base.safetensors", "rb") as f:
                self._load_hf(self.model, st_load(f.read()))
        self.base_version, self._base_dirty = base, False
        self._wrap()
        with fs.open(f"{root}/model/adapter_model.safetensors", "rb") as f:
            lora.load_adapter(self.peft, st_load(f.read()))
