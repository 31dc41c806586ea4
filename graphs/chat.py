"""The chat graph: the three built-in games and a tool-calling task, in chat format.

Like the default graph, but every trajectory is a chat conversation rendered by the
tokenizer's template (``Policy(conversation="chat")``, ``rollart.chat.conversation``):
each observation a ``user`` message, each generation the ``assistant`` message ending
with its end-of-turn token. The fourth task, ``calc``, declares a sandboxed ``python``
tool: the model writes its call in its family's format, detected from its chat template
(``rollart.chat.tool_formats``; the chat toy's is Hermes, ``<tool_call>{"name":
"python", "arguments": {"code": ...}}</tool_call>``), the runner runs it and the result comes back as a ``tool`` message
(masked out of the loss); the final ``answer <n>`` goes to the env.

With ``Policy(model=None)`` the built-in model is the chat toy
(``build_tiny_model(..., chat=True)``: a byte-level BPE trained on these tasks' text by
``rollart.corpus.chat_corpus``, ChatML template with tools), after a format warm-up
in chat form. Its BPE keeps a word apart from the space before it
(``rollart.model.CHAT_SPLIT``), so an observation's ``right`` is the same token as the
assistant's action ``right``, as in the raw graph's word-level toy (with Qwen2's split
they were two unrelated ids, `` right`` and ``right``). Point ``Policy.model`` (or
``--model``) at any Hugging Face chat folder to train that instead; ``warmup_steps``
then does not apply.

How each task is shaped (the tasks are the built-in ones, unchanged; only the format is
chat): ``gridnav`` (5x5 grid, goal 2-3 steps away, 8 turns: a random walker wins ~20%,
copying a direction word from the observation always wins), ``guess`` (a number in 1..9
with higher/lower feedback and the candidates left, 4 turns: random ~38%), ``boxpush``
(1-D corridor, 6 turns: random ~25%, copying the direction always wins) — each a user
message per observation and one action word per assistant turn (one BPE token + the
end-of-turn token, ``GAME_TOKENS`` of room). ``calc`` (``a op b`` with one-digit
operands, 3 turns): the system turn declares the ``python`` tool (~219 toy tokens); a
right answer needs a well-formed call that copies the question into ``code`` and then
``answer <result>``; the warm-up always calls the tool first and then answers with a
number it sees half the time, so its baseline is half of what its calls get right and RL
gains by copying the tool's result. Measured: after the 150 mixed warm-up steps alone
the chat toy copies neither (the question into ``code``, the result into the answer),
and its groups, whose rewards then differ mostly by invalid-call penalties, carry ~44%
of the trained tokens (docs/benchmarks/chat-graph.md); what this graph adds for it is
below.

The warm-up runs at ``WARMUP_LR`` (1e-3), not the raw graph's 3e-3: at 3e-3 the chat toy
barely learns to copy from its context (``benchmarks/calc_copy.py --echo``, a pure
"repeat these words" task, seed 0, 450 steps: 0-1 exact repeats of 64 at 3e-3, 23-57
at 1e-3; at 3e-3 it writes how many words but not which), and RL
then learns priors instead of reading the observation (docs/benchmarks/chat-graph.md:
3-seed held-out gains at 3e-3 gridnav +0.16, guess +0.08, boxpush +0.22; the table there
has them at 1e-3). ``calc`` needed two more things, both measured on three seeds
(docs/benchmarks/chat-graph.md). First, the copy of the question into the call: 150 mixed
warm-up steps do not teach it (0 of 64 calls hold the question on each of seeds 0-2), because the tool
list's ~219-token system turn sits before the question (with the tool undeclared, calc
alone copies 46 of 64 after 300 steps, with it 0: ``calc_copy.py --no-tools``).
Learned first in that short context, it carries over: ``BARE_TOOL_STEPS``
(``Policy.warmup_bare_tool_steps``: 300 steps on calc alone, tool undeclared, loss on
the model's turns only, 1.2-3 min on 2 cores) before the 150, and the warm-up policy's calls hold
the whole question 49, 55 and 46 times in 64 (seeds 0-2; with 200 steps 53, 26 and
38: ``benchmarks/calc_copy.py --steps 150 --lr 1e-3 --bare-tool-steps N --seed S``).
Second, RL must not drop the tool for its penalties: with GRPO's per-group std, a calc
group whose rewards differ only by a 0.1 invalid-call penalty weighs as much as one with
a success, and RL stopped calling the tool on two seeds of three (200 first-stage
steps: calc's held-out success 0.12 -> 0.02, 0.03 -> 0.02; seed 2: 0.11 -> 0.43); with
``scale_rewards="batch"`` (the batch's std) it keeps calling and learns the copy and the
answer (200 first-stage steps: seeds 0 and 2, 0.12 -> 0.46, 0.11 -> 0.43, not seed 1,
whose warm-up copied least, 0.03 -> 0.06; 300, this graph: 0.21 -> 0.61, 0.09 -> 0.47,
0.12 -> 0.83 on 256 held-out seeds, commit 9ef1c22).

The warm-up and step counts are sized for two shared CPU cores (``quick``: the
slow end-to-end test's shorter run); docs/benchmarks/chat-graph.md has the
measured figures.
"""

