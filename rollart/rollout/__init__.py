"""Rollout side: the generation engine, its Dask actor, and the trajectory router.

``TorchEngine`` (plain PyTorch batched generation) is owned by an ``InferenceWorker``
actor per inference worker; env managers reach the workers through an ``LLMProxy``.
``pd`` (portable KV handoffs, prefix cache) and ``kv`` (moving a handoff from the
prefill worker to the decode worker over Dask's comms) implement PD disaggregation.
"""

import importlib

# imported on first use: ``rollart.rollout.base`` (engine names, read by rollart.graph)
# and ``routing`` must not pull in torch
_WHERE = {"InferenceWorker": "rollart.rollout.worker", "LLMProxy": "rollart.rollout.proxy",
          "TorchEngine": "rollart.rollout.engine"}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rollart.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = ["InferenceWorker", "LLMProxy", "TorchEngine"]
