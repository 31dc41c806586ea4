"""Does the chat toy's format warm-up learn to copy calc's question into its tool call?

``graphs/chat.py``'s ``calc`` pays off only when the model's first call holds the
question (``what is 4 - 6 ?`` -> ``{"code": "4 - 6"}``): the warm-up demonstrates that on
every episode (``calc_hermes_warmup_action``), and RL has nothing to reinforce until the
model does it. This script builds the chat toy as ``rollart train graphs/chat.py`` does
(``chat_corpus`` of the graph's tasks, ``build_tiny_model(..., chat=True)``), runs
rollart's own ``run_warmup`` on it and, every ``--every`` steps, samples the first turn
of ``--probes`` unseen calc episodes (temperature 1, as the held-out evaluation): how many
turns call the tool, how many calls hold the whole question, and how many hold each of
its three words in place (chance: ~1/9 per digit, 1/3 for the operator). No cluster.
Ends with one line

    RESULT steps=… calls=… copies=… digit1=… op=… digit2=… answers=… probes=…

(the last checkpoint's counts; ``answers``: after the right call and the tool's result,
the turn that answers with that result, RL's second copy).

``--echo`` asks the simpler question first: can the toy learn to copy at all? It warms up
on ``echo`` alone, a task defined here (``echo : say 4 * right . act :`` -> ``4 *
right``: 2-4 words drawn from the four tasks' digits, operators and directions), and
counts the probes' exact repeats; it ends with ``RESULT steps=… echoes=… probes=…``.
``--no-tools`` asks whether the context's length is what holds the copy back: calc with
its tool undeclared, so the template writes no system turn and the question sits ~30
tokens into the context instead of ~250 (the calls are still demonstrated and scored the
same; the env, seeing no declared tool, answers them with an error, so only the first
turn, the one probed, is as in the graph). ``--also-bare`` keeps calc as the graph has it
(probed) and adds that bare calc to the warm-up's tasks: does a copy learned in the short
context carry over to the long one, when both are in every batch? ``--bare-first N`` is a
curriculum: N steps on that bare calc alone first (``--bare-obs-weight``: its own
``obs_weight``), then ``--steps`` as asked (the probe, always the real calc, counts N +
the steps). ``--bare-tool-steps N`` is rollart's own version of that first stage
(``Policy.warmup_bare_tool_steps``, as ``graphs/chat.py`` sets it: the calls run and
answered, ``obs_weight`` 0). ``--lr`` varies the warm-up's learning rate;
``--layers``, ``--heads`` and ``--hidden`` the toy's depth, attention heads and width.

    python benchmarks/calc_copy.py --quick                      # 20 steps, 16 probes
    python benchmarks/calc_copy.py --steps 300                  # the graph's four tasks
    python benchmarks/calc_copy.py --steps 300 --only calc --obs-weight 0
    python benchmarks/calc_copy.py --echo --steps 450 --lr 1e-3   # a pure copy task
    python benchmarks/calc_copy.py --only calc --obs-weight 0 --lr 1e-3 --bare-first 200
    python benchmarks/calc_copy.py --steps 150 --lr 1e-3 --bare-tool-steps 200  # the graph's
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _results.py

from _results import Run, add_arguments  # noqa: E402

#: what a probe counts, in the order it prints them
KEYS = ("calls", "copies", "digit1", "op", "digit2", "answers")
#: what the echo task's observations draw from: the four tasks' digits, operators, moves
ECHO_WORDS = (*"123456789", "+", "-", "*", "left", "right", "up", "down")


class EchoEnv:
    """``echo : say <2-4 words> . act :``; one turn, success when the words come back."""

    def reset(self, seed: int) -> str:
        import random

        rng = random.Random(seed)
        self.words = " ".join(rng.choice(ECHO_WORDS) for _ in range(rng.randint(2, 4)))
        return f"echo : say {self.words} . act :"

    def step(self, action: str):
        from rollart.types import StepResult

        right = action.strip() == self.words
        return StepResult("echo : done .", float(right), True, {"success": right})

    def close(self) -> None:
        pass


def bare_calc_task(task):
    """``task`` (calc) with its env's tool undeclared (``--no-tools``)."""
    from functools import partial

    from rollart.env.adapters.tool import CalcToolEnv

    class BareCalcEnv(CalcToolEnv):
        tools = ()  # shadows CalcToolEnv.tools: no tools= for the template

    return replace(task, env_factory=partial(BareCalcEnv, max_turns=task.max_turns,
                                             name=task.name))


