"""``graphs/real.py``'s multi-turn task as Hugging Face TRL sees it, on the real model
(SmolLM2-135M-Instruct): the TRL side of ``benchmarks/vs_trl_real.py``.

TRL's recommended set-up for a multi-turn task is ``GRPOTrainer``'s
``environment_factory``: the model's reply is parsed into a tool call, the environment
method of that name runs, its return value is appended as a ``tool`` message, and the
model replies again until a reply carries no tool call. SmolLM2's ChatML template has
no tool syntax and TRL ships no response parser for it (``add_response_schema`` refuses
an unknown template), so, as TRL's docs ask for such a model, this module sets both:

* ``GAME_TEMPLATE`` is SmolLM2's own template (system, user and assistant turns rendered
  byte for byte as SmolLM2 renders them) in which the game's one tool, ``act``, is
  invisible: a call renders as the reply's text in the assistant turn, and the tool's
  answer as a ``user`` turn. Rollart renders ``guess_number`` exactly so (its env's
  replies are user turns), so both trainers see the same token sequences, prompts
  included (the system prompt is the task's);
* ``GameTokenizer.parse_response`` makes every reply an ``act`` call while the game is
  on, and a closing message once the last user turn ended it (``Correct, it was …`` or
  ``No guesses left.``): TRL always asks the model once more after the last env step,
  and those few tokens are part of its batch, as with the toy (``_trl_env``).

The env (``_trl_env.GameEnv``) wraps the rollart env and owns the reward
(``get_reward``: the task's own reward function on the episode). ``run_trl`` trains
with TRL (imported there only) with LoRA through TRL's ``peft_config`` (the same rank,
alpha and target layers as rollart's ``LoRA``) or every weight, one group per forward
and the step's groups accumulated into one optimizer step (``trl_config``'s
``micro_batch``).
"""

from __future__ import annotations

from _trl_env import (ASSISTANT_TURN, ChatGameTokenizer, GameEnv, train_with_trl,
                      trl_config)

GAME_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.first and messages[0].role != 'system' -%}"
    "{{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' -}}"
    "{%- endif -%}" + ASSISTANT_TURN +
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

#: the env's last texts: a turn that starts with or contains one of these ended the game
GAME_OVER = ("Correct, it was", "No guesses left.")


class GameTokenizer(ChatGameTokenizer):
    """The real model's byte-level BPE tokenizer (its ids as rollart loads them) with
    ``GAME_TEMPLATE``; a reply is an ``act`` call until a turn ended the game."""

    template = GAME_TEMPLATE

    @staticmethod
    def game_on(last: str) -> bool:
        return not any(marker in last for marker in GAME_OVER)


def env_class(task) -> type[GameEnv]:
    """A ``GameEnv`` subclass playing ``task`` (a ``Task`` object, e.g. from
    ``graphs/real.py``): pass the class as TRL's ``environment_factory``."""
    return type(f"{task.name.title().replace('_', '')}Env", (GameEnv,), {"task": task})


def run_trl(model_dir: str, s: dict, task, seeds: list[int], out_dir: str,
            threads: int) -> tuple[list[dict], list[tuple]]:
    """Train with TRL's ``GRPOTrainer`` on ``task`` with ``vs_trl_real.Settings`` ``s`` (a
    dict), one group per seed in ``seeds`` (the order rollart draws them), LoRA through
    TRL's ``peft_config`` when ``s["lora_rank"]``: ``_trl_env.train_with_trl``."""
    # one group per forward, the step's groups accumulated: the same 32 completions an
    # optimizer step, generated once a step. The whole batch in one forward (as the
    # toy's side runs) took TRL's process past 20 GB on this 24 GB machine and the
    # kernel killed it (the real model's 49,152-token vocabulary, fp32 logits of every
    # completion at once)
    config = trl_config(s, task, out_dir, micro_batch=s["group_size"])
    config.scale_rewards = s["scale_rewards"]  # rollart's GRPO.scale_rewards
    config.max_completion_length = s["max_completion_length"]
    peft = None
    if s.get("lora_rank"):
        from peft import LoraConfig

        peft = LoraConfig(r=s["lora_rank"], lora_alpha=2 * s["lora_rank"], lora_dropout=0.0,
                          target_modules="all-linear", task_type="CAUSAL_LM")
    prompt = [{"role": "system", "content": task.system_prompt}, {"role": "user", "content": ""}]
    return train_with_trl(model_dir, s, task, prompt, seeds, out_dir, threads,
                          GameTokenizer.from_model_folder(model_dir), env_class(task),
                          config, peft)
