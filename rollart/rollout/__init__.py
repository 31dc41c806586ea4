"""Rollout side: the generation engine, its Dask actor, and the trajectory router.

``TorchEngine`` (plain PyTorch batched generation) is owned by an ``InferenceWorker``
actor per inference worker; env managers reach the workers through an ``LLMProxy``.
``pd`` (portable KV handoffs, prefix cache) and ``kv`` (moving a handoff from the
prefill worker to the decode worker over Dask's comms) implement PD disaggregation.

Consumes generation requests (token ids, sampling limits, a trajectory id) from the env
managers' trajectory runners and the weight versions the trainer publishes (through
``rollart.weights``); produces generated ids with their behaviour log-probs and policy
versions. Started by the control plane (``rollart.control.stages``); ``base`` (engine
names and the weight-update rule) is read by ``rollart.config.graph``.
"""

from rollart._lazy import lazy_exports

# imported on first use: ``rollart.rollout.base`` (engine names, read by rollart.config.graph)
# and ``routing`` must not pull in torch
_WHERE = {"InferenceWorker": "rollart.rollout.worker", "LLMProxy": "rollart.rollout.proxy",
          "TorchEngine": "rollart.rollout.engine"}


__getattr__ = lazy_exports(globals(), _WHERE)
