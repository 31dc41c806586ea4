"""LoRA adapters (``Policy.lora``) on peft: wrap the trainer's model, name the adapter's
tensors, and apply a published adapter in an engine without reloading its base.

Consumes a Hugging Face causal LM and the ``LoRA`` settings as peft options
(``LoRA.peft_options()``: ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``use_rslora``); produces a peft model whose adapter alone trains (``wrap``), the
adapter's tensors under peft's names (``adapter_state``:
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``, what a peft adapter folder and vLLM's LoRA loader read), and, in an
engine, ``MergedAdapter``: each adapted layer's weight set to ``W + s·B·A`` from a kept
copy of ``W``, so an adapter swap is a few small matmuls and the engine's forward (the
lean one included) stays the plain model's.

A weight version of a LoRA run holds the adapter only, with ``ADAPTER``, ``BASE`` and
``CONFIG`` in its header: ``BASE`` is the version whose full weights the adapter
applies to, -1 for the model folder's (a run with a format warm-up publishes
its warmed base once as a full version, which garbage collection keeps).
"""

from __future__ import annotations

import torch

from rollart.weights.store import ADAPTER, BASE

CONFIG = "rollart.lora"  # an adapter version's header: its peft options, as JSON
PREFIX = "base_model.model."  # peft's prefix on the wrapped model's module names
FORMAT = "peft-lora"


class LoRATargetError(ValueError):
    """``LoRA.target_modules`` names a module the model does not have."""


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def split(state_dict: dict) -> tuple[dict, dict]:
    """``(full weights, adapter tensors)`` of a published or staged state dict."""
    full = {k: v for k, v in state_dict.items() if not is_adapter_key(k)}
    return full, {k: v for k, v in state_dict.items() if is_adapter_key(k)}


