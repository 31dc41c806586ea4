"""A rollart task as Hugging Face TRL sees it: an ``environment_factory`` env, a chat
template and a response parser for the built-in tiny model (used by ``vs_trl.py``).

TRL's ``GRPOTrainer`` runs multi-turn episodes as tool calls: the model's reply is
parsed into a tool call, the environment method of that name runs, its return value is
appended as a ``tool`` message and the model replies again, until a reply carries no
tool call. This module maps a rollart ``Task`` onto that loop so that both trainers see
the *same token sequences*::

    rollart (TokenLog)     obs_1  a_1 <eos>  obs_2  a_2 <eos> ...
    TRL (chat template)    user   assistant  tool   assistant ...  (rendered the same)

* ``GameEnv`` wraps one env of the task: ``reset(seed)`` returns the first observation
  (TRL appends it to the empty user message), ``act(action)`` is the one tool (one env
  step), ``get_reward()`` scores the finished episode with the task's own reward
  function (TRL calls it once per rollout).
* ``CHAT_TEMPLATE`` renders the ``act`` tool call as its bare argument followed by
  ``<eos>`` — the format the built-in model learns in its warm-up — and any other tool
  call in full (name and JSON arguments), so TRL's template checks see a template that
  keeps every part of a tool-calling exchange. Tool schemas are not rendered: the tiny
  model learned its one tool's format in the warm-up, as a tool-tuned model would have.
* ``GameTokenizer.parse_response`` turns a reply into an ``act`` call with the reply's
  text, unless the previous observation ended the episode (it no longer ends with the
  env's prompt ``act :``): then the reply is a plain message and TRL's loop stops.
  TRL always asks the model once more after the last env step; those few tokens are
  part of its batch.

``run_trl`` trains with TRL (imported there only: the rest needs transformers and
rollart alone).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from rollart.chaos.faults import Faults, with_faults
from rollart.env.tasks import Task, get_task
from rollart.model import load_tokenizer
from rollart.reward.functions import check_reward
from rollart.types import Episode

TOOL = "act"
PROMPT_END = "act :"  # every built-in observation that expects an action ends with this

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if f.name == '" + TOOL + "' -%}"
    "{{ ' ' ~ (f.arguments.action if f.arguments.action is defined else '') }}"
    "{%- else -%}"
    "{{ ' ' ~ f.name ~ ' ' ~ (f.arguments | tojson) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ ' ' ~ m.content }}"
    "{%- endif -%}"
    "{{ ' ' ~ eos_token }}"
    "{%- else -%}"
    "{{ ' ' ~ m.content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# TRL only checks that a response template is set before it calls ``parse_response``;
# this one documents the format (``GameTokenizer.parse_response`` does the parsing).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"\Z",
    "fields": {"content": {"content": "text"}},
}


class GameTokenizer(PreTrainedTokenizerFast):
    """The built-in word-level tokenizer plus the game's chat format for TRL.

    >>> # tok = GameTokenizer.from_model_folder(model_dir)
    """

    @classmethod
    def from_model_folder(cls, path) -> "GameTokenizer":
        """The folder's tokenizer as rollart loads it, with the game's chat format.

        (``from_pretrained`` on a subclass would let transformers rebuild the word-level
        vocabulary; wrapping the loaded backend keeps the token ids rollart uses.)
        """
        base = load_tokenizer(path)
        return cls(tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token,
                   pad_token=base.pad_token, unk_token=base.unk_token,
                   clean_up_tokenization_spaces=False)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_template = CHAT_TEMPLATE
        self.response_template = RESPONSE_TEMPLATE
        self.padding_side = "left"  # TRL generates from left-padded prompts

    def parse_response(self, response, schema=None, *, prefix=None, tools=None):
        """A reply → ``{"role": "assistant", "content": ..., "tool_calls": [act]}``."""
        text = self.decode(list(response), skip_special_tokens=True).strip()
        before = self.decode(list(prefix or []), skip_special_tokens=True).strip()
        if not before.endswith(PROMPT_END):  # the episode is over: a closing message
            return {"role": "assistant", "content": text}
        call = {"type": "function", "function": {"name": TOOL, "arguments": {"action": text}}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}


# The chat format (``--conversation chat``): rollart's chat conversation of a game, as
# the chat toy's ChatML template renders it (``rollart.model.CHAT_TEMPLATE``, no system
# prompt, no tools): each observation a ``user`` turn, each action the ``assistant``
# turn's content. TRL's loop records the env's replies as ``tool`` messages and the
# actions as ``act`` calls; this template renders them as exactly those turns.
#: a ChatML assistant turn in which an ``act`` call renders as the action's bare text
#: (any other call as its name and JSON arguments)
ASSISTANT_TURN = (
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if f.name == '" + TOOL + "' -%}"
    "{{- f.arguments.action if f.arguments.action is defined else '' -}}"
    "{%- else -%}{{- f.name ~ ' ' ~ (f.arguments | tojson) -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{- m.content -}}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
)
CHAT_GAME_TEMPLATE = (
    "{%- for m in messages -%}" + ASSISTANT_TURN +
    "{%- else -%}"
    "{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


class ChatGameTokenizer(PreTrainedTokenizerFast):
    """The chat toy's byte-level BPE tokenizer with ``CHAT_GAME_TEMPLATE`` for TRL: the
    same ids rollart's ``conversation="chat"`` builds for a game. Subclasses set another
    ``template`` and the rule ``game_on``."""

    template = CHAT_GAME_TEMPLATE

    @classmethod
    def from_model_folder(cls, path) -> "ChatGameTokenizer":
        base = load_tokenizer(path)
        return cls(tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token,
                   pad_token=base.pad_token, additional_special_tokens=["<|im_start|>"],
                   clean_up_tokenization_spaces=False)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_template = self.template
        self.response_template = RESPONSE_TEMPLATE
        self.padding_side = "left"

    @staticmethod
    def game_on(last: str) -> bool:
        """Whether the last user turn's text asks for another action."""
        return last.endswith(PROMPT_END)

    def parse_response(self, response, schema=None, *, prefix=None, tools=None):
        """A reply → an ``act`` call while the last user/tool turn asks for an action,
        else a closing message (TRL's loop stops)."""
        ids = [i for i in response if i != self.eos_token_id]
        text = self.decode(ids, skip_special_tokens=True).strip()
        before = self.decode(list(prefix or []), skip_special_tokens=False)
        last = before.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0].strip()
        if not self.game_on(last):
            return {"role": "assistant", "content": text}
        call = {"type": "function", "function": {"name": TOOL, "arguments": {"action": text}}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}


