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


def load_adapter(peft_model, state: dict) -> None:
    """Set the adapter of ``peft_model`` to ``state`` (``adapter_state``'s names)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_model, state)
    missing = [k for k in getattr(result, "unexpected_keys", [])]
    if missing:
        raise KeyError(f"adapter tensors that match no adapted layer: {missing[:4]}")


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
        self.model, self.scale = model, scaling(options)
        self.modules = dict(model.named_modules())
        self.base: dict[str, torch.Tensor] = {}  # module path -> its weight before merging
        self.current: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def check(self, adapter: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{module path: (A, B)}`` of ``adapter``; ``KeyError`` / ``ValueError`` naming
        a tensor that fits no linear layer of the model."""
        pairs: dict[str, dict] = {}
        for key, t in adapter.items():
            path, _, rest = key.removeprefix(PREFIX).partition(".lora_")
            pairs.setdefault(path, {})[rest.split(".", 1)[0]] = t
        out = {}
        for path, ab in pairs.items():
            layer = self.modules.get(path)
            if not isinstance(layer, torch.nn.Linear):
                raise KeyError(f"adapter tensors for {path!r}, which is not a linear layer "
                               "of this engine's model")
            if set(ab) != {"A", "B"}:
                raise KeyError(f"adapter of {path!r} has {sorted(ab)}, needs lora_A and lora_B")
            a, b = ab["A"], ab["B"]
            out_f, in_f = layer.weight.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f \
                    or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter of {path!r}: lora_A {tuple(a.shape)}, lora_B "
                                 f"{tuple(b.shape)} do not fit its weight {(out_f, in_f)}")
            w = layer.weight
            out[path] = (a.to(device=w.device, dtype=w.dtype), b.to(device=w.device,
                                                                    dtype=w.dtype))
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