def linear_names(model) -> list[str]:
    """The model's linear layers, by module path."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def check_targets(model, options: dict) -> None:
    """``LoRATargetError`` listing the model's linear layers when a named target matches
    none of them (peft's own error names only the target)."""
    targets = options["target_modules"]
    if targets == "all-linear":
        return
    names = linear_names(model)
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise LoRATargetError(
                f"LoRA.target_modules {tuple(targets)!r}: {t!r} matches no linear layer of "
                f"this model ({type(model).__name__}); its linear layers are named "
                f"{suffixes} (e.g. {names[:3]}); use some of those, or 'auto'")


def check_folder_targets(model_path: str, options: dict) -> None:
    """``check_targets`` on the model folder's architecture, built on the meta device
    (no weights read): a bad ``LoRA.target_modules`` fails before any actor starts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollart.model import adapter_base

    config = AutoConfig.from_pretrained(adapter_base(model_path) or model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_targets(model, options)


def wrap(model, options: dict):
    """``model`` as a peft model with a fresh adapter: only the adapter trains."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, options)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **options))


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's names (no base weights)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


def check_adapter(adapter: dict, shapes: dict[str, tuple], rank: int) -> None:
    """``ValueError`` naming the tensors of ``adapter`` (peft's names) that do not fit a
    model whose weights have ``shapes`` (name -> shape) with LoRA rank ``rank``: no such
    layer, another shape, or an A without its B (and the other way round)."""
    bad = []
    for key, v in adapter.items():
        path, _, part = key.removeprefix(PREFIX).rpartition(".lora_")
        out_in = shapes.get(path + ".weight", ())
        want = "no such layer"
        if key.startswith(PREFIX) and len(out_in) == 2:
            want = {"A.weight": (rank, out_in[1]), "B.weight": (out_in[0], rank)}.get(part)
        if tuple(v.shape) != want:
            bad.append(f"{key} {tuple(v.shape)} (expected {want})")
        twin = f"{PREFIX}{path}.lora_{'B' if part.startswith('A') else 'A'}.weight"
        if twin not in adapter:
            bad.append(f"{key} without {twin}")
    if bad:
        raise ValueError(f"adapter tensors do not fit the model with r={rank}: {bad[:3]}")


def load_adapter(peft_model, state: dict) -> None:
    """Set the adapter of ``peft_model`` to ``state`` (``adapter_state``'s names)."""
    from peft import set_peft_model_state_dict

    unexpected = set_peft_model_state_dict(peft_model, state).unexpected_keys
    if unexpected:
        raise KeyError(f"adapter tensors that match no adapted layer: {unexpected[:4]}")


def save_folder(peft_model, path: str, folder: str, base: dict | None, tokenizer) -> None:
    """Write ``peft_model``'s adapter as a peft adapter folder ``path`` whose
    ``base_model_name_or_path`` is the model ``folder`` or, when ``base`` (full weights
    under Hugging Face names: a warmed base) is given, ``path/base``, written as a model
    folder with ``tokenizer``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from rollart.weights.store import _untie

    if base is not None:
        folder = str(Path(path, "base").resolve())
        Path(folder).mkdir(parents=True, exist_ok=True)
        peft_model.get_base_model().config.save_pretrained(folder)
        save_file(_untie(base), f"{folder}/model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(folder)
    peft_model.save_pretrained(path)
    cfg = Path(path, "adapter_config.json")
    config = json.loads(cfg.read_text())
    config["base_model_name_or_path"] = folder
    cfg.write_text(json.dumps(config, indent=2))


def metadata(base: int, options: dict) -> dict[str, str]:
    """The header of an adapter version applying to version ``base`` (-1: the folder),
    with its LoRA settings (``options``, as JSON): a version describes itself."""
    import json

    return {ADAPTER: FORMAT, BASE: str(int(base)), CONFIG: json.dumps(options)}


def base_of(meta: dict) -> int | None:
    """The base version an adapter version's header names; None for full weights."""
    return int(meta[BASE]) if meta.get(ADAPTER) == FORMAT else None


def scaling(options: dict) -> float:
    r = options["r"]
    return options["lora_alpha"] / (r ** 0.5 if options.get("use_rslora") else r)


class MergedAdapter:
    """An adapter applied to a plain model by merging: ``W = W0 + s·B·A`` per adapted
    linear layer, ``W0`` kept. Used by ``rollart.rollout.engine.TorchEngine``."""

    def __init__(self, model, options: dict):
        self.model, self.scale, self.rank = model, scaling(options), options["r"]
        self.modules = dict(model.named_modules())
        self.shapes = {f"{n}.weight": tuple(m.weight.shape) for n, m in self.modules.items()
                       if isinstance(m, torch.nn.Linear)}
        self.base: dict[str, torch.Tensor] = {}  # module path -> its weight before merging
        self.current: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def check(self, adapter: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{module path: (A, B)}`` of ``adapter`` on the model's device and dtype;
        ``ValueError`` (``check_adapter``) naming a tensor that fits no linear layer."""
        check_adapter(adapter, self.shapes, self.rank)
        out = {}
        for path in {k.removeprefix(PREFIX).rpartition(".lora_")[0] for k in adapter}:
            w = self.modules[path].weight
            a, b = (adapter[f"{PREFIX}{path}.lora_{x}.weight"] for x in "AB")
            out[path] = (a.to(device=w.device, dtype=w.dtype),
                         b.to(device=w.device, dtype=w.dtype))
        return out

    def rebase(self) -> None:
        """The model's weights were replaced (a new base): forget the kept copies."""
        self.base.clear()

    def apply(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Merge ``pairs`` (``check``'s; None: the current adapter again, after a new
        base) into the model's weights."""
        pairs = self.current if pairs is None else pairs
        with torch.inference_mode(False), torch.no_grad():
            for path in set(self.base) - set(pairs):  # a layer the new adapter leaves
                self.modules[path].weight.copy_(self.base.pop(path))
            for path, (a, b) in pairs.items():
                w = self.modules[path].weight
                if path not in self.base:
                    self.base[path] = w.detach().clone()
                w.copy_(self.base[path] + self.scale * (b @ a))
        self.current = pairs