def tokenizer_for(model_dir: str, conversation: str):
    """The TRL-side tokenizer of ``conversation`` (``raw`` or ``chat``)."""
    cls = ChatGameTokenizer if conversation == "chat" else GameTokenizer
    return cls.from_model_folder(model_dir)


class GameEnv:
    """One env of a rollart task, as a TRL environment (``environment_factory``).

    Subclasses made by ``env_class`` fix ``task``. TRL exposes every public method but
    ``reset`` and ``get_reward`` as a tool, so ``act`` is the only one.
    """

    task: Task

    def __init__(self):
        self.env = self.task.env_factory()
        self.seed = 0
        self.observations: list[str] = []
        self.actions: list[str] = []
        self.rewards: list[float] = []
        self.info: dict = {}
        self.done = True

    def reset(self, seed: int = 0, **_row) -> str:
        """Start the episode of ``seed`` (a dataset column) and return its first text."""
        self.seed = int(seed)
        obs = self.env.reset(self.seed)
        self.observations, self.actions, self.rewards = [obs], [], []
        self.info, self.done = {}, False
        return obs

    def act(self, action: str) -> str:
        """Take one turn of the game.

        Args:
            action: The move to play, one word.

        Returns:
            The game's reply: what it shows next.
        """
        if self.done:
            raise RuntimeError("the episode is over")
        step = self.env.step(action)
        self.actions.append(action)
        self.observations.append(step.observation)
        self.rewards.append(step.reward)
        self.info, self.done = dict(step.info), step.done
        return step.observation

    def get_reward(self) -> float:
        """The task's reward for the episode played so far (0 steps count as a failure)."""
        ep = Episode(self.task.name, self.seed, self.observations, self.actions,
                     self.rewards, self.info)
        return check_reward(self.task.reward_fn(ep), self.task.reward_fn.__name__)

    @property
    def succeeded(self) -> bool:
        return bool(self.info.get("success"))


def env_class(task: Task | str, faults: Faults | None = None) -> type[GameEnv]:
    """A ``GameEnv`` subclass for ``task`` (its envs inject ``faults`` when given); pass
    the class itself as TRL's ``environment_factory``."""
    task = get_task(task)
    if faults is not None:
        task = with_faults(task, faults)
    return type(f"{task.name.capitalize()}Env", (GameEnv,), {"task": task})