from dataclasses import replace

from rollart import GRPO, Graph, LoRA, Policy
from rollart.env.adapters.tool import calc_tool_task
from rollart.env.tasks import BUILTIN_TASKS

#: room for one game action (one BPE token) plus the end-of-turn token, as the raw
#: graph's 4: the warm-up policy's turns are 2 tokens, so a turn that babbles past them is
#: cut early (4 decode steps, not 8) and closed by the template
GAME_TOKENS = 4
#: a python tool call in the Hermes format is ~21 toy tokens
TOOL_TOKENS = 32
#: the format warm-up's learning rate (the raw graph's is Policy's default, 3e-3, at which
#: this toy barely learns to copy from its context: see the module docstring)
WARMUP_LR = 1e-3
#: the warm-up's first stage (Policy.warmup_bare_tool_steps): calc alone with its tool
#: undeclared, loss on the model's turns only, before the 150 steps on every task; it
#: teaches the copy of calc's question into the call (see the module docstring; 200
#: steps left it at 26 calls of 64 holding the question on one seed of three)
BARE_TOOL_STEPS = 300
#: the LoRA variant (``lora``): adapters of rank 16 on every linear layer, trained at ten
#: times full fine-tuning's lr (5e-4), the ratio commonly found best for LoRA in RL and
#: SFT; chosen before any LoRA run of this graph, not tuned on its results
LORA_RANK, LORA_LR = 16, 5e-3


def tasks() -> tuple:
    games = tuple(replace(BUILTIN_TASKS[name], max_new_tokens=GAME_TOKENS)
                  for name in ("gridnav", "guess", "boxpush"))
    # tool_format=None: the model's family, detected from its chat template (hermes for
    # the chat toy; mistral for a Mistral folder), never overridden
    calc = calc_tool_task(max_turns=3, tool_format=None, max_new_tokens=TOOL_TOKENS,
                          top_p=1.0)
    return games + (calc,)


def graph() -> Graph:
    return Graph(
        name="chat",
        tasks=tasks(),
        # the format is learned by ~150 warm-up steps (the tool call's JSON included; the
        # copies are not: 1 call in ~300 holds the question, 1 answer in ~30 the tool's
        # result, where the warm-up's episodes hold them always and half the time)
        policy=Policy(model=None, conversation="chat", warmup_steps=150,
                      warmup_bare_tool_steps=BARE_TOOL_STEPS, warmup_lr=WARMUP_LR,
                      # calc's tool runs a subprocess per call: play the warm-up's episodes
                      # on threads, one batch ahead (the stream every figure since 03caaef
                      # was measured with)
                      warmup_episode_threads=4),
        # advantages over the batch's reward std, not each group's: calc's groups whose
        # rewards differ only by 0.1 invalid-call penalties then weigh a tenth of one with
        # a success, not as much (with "group", RL stopped calling the tool on 2 seeds of 3)
        algo=GRPO(group_size=8, groups_per_step=12, lr=5e-4, kl_coef=0.05,
                  scale_rewards="batch"),
        steps=100,
    )


def quick() -> Graph:
    """A shorter run (the slow end-to-end test): the three games, fewer steps."""
    g = graph()
    return replace(g, name="chat-quick", tasks=g.tasks[:3], steps=60,
                   policy=replace(g.policy, warmup_bare_tool_steps=0))  # no tool task


def lora() -> Graph:
    """The same run training LoRA adapters (``LORA_RANK``, ``LORA_LR``) after the same
    full-weight format warm-up: ``python -m rollart train graphs/chat.py:lora``, or
    ``graphs/chat.py --set policy.lora.rank=16 --set algo.lr=5e-3``."""
    g = graph()
    return replace(g, name="chat-lora", policy=replace(g.policy, lora=LoRA(rank=LORA_RANK)),
                   algo=replace(g.algo, lr=LORA_LR))
