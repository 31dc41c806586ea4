"""Rollout side: the generation engine, its Dask actor, and the trajectory router.

``TorchEngine`` (plain PyTorch batched generation) is owned by an ``InferenceWorker``
actor per inference worker; env managers reach the workers through an ``LLMProxy``.
``pd`` (portable KV handoffs, prefix cache) and ``kv`` (moving a handoff from the
prefill worker to the decode worker over Dask's comms) implement PD disaggregation.
"""

from rollart.rollout.engine import TorchEngine
from rollart.rollout.proxy import LLMProxy
from rollart.rollout.worker import InferenceWorker

__all__ = ["InferenceWorker", "LLMProxy", "TorchEngine"]
