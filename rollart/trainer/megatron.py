"""Megatron-core training backend: a Qwen2/Llama-style policy as a megatron ``GPTModel``.

Consumes a Hugging Face model folder (the same one the torch trainer and the engines
load); produces a ``torch.nn.Module`` the ``Trainer`` drives exactly like the HF model
(``model(input_ids=..., attention_mask=...).logits``) and HF-named state dicts for the
weight store, so inference workers never see the Megatron layout. Called by
``MegatronTrainer`` (``Policy.trainer_backend = "megatron"``) and by tests.

Layout conversion (``hf_to_megatron`` / ``megatron_to_hf``, exact both ways):

* q/k/v projections → one ``linear_qkv`` whose rows are grouped per KV head:
  ``[q heads of group g, k of g, v of g]`` for each group ``g`` (biases likewise);
* gate/up → ``linear_fc1 = [gate; up]``; down → ``linear_fc2``; norms are renamed;
* tensor parallelism (TP) splits column-parallel weights (qkv by groups, fc1 gate and up
  each by rows, embedding and output by vocabulary rows) and row-parallel ones
  (``linear_proj``, ``linear_fc2``) by columns. The vocabulary is padded to a multiple
  of the TP size; padded logits are dropped before they reach the loss.

On CPU, megatron-core needs two workarounds (see ``_cpu_workarounds``): its code calls
``torch.cuda.current_device()`` as a device, and its RNG tracker must be the no-op one.
The process group is gloo on CPU and NCCL on GPU; the optimizer is a plain torch one.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from rollart.model import load_model
from rollart.trainer.backend import TorchBackend
from rollart.trainer.trainer import Trainer

# -- layout conversion (pure torch; no megatron import) -------------------------------


def _dims(cfg) -> tuple[int, int, int, int]:
    """(heads, kv groups, head_dim, hidden) of an HF config."""
    heads = int(cfg.num_attention_heads)
    groups = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return heads, groups, head_dim, int(cfg.hidden_size)


def padded_vocab(cfg, tp_size: int) -> int:
    """The vocabulary size rounded up to a multiple of ``tp_size``."""
    v = int(cfg.vocab_size)
    return -(-v // tp_size) * tp_size


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank].clone()


def check_tp(cfg, tp_size: int) -> None:
    """``tp_size`` must divide the model's attention heads and KV heads (each TP rank
    holds whole heads); a ``ValueError`` naming the divisors that would do otherwise."""
    heads, groups, _, _ = _dims(cfg)
    if groups % tp_size or heads % tp_size:
        fits = [d for d in range(1, groups + 1) if groups % d == 0 and heads % d == 0]
        raise ValueError(f"tensor parallel size {tp_size} must divide the {heads} attention "
                         f"heads and {groups} KV heads; pick a divisor: {fits}")


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg, *, tp_rank: int = 0,
                   tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron ``GPTModel`` state dict of TP rank ``tp_rank`` from an HF one."""
    heads, groups, hd, _ = _dims(cfg)
    check_tp(cfg, tp_size)
    q_per_g = heads // groups
    rows = padded_vocab(cfg, tp_size)
    out = {"embedding.word_embeddings.weight":
           _shard(_pad_rows(hf["model.embed_tokens.weight"], rows), 0, tp_rank, tp_size),
           "decoder.final_layernorm.weight": hf["model.norm.weight"].clone()}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = _shard(_pad_rows(hf["lm_head.weight"], rows), 0,
                                            tp_rank, tp_size)
    for i in range(int(cfg.num_hidden_layers)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            if h + f"self_attn.q_proj.{kind}" not in hf:
                continue
            q = hf[h + f"self_attn.q_proj.{kind}"].reshape(groups, q_per_g * hd, -1)
            k = hf[h + f"self_attn.k_proj.{kind}"].reshape(groups, hd, -1)
            v = hf[h + f"self_attn.v_proj.{kind}"].reshape(groups, hd, -1)
            qkv = torch.cat([q, k, v], dim=1)  # [groups, (q_per_g + 2) * hd, in]
            qkv = _shard(qkv, 0, tp_rank, tp_size)
            out[m + f"self_attention.linear_qkv.{kind}"] = (
                qkv.reshape(-1) if kind == "bias" else qkv.reshape(-1, qkv.shape[-1]))
        out[m + "self_attention.linear_proj.weight"] = _shard(
            hf[h + "self_attn.o_proj.weight"], 1, tp_rank, tp_size)
        gate = _shard(hf[h + "mlp.gate_proj.weight"], 0, tp_rank, tp_size)
        up = _shard(hf[h + "mlp.up_proj.weight"], 0, tp_rank, tp_size)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "mlp.linear_fc2.weight"] = _shard(hf[h + "mlp.down_proj.weight"], 1,
                                                  tp_rank, tp_size)
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], cfg) -> dict[str, torch.Tensor]:
    """The HF state dict from the Megatron state dicts of all TP ranks (in rank order)."""
    heads, groups, hd, _ = _dims(cfg)
    q_per_g, vocab = heads // groups, int(cfg.vocab_size)

    def cat(key, dim):
        return torch.cat([s[key] for s in shards], dim=dim)

    emb = cat("embedding.word_embeddings.weight", 0)[:vocab].clone()
    hf = {"model.embed_tokens.weight": emb,
          "model.norm.weight": shards[0]["decoder.final_layernorm.weight"].clone()}
    hf["lm_head.weight"] = emb if cfg.tie_word_embeddings else \
        cat("output_layer.weight", 0)[:vocab].clone()
    for i in range(int(cfg.num_hidden_layers)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            key = m + f"self_attention.linear_qkv.{kind}"
            if key not in shards[0]:
                continue
            qkv = torch.cat([s[key].reshape(groups // len(shards), (q_per_g + 2) * hd, -1)
                             for s in shards])
            q, k, v = qkv.split([q_per_g * hd, hd, hd], dim=1)
            for name, t in (("q", q), ("k", k), ("v", v)):
                t = t.reshape(-1, t.shape[-1])
                hf[h + f"self_attn.{name}_proj.{kind}"] = t.reshape(-1) if kind == "bias" else t
        hf[h + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        hf[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
        hf[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"].clone()
        hf[h + "post_attention_layernorm.weight"] = \
            shards[0][m + "pre_mlp_layernorm.weight"].clone()
    return {k: v.contiguous() for k, v in hf.items()}


# -- process group and CPU workarounds ------------------------------------------------


def _cpu_workarounds() -> None:
    """Let megatron-core run without CUDA (no-ops on a GPU machine).

    ``torch.cuda.current_device()`` is used as a ``device=`` argument in many places:
    return ``"cpu"`` instead of raising. Megatron's CUDA RNG tracker cannot fork on CPU:
    install its no-op (inference) tracker; dropout is 0 for RL fine-tuning anyway.
    """
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # process-wide; CUDA is absent anyway
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tp_size: int = 1, *, rank: int = 0, world_size: int | None = None,
                  init_method: str | None = None) -> None:
    """Start the torch process group (gloo on CPU, NCCL on GPU) and Megatron's TP groups.

    A single-process trainer calls it with the defaults (a world of one on a free local
    port). Multi-process TP passes ``rank``, ``world_size`` and a shared ``init_method``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    world_size = tp_size if world_size is None else world_size
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        init_method = init_method or f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    _cpu_workarounds()
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


# -- the model ------------------------------------------------------------------------


def transformer_config(cfg, dtype: torch.dtype = torch.float32):
    """A megatron ``TransformerConfig`` matching the HF Qwen2/Llama config ``cfg``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    heads, groups, hd, hidden = _dims(cfg)
    return TransformerConfig(
        num_layers=int(cfg.num_hidden_layers), hidden_size=hidden,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=hd,
        ffn_hidden_size=int(cfg.intermediate_size), normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps), gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=getattr(cfg, "model_type", "") == "qwen2"
        or bool(getattr(cfg, "attention_bias", False)),
        use_cpu_initialization=not torch.cuda.is_available(), params_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=_tp_size())


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _layer_spec():
    """TransformerEngine layers on GPU when installed; megatron's local ones otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if torch.cuda.is_available() and os.environ.get("ROLLART_MEGATRON_LOCAL") != "1":
        try:
            import transformer_engine  # noqa: F401

            return specs.get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")


class MegatronLM(torch.nn.Module):
    """A megatron ``GPTModel`` behind the HF causal-LM call the trainer makes.

    ``forward(input_ids, attention_mask)`` returns an object with ``.logits``
    ``[batch, seq, vocab]`` (full vocabulary, gathered across TP ranks) on the device of
    ``input_ids`` (the model itself sits on the GPU when there is one). Sequences are
    right-padded, so a causal mask is all the attention needs: pad positions only follow
    real tokens and are masked out of the loss.
    """

    def __init__(self, hf_config, hf_state_dict: dict[str, torch.Tensor] | None = None):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        self.hf_config = hf_config
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        rope = getattr(hf_config, "rope_parameters", None) or {}
        base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        self.gpt = GPTModel(
            transformer_config(hf_config), _layer_spec(),
            vocab_size=padded_vocab(hf_config, self.tp_size),
            max_sequence_length=int(hf_config.max_position_embeddings),
            position_embedding_type="rope", rotary_base=float(base),
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            parallel_output=False)
        if torch.cuda.is_available():
            self.gpt.cuda()
        if hf_state_dict is not None:
            self.load_hf_state_dict(hf_state_dict)

    @property
    def device(self) -> torch.device:
        return self.gpt.embedding.word_embeddings.weight.device

    def forward(self, input_ids, attention_mask=None):
        ids = input_ids.to(self.device)
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device)[None].expand(b, -1)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), 1)
        logits = self.gpt(ids, pos, causal[None, None])[..., : int(self.hf_config.vocab_size)]
        # back on the caller's device: the Trainer builds its targets and masks on CPU
        return SimpleNamespace(logits=logits.to(input_ids.device))

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        mine = hf_to_megatron(hf, self.hf_config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        own = self.gpt.state_dict()
        missing = sorted(k for k in own if k not in mine and not k.endswith("_extra_state")
                         and k != "output_layer.weight")
        if missing:
            raise KeyError(f"HF weights give no value for Megatron parameters {missing[:5]}")
        with torch.no_grad():
            self.gpt.load_state_dict(mine, strict=False)

    def megatron_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (CPU copies), extra-state entries dropped."""
        return {k: v.detach().to("cpu").clone() for k, v in self.gpt.state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights (gathered from every TP rank; collective when TP>1)."""
        mine = self.megatron_state_dict()
        if self.tp_size == 1:
            return megatron_to_hf([mine], self.hf_config)
        import torch.distributed as dist
        from megatron.core import parallel_state

        shards: list = [None] * self.tp_size
        dist.all_gather_object(shards, mine,
                               group=parallel_state.get_tensor_model_parallel_group())
        return megatron_to_hf(shards, self.hf_config)


# -- optimizer state under Hugging Face names ---------------------------------------

_MOMENTS = ("exp_avg", "exp_avg_sq")


def named_moments(model: MegatronLM, optimizer) -> dict | None:
    """``optimizer``'s AdamW state as the ``"names"`` layout a trainer gang's checkpoint
    holds: keyed by Hugging Face parameter names (what ``get_optimizer_state_dict`` gives
    for the HF model), whole tensors gathered from every TP rank (a collective over the
    TP group when TP > 1). ``None`` before the first step."""
    params = list(model.gpt.named_parameters())
    state = optimizer.state
    if not params or params[0][1] not in state:
        return None
    mine = {kind: {n: state[p][kind].detach().cpu() for n, p in params} for kind in _MOMENTS}
    step = state[params[0][1]]["step"].detach().cpu().clone()
    if model.tp_size > 1:
        import torch.distributed as dist
        from megatron.core import parallel_state

        shards: list = [None] * model.tp_size
        dist.all_gather_object(shards, mine,
                               group=parallel_state.get_tensor_model_parallel_group())
    else:
        shards = [mine]
    cfg = model.hf_config
    hf = {kind: megatron_to_hf([s[kind] for s in shards], cfg) for kind in _MOMENTS}
    names = [n for n in hf["exp_avg"]
             if not (cfg.tie_word_embeddings and n == "lm_head.weight")]  # one parameter
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return {"state": {n: {"step": step.clone(), **{kind: hf[kind][n] for kind in _MOMENTS}}
                      for n in names},
            "param_groups": [{**group, "params": names}]}


def load_named_moments(model: MegatronLM, optimizer, named: dict) -> None:
    """Load a ``"names"`` AdamW state (``named_moments``'s, or a torch gang's) into
    ``optimizer`` over this TP rank's parameters (each moment cut as its weight is)."""
    cfg, state = model.hf_config, named["state"]
    mine = {kind: hf_to_megatron({n: s[kind] for n, s in state.items()}, cfg,
                                 tp_rank=model.tp_rank, tp_size=model.tp_size)
            for kind in _MOMENTS}
    step = next(iter(state.values()))["step"]
    own = optimizer.state_dict()
    params = [n for n, _ in model.gpt.named_parameters()]
    missing = [n for n in params if n not in mine["exp_avg"]]
    if missing:
        raise KeyError(f"the checkpoint's optimizer state has no moments for {missing[:5]}")
    own["state"] = {i: {"step": step.clone(), **{kind: mine[kind][n].clone()
                                                   for kind in _MOMENTS}}
                    for i, n in enumerate(params)}
    optimizer.load_state_dict(own)


def load_megatron_model(path, *, tp_size: int = 1) -> MegatronLM:
    """Build a ``MegatronLM`` from an HF model folder (starts a 1-process group if none)."""
    hf_model = load_model(path)
    init_parallel(tp_size)
    model = MegatronLM(hf_model.config, hf_model.state_dict())
    model.eval()
    return model


# -- the Trainer backend --------------------------------------------------------------


class MegatronBackend(TorchBackend):
    """The policy as a megatron-core ``GPTModel`` (``MegatronLM``), held by a ``Trainer``
    (``rollart.trainer.backend``): Hugging Face names in the weight store and on disk."""

    def load_policy(self, model_path: str, device) -> MegatronLM:
        return load_megatron_model(model_path)

    def hf_state_dict(self, model) -> dict:
        return model.hf_state_dict()

    def frozen_copy(self, model):
        # a GPTModel holds process groups, which do not deepcopy: rebuild from weights
        return MegatronLM(model.hf_config, self.hf_state_dict(model))

    def save_pretrained(self, model, path: str, model_path: str) -> None:
        """Converted back from Megatron, into the HF model of ``model_path``."""
        hf = load_model(model_path)
        hf.load_state_dict(self.hf_state_dict(model), strict=False)
        hf.save_pretrained(path)

    def hf_weights(self, module) -> dict:
        return module.hf_state_dict()

    def load_hf(self, module, state: dict) -> None:
        module.load_hf_state_dict(state)

    def load_named_optimizer(self, model, optimizer, state: dict) -> None:
        load_named_moments(model, optimizer, state)

    def read_dcp(self, model, optimizer, path: str, *, weights: bool, moments: bool,
                 sharded: bool = False) -> None:
        """A torch trainer gang's sharded checkpoint holds the Hugging Face model's
        parameters as DTensor shards (``rollart.trainer.fsdp``); a megatron ``GPTModel``'s
        are others, under other names: refused, with the fix."""
        raise ValueError(
            f"{path} is a torch trainer gang's sharded checkpoint (torch.distributed."
            f"checkpoint, optimizer_format 'dcp'), which the Megatron backend does not "
            f"load: resume it with the backend it was trained with (--set "
            f"policy.trainer_backend=torch), or start the Megatron run from its model/ "
            f"folder (--model PATH/model; the optimizer's moments start again)")


class MegatronTrainer(Trainer):
    """``Trainer`` with the policy as a megatron-core ``GPTModel`` (``MegatronLM``): it
    holds a ``MegatronBackend``.

    Same actor API, loss, optimizer (plain torch AdamW) and weight store; the store gets
    HF-named weights, so inference workers (torch or vLLM) load them unchanged. This
    actor is one process (one TRAIN worker: tensor parallelism 1); N TRAIN workers are a
    tensor x data parallel gang of them (``rollart.trainer.megatron_gang``, laid out by
    ``Policy.trainer_parallel``), whose checkpoints this one loads (``"names"`` layout:
    ``MegatronBackend.load_named_optimizer``).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("backend", MegatronBackend())
        super().__init__(*args, **kwargs)
