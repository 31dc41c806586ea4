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

Nothing here imports trl; the module only needs transformers and rollart.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from rollart.env.faults import Faults, with_faults
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
