"""``Policy``: the model a graph trains, its warm-up, how it samples and which trainer
backend trains it, as a frozen dataclass validated on construction (messages say what to
change). Part of a ``Graph`` (``rollart.config.graph``, which re-exports it); read by the
control loop, the stages that place inference workers and trainers, and evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart.chat.conversation import CONVERSATIONS
from rollart.config.checks import check as _check
from rollart.config.checks import check_numbers as _numbers
from rollart.config.training import LoRA, TrainerParallel
from rollart.rollout.base import ENGINES, weight_update_problem

TRAINER_BACKENDS = ("torch", "megatron")  # see rollart.trainer


@dataclass(frozen=True)
class Policy:
    """The model and how it samples. ``model=None`` builds the built-in tiny model."""

    model: str | None = None  # a Hugging Face model folder on disk (None: the built-in tiny model)
    warmup_steps: int = 300  # supervised format warm-up of the built-in model (0 = none)
    warmup_batch: int = 32  # episodes per warm-up step
    warmup_lr: float = 3e-3  # the warm-up's learning rate
    # torch threads for the warm-up on the trainer's host (None: every core that host gives
    # the trainer's process; nothing else of the run computes before the first weights)
    warmup_threads: int | None = None
    # threads that play the warm-up's episodes, one batch ahead of the model's step (env
    # steps and tool calls wait outside the GIL); None: one after another in the step, the
    # episode stream of earlier releases (an int gives each episode its own rng: the same
    # batches for any thread count, another stream than None's)
    warmup_episode_threads: int | None = None
    # chat: warm-up steps before the ones above, on the tasks whose envs declare tools,
    # alone, with the tool list left out of the template (the observation right before
    # the call) and the loss on the model's turns only: teaches a small model to copy an
    # observation into its tool call (rollart.trainer.warmup.run_warmup; 0 = none)
    warmup_bare_tool_steps: int = 0
    # the warm-up as supervised fine-tuning of a pretrained model on its tasks'
    # warmup_action demonstrations: it runs on a model folder (Policy.model, --model) too,
    # with the loss on the model's turns only; saved and evaluated as its own row
    warmup_pretrained: bool = False
    warmup_tasks: tuple[str, ...] = ()  # the tasks the warm-up plays (empty: every task)
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling (1.0: off; Task.top_p overrides it per task)
    max_batch: int = 64  # requests batched together by one inference worker
    # torch engine: decode steps between admissions into a running batch (arrivals in
    # between share one prefill; 1 = admit at every step)
    admit_every: int = 4
    engine: str = "torch"  # generation engine: "torch" | "vllm" (rollart.rollout.base)
    # what a new policy version does to the requests being generated when it arrives:
    # "recompute" re-prefills their contexts (prompt + tokens so far) under the new
    # weights, a stall per swap; "keep" goes on over the KV cache they have, no
    # re-prefill: their later tokens come from the new weights attending to KV computed
    # by the old ones (each token keeps the version and behaviour log-prob it was
    # sampled under, so the off-policy correction covers it). KV of other weights is
    # never reused by another request in either mode. "keep" with engine="vllm" and
    # lora is refused (vLLM fixes a request's adapter when the request is added)
    weight_update: str = "recompute"
    trainer_backend: str = "torch"  # "torch" (HF model) | "megatron" (megatron-core GPTModel)
    # how a trajectory becomes ids (rollart.chat.conversation): "chat" renders messages
    # with the tokenizer's chat template, "raw" concatenates text, "auto" = chat when the
    # tokenizer has a template
    conversation: str = "auto"
    system_prompt: str | None = None  # chat: the system message (Task.system_prompt wins)
    max_context: int | None = None  # context budget in tokens (None: the model config's)
    # a chat template without a system role (Gemma's): False folds the system prompt into
    # the first user turn (one warning at start), True makes it an error at start
    # (rollart.chat.template_support)
    strict_template: bool = False
    # LoRA adapters instead of full fine-tuning (None: every weight trains), e.g.
    # LoRA(rank=16), or from the command line --set policy.lora.rank=16
    lora: LoRA | None = None
    # how a gang of N TRAIN workers is laid out: tensor x data parallel, tp x dp = N
    # (TrainerParallel; the torch backend: data parallel only, tp=1), e.g.
    # --set policy.trainer_parallel.tp=2 with trainer_backend="megatron"
    trainer_parallel: TrainerParallel = TrainerParallel()

    def __post_init__(self):
        if isinstance(self.lora, dict):  # as graph.json records it
            object.__setattr__(self, "lora", LoRA(**self.lora))
        if isinstance(self.trainer_parallel, dict):
            object.__setattr__(self, "trainer_parallel",
                               TrainerParallel(**self.trainer_parallel))
        _check(isinstance(self.trainer_parallel, TrainerParallel),
               f"Policy.trainer_parallel must be a rollart.TrainerParallel, got "
               f"{self.trainer_parallel!r}")
        self.trainer_parallel.check_backend(self.trainer_backend)
        _check(self.lora is None or isinstance(self.lora, LoRA),
               f"Policy.lora must be a rollart.LoRA or None, got {self.lora!r}")
        _check(self.lora is None or self.trainer_backend == "torch",
               f"Policy.lora with trainer_backend={self.trainer_backend!r}: LoRA trains with "
               "the torch backend only (peft on the Hugging Face model); set "
               "trainer_backend='torch', or Policy.lora=None for Megatron")
        _check(self.model is None or isinstance(self.model, str),
               f"Policy.model must be a path to a Hugging Face model folder or None, "
               f"got {self.model!r}")
        _numbers(self, "warmup_steps", "warmup_bare_tool_steps", "warmup_batch", "max_batch",
                 "admit_every", integer=True)
        _numbers(self, "warmup_lr", "temperature", "top_p")
        _check(self.warmup_batch >= 1, f"Policy.warmup_batch must be ≥ 1, got "
               f"{self.warmup_batch}")
        _check(self.warmup_threads is None or (isinstance(self.warmup_threads, int)
                                                and self.warmup_threads >= 1),
               f"Policy.warmup_threads must be None (every core of the trainer's host) or "
               f"an int ≥ 1, got {self.warmup_threads!r}")
        _check(self.warmup_episode_threads is None or (
            isinstance(self.warmup_episode_threads, int) and self.warmup_episode_threads >= 1),
               f"Policy.warmup_episode_threads must be None (episodes one after another) or "
               f"an int ≥ 1, got {self.warmup_episode_threads!r}")
        _check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
               f"Policy.warmup_steps must be an int ≥ 0, got {self.warmup_steps!r}")
        _check(self.warmup_bare_tool_steps >= 0,  # an int: _numbers above
               f"Policy.warmup_bare_tool_steps must be an int ≥ 0, got "
               f"{self.warmup_bare_tool_steps!r}")
        _check(self.warmup_bare_tool_steps == 0 or self.conversation != "raw",
               f"Policy.warmup_bare_tool_steps={self.warmup_bare_tool_steps} needs the chat "
               "format (tools reach the model through its chat template); with "
               "conversation='raw' set it to 0")
        _check(isinstance(self.warmup_pretrained, bool), f"Policy.warmup_pretrained must be "
               f"True or False, got {self.warmup_pretrained!r}")
        _check(isinstance(self.warmup_tasks, (tuple, list)) and all(
            isinstance(t, str) for t in self.warmup_tasks), f"Policy.warmup_tasks must be a "
            f"tuple of task names (empty: every task), got {self.warmup_tasks!r}")
        object.__setattr__(self, "warmup_tasks", tuple(self.warmup_tasks))  # graph.json: list
        _check(self.temperature > 0, f"Policy.temperature must be > 0 for RL sampling, "
               f"got {self.temperature!r}")
        _check(0 < self.top_p <= 1, f"Policy.top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.max_batch >= 1, f"Policy.max_batch must be ≥ 1, got {self.max_batch!r}")
        _check(self.admit_every >= 1,
               f"Policy.admit_every must be ≥ 1, got {self.admit_every!r}")
        _check(self.engine in ENGINES, f"Policy.engine must be one of {ENGINES}, "
               f"got {self.engine!r}")
        problem = weight_update_problem(self.weight_update, self.engine, self.lora is not None)
        _check(problem is None, problem)
        _check(self.trainer_backend in TRAINER_BACKENDS, f"Policy.trainer_backend must be "
               f"one of {TRAINER_BACKENDS}, got {self.trainer_backend!r}")
        _check(self.conversation in CONVERSATIONS, f"Policy.conversation must be one of "
               f"{CONVERSATIONS}, got {self.conversation!r}")
        _check(self.system_prompt is None or isinstance(self.system_prompt, str),
               f"Policy.system_prompt must be a str or None, got {self.system_prompt!r}")
        _check(isinstance(self.strict_template, bool), f"Policy.strict_template must be "
               f"True or False, got {self.strict_template!r}")
        _numbers(self, "max_context", integer=True, optional=True)
        _check(self.max_context is None or self.max_context >= 2,
               f"Policy.max_context must be ≥ 2 tokens or None (the model config's "
               f"max_position_embeddings), got {self.max_context!r}")

    @property
    def warmup_total_steps(self) -> int:
        """Every warm-up step: the first stage's (``warmup_bare_tool_steps``) and the rest."""
        return self.warmup_steps + self.warmup_bare_tool_steps

    def conversation_options(self) -> dict:
        """How trajectories become token ids (``rollart.chat.conversation``): the same
        keyword arguments for rollout (``EnvManager``), warm-up and evaluation."""
        return {"conversation": self.conversation, "system_prompt": self.system_prompt,
                "max_context": self.max_context}

    def worker_options(self) -> dict:
        """The ``InferenceWorker`` keyword arguments this policy implies."""
        opts = {"max_batch": self.max_batch, "engine": self.engine}
        engine = {"admit_every": self.admit_every} if self.engine == "torch" else {}
        engine["weight_update"] = self.weight_update
        if self.lora is not None:
            engine["lora"] = self.lora.peft_options()
        opts["engine_options"] = engine
        return opts