# -- training with TRL (the bench extra) ----------------------------------------------
def trl_config(s: dict, task, out_dir: str, micro_batch: int | None = None):
    """GRPOConfig matching rollart's GRPO settings (and TRL's CPU requirements).

    ``micro_batch``: completions per forward (``per_device_train_batch_size``), with
    ``gradient_accumulation_steps`` making up the step's batch: TRL then generates the
    whole batch once a step (``steps_per_generation`` follows the accumulation) and
    takes one optimizer step on it, in micro-batches, as its docs advise when a batch
    does not fit in memory; None: the whole batch in one forward."""
    from trl import GRPOConfig

    batch = s["group_size"] * s["groups_per_step"]
    micro = batch if micro_batch is None else int(micro_batch)
    if batch % micro:
        raise ValueError(f"trl_config: micro_batch={micro} must divide the batch ({batch})")
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False,
        learning_rate=s["lr"], lr_scheduler_type="constant", adam_beta2=0.99, weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"], beta=0.0, epsilon=s["clip_eps"], loss_type="dapo",
        scale_rewards="group", num_iterations=1,
        num_generations=s["group_size"], per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, max_steps=s["steps"],
        shuffle_dataset=False,
        temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"max_new_tokens": task.max_new_tokens},
        max_tool_calling_iterations=task.max_turns, max_completion_length=256,
        seed=s["seed"], logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
    )


def save_snapshot(model, model_dir: str, path: str) -> str:
    """The policy as a model folder rollart can evaluate: the weights, and the tokenizer
    files of ``model_dir`` as they are (the word-level tokenizer, no chat template)."""
    import shutil
    from pathlib import Path

    model.save_pretrained(path)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, Path(path) / f.name)
    return path


def run_trl(model_dir: str, s: dict, task_name: str, faults, seeds: list[int], out_dir: str,
            threads: int) -> tuple[list[dict], list[tuple]]:
    """Train with TRL's GRPOTrainer on ``task_name`` (its envs inject ``faults``) with
    ``vs_trl.Settings`` ``s`` (as a dict), one group per seed (``train_with_trl``)."""
    task = get_task(task_name)
    prompt = [{"role": "user", "content": ""}]
    return train_with_trl(model_dir, s, task, prompt, seeds, out_dir, threads,
                          tokenizer_for(model_dir, s.get("conversation", "raw")),
                          env_class(task, faults), trl_config(s, task, out_dir))


def train_with_trl(model_dir: str, s: dict, task, prompt: list[dict], seeds: list[int],
                   out_dir: str, threads: int, tokenizer, environment, config,
                   peft_config=None) -> tuple[list[dict], list[tuple]]:
    """Train with TRL's GRPOTrainer from ``prompt`` (the dataset's messages; the env's
    first observation is appended to the last), one group per seed, with ``config``.
    Returns one row per optimizer step with rollart's metric names, and the policy
    snapshots saved every ``s["eval_every"]`` steps and at the last, as ``(step, time,
    folder)`` (the save is inside the timed window, as rollart's checkpoints are)."""
    import os
    import time
    import warnings

    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from rollart.model import load_model

    batch = s["group_size"] * s["groups_per_step"]
    data = Dataset.from_dict({"prompt": [prompt] * len(seeds), "seed": seeds})
    rows: list[dict] = []
    snaps: list[tuple] = []

    class Rows(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0, self.tokens = time.time(), 0.0

        def on_step_end(self, args, state, control, model=None, **kw):
            step = state.global_step
            if step % s["eval_every"] == 0 or step == s["steps"]:
                path = save_snapshot(model, model_dir, f"{out_dir}/snap/step-{step:06d}")
                snaps.append((step, time.time() - self.t0, path))

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return  # the end-of-training summary
            self.tokens += logs["completions/mean_length"] * batch
            rows.append({"step": state.global_step, "time": time.time() - self.t0,
                         "reward/mean": logs["reward"],
                         "rollout/tokens_generated": self.tokens})

    trainer = GRPOTrainer(
        model=load_model(model_dir), args=config, train_dataset=data,
        processing_class=tokenizer, environment_factory=environment, callbacks=[Rows()],
        peft_config=peft_config)
    trainer.remove_callback(PrinterCallback)  # our own one line per run instead
    trainer.train()
    return rows, snaps