def echo_action(rng, observation: str) -> str:
    """The demonstration: the words between ``say`` and ``.``."""
    words = observation.split()
    return " ".join(words[words.index("say") + 1:words.index(".")])


def echo_task():
    from rollart.env.tasks import Task
    from rollart.reward.functions import env_return

    return Task(name="echo", env_factory=EchoEnv, reward_fn=env_return, max_turns=1,
                max_new_tokens=12, warmup_action=echo_action)


def score(text: str, question: str) -> dict:
    """What one generated turn ``text`` got of ``question`` (``"4 - 6"``): a tool call, the
    whole question as its ``code``, and each of the question's three words in place
    (``code`` is read as written, also from a call the env would reject as malformed)."""
    from rollart.chat.tools import has_tool_call

    code = re.search(r'"code": "([^"]*)"', text)
    words = (code.group(1).split() if code else []) + ["", "", ""]
    hits = {"calls": has_tool_call(text),
            "copies": code is not None and code.group(1).strip() == question}
    for name, want, got in zip(("digit1", "op", "digit2"), question.split(), words):
        hits[name] = want == got
    return hits


def probe(model, tok, fmt, task, seeds) -> dict:
    """First turns of ``task`` on ``seeds``: counts of calls, whole and partial copies of
    calc's question, or (``task`` echo) of exact repeats. ``answers``: the turn after a
    right call and its result (the demonstrated call, the tool's real output), counted
    when it is ``answer <that result>``."""
    import torch

    from rollart.env.adapters.tool import _question
    from rollart.chat.conversation import TokenLog
    from rollart.env.protocol import env_tools
    from rollart.chat.tools import format_tool_call

    def sample(ids):
        ids = torch.tensor([ids])
        out = model.generate(ids, max_new_tokens=task.max_new_tokens, do_sample=True,
                             top_p=1.0, temperature=1.0, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.size(1):], skip_special_tokens=True)

    counts = dict.fromkeys(("echoes",) if task.name == "echo" else KEYS, 0)
    model.eval()
    with torch.no_grad():
        for seed in seeds:
            env = task.env_factory()
            obs = env.reset(seed)
            question = env.words if task.name == "echo" else _question(obs)
            conv = fmt.start(TokenLog(), task, obs, env_tools(env))
            text = sample(conv.log.ids)
            if task.name == "echo":
                counts["echoes"] += text.strip() == question
            else:
                for name, hit in score(text, question).items():
                    counts[name] += hit
                conv.add_text_generation(format_tool_call("python", {"code": question}))
                result = env.call_tool("python", {"code": question})
                conv.add_tool_results([result])
                counts["answers"] += sample(conv.log.ids).strip() == f"answer {result}"
            env.close()
    model.train()
    return counts


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="20 warm-up steps, 16 probes")
    p.add_argument("--steps", type=int, default=None, help="warm-up steps (default 300)")
    p.add_argument("--every", type=int, default=None, help="probe every N steps")
    p.add_argument("--probes", type=int, default=None, help="calc episodes a probe samples")
    p.add_argument("--only", default=None, help="warm up on these tasks only (e.g. calc)")
    p.add_argument("--obs-weight", type=float, default=1.0,
                   help="run_warmup's obs_weight (0: loss on the model's turns only)")
    p.add_argument("--echo", action="store_true",
                   help="warm up on the echo task alone and count its exact repeats")
    p.add_argument("--no-tools", action="store_true",
                   help="calc with its tool undeclared: no system turn (a short context)")
    p.add_argument("--also-bare", action="store_true",
                   help="warm up on calc with and without its tool declared; probe calc")
    p.add_argument("--bare-first", type=int, default=0, metavar="N",
                   help="a curriculum: N warm-up steps on calc with its tool undeclared "
                        "first (the question near the call), then --steps as asked")
    p.add_argument("--bare-obs-weight", type=float, default=None,
                   help="--bare-first's obs_weight (default: --obs-weight)")
    p.add_argument("--bare-tool-steps", type=int, default=0, metavar="N",
                   help="rollart's own first stage (Policy.warmup_bare_tool_steps): N steps "
                        "on calc, tool undeclared, obs_weight 0, inside run_warmup")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2, help="the toy's layers (graph: 2)")
    p.add_argument("--heads", type=int, default=4, help="the toy's attention heads (graph: 4)")
    p.add_argument("--hidden", type=int, default=128, help="the toy's width (graph: 128)")
    p.add_argument("--seed", type=int, default=0)
    add_arguments(p)
    a = p.parse_args(argv)
    run = Run("calc_copy", a, argv)
    steps = a.steps or (20 if a.quick else 300)
    every = a.every or (10 if a.quick else 50)
    n_probes = a.probes or (16 if a.quick else 64)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graphs.chat import tasks as chat_tasks
    from rollart.chat.conversation import ConversationFormat
    from rollart.corpus import chat_corpus
    from rollart.model import build_tiny_model
    from rollart.trainer.warmup import run_warmup

    torch.manual_seed(a.seed)
    tasks = tuple(bare_calc_task(t) if a.no_tools and t.name == "calc" else t
                  for t in chat_tasks()) + ((echo_task(),) if a.echo else ())
    if a.also_bare:
        calc = next(t for t in tasks if t.name == "calc")
        tasks += (replace(bare_calc_task(calc), name="calc-bare"),)
    probed = tasks[-1] if a.echo else next(t for t in tasks if t.name == "calc")
    trained = [probed] if a.echo else [t for t in tasks if a.only is None
                                        or t.name.split("-")[0] in a.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        # the toy's BPE from the graph's tasks (and echo's), as the graph builds it
        corpus = chat_corpus([t for t in tasks if t.name != "calc-bare"])
        path = build_tiny_model(tmp, corpus, chat=True, seed=a.seed,
                                num_layers=a.layers, num_heads=a.heads,
                                hidden_size=a.hidden)
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
    fmt = ConversationFormat(tok, "chat", max_context=2048)
    seeds = range(5_000_000, 5_000_000 + n_probes)  # not among the warm-up's seeds
    t0, last = time.time(), {}

    total = a.bare_first + a.bare_tool_steps + steps

    def on_step(n, offset=a.bare_first):
        n += offset
        if n % every == 0 or n == total:
            counts = probe(model, tok, fmt, probed, seeds)
            last.update(counts, steps=n)
            print(f"step {n:4d}  " + "  ".join(f"{k} {v}/{n_probes}" for k, v in counts.items())
                  + f"  ({time.time() - t0:.0f} s)", flush=True)

    if a.bare_first:  # the curriculum's first stage: the short context only
        bare = [replace(bare_calc_task(t), name="calc-bare") for t in trained
                if t.name == "calc"]
        if not bare:
            p.error("--bare-first needs calc among the warmed-up tasks")
        first_w = a.obs_weight if a.bare_obs_weight is None else a.bare_obs_weight
        run_warmup(model, tok, bare, steps=a.bare_first, batch_size=32, lr=a.lr,
                   seed=a.seed + 1, obs_weight=first_w, conversation="chat",
                   on_step=lambda n: on_step(n, offset=0))
    run_warmup(model, tok, trained, steps=steps, batch_size=32, lr=a.lr, seed=a.seed,
               obs_weight=a.obs_weight, conversation="chat", on_step=on_step,
               bare_tool_steps=a.bare_tool_steps)
    figures = dict(last, probes=n_probes)
    keys = ("echoes",) if a.echo else KEYS
    run.result({k: figures[k] for k in ("steps", *keys, "probes")})
    return figures


if __name__ == "__main__":
    main()
