"""Set-up helpers of ``VLLMEngine`` (``rollart.rollout.vllm_engine``) that need no vLLM
import: the environment vLLM reads at start, the ``lora`` option checked against what
vLLM accepts, the weights' names and shapes read from a model folder, and the tied LM
head's refresh run inside vLLM's worker after an in-place reload.
"""

from __future__ import annotations

import os

import torch


def set_env_defaults() -> None:
    """vLLM reads these at engine start; the caller's own settings win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step it in-process
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # host owns threads


#: The ranks vLLM's ``max_lora_rank`` accepts (``vllm.config.lora.MaxLoRARanks``).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_lora(lora: dict | None) -> dict | None:
    """The engine's ``lora`` option, checked; ``None`` stays ``None``."""
    if lora is None:
        return None
    missing = sorted({"r", "lora_alpha", "target_modules"} - set(lora))
    if missing:
        raise ValueError(f"lora option misses {missing}: pass peft's LoRA options, e.g. "
                         "rollart.LoRA(rank=16).peft_options()")
    r = lora["r"]
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= VLLM_RANKS[-1]:
        raise ValueError(f"lora r must be an int in [1, {VLLM_RANKS[-1]}] (vLLM's largest "
                         f"max_lora_rank), got {r!r}")
    targets = lora["target_modules"]
    if not (targets == "all-linear" or (isinstance(targets, (list, tuple)) and targets)):
        raise ValueError(f"lora target_modules must be 'all-linear' or a list of module-name "
                         f"suffixes such as ['q_proj', 'v_proj'], got {targets!r}")
    return {"r": r, "lora_alpha": float(lora["lora_alpha"]),
            "lora_dropout": float(lora.get("lora_dropout", 0.0)),
            "target_modules": targets if isinstance(targets, str) else list(targets),
            "use_rslora": bool(lora.get("use_rslora", False))}


def refresh_tied_head(worker) -> bool:
    """(runs in vLLM's worker) Re-derive the tied LM head's packed CPU weight.

    On CPU the head keeps a pre-packed copy of the embedding; after an in-place reload
    it may be stale. Re-running its ``process_weights_after_loading`` rebuilds it.
    """
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is None or method is None:
        return False
    method.process_weights_after_loading(head)
    return True


def folder_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the weights in a model folder (read from safetensors headers)."""
    from safetensors import safe_open

    shapes = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    if not shapes:
        raise ValueError(f"model folder {path!r} has no *.safetensors weights; vLLM needs them")
    return shapes
