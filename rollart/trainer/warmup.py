"""Supervised warm-up before RL: the built-in tiny model's format warm-up, or a pretrained
model's demonstrations (``Policy.warmup_pretrained``: loss on its own turns only).

A randomly initialised tiny model cannot emit valid actions, so RL would have no signal.
The warm-up plays each task with its ``warmup_action`` — a *uniformly random valid*
action — and trains the model to imitate those actions. It learns the format (which words
are actions), not good play: its success rate is the random policy's, the baseline that
RL must beat. Consumes ``Task`` s and a tokenizer; produces padded token batches in
the rollout's own conversation format (``rollart.chat.conversation``: raw text or the
chat template, so a chat model learns the chat format). Episodes are bounded by the
context budget (a huge observation is cut before it is encoded); an env that raises or
returns the wrong types stops the warm-up with a ``WarmupEnvError`` naming the task and
the method. Called by the trainer actor before RL starts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from concurrent.futures import Executor, ThreadPoolExecutor

import torch

from rollart.chat.conversation import ConversationFormat, TokenLog
from rollart.chaos.faults import without_faults
from rollart.env.protocol import (EnvOutputError, check_observation, check_step_result,
                                  check_tool_result, env_tools)
from rollart.chat.tool_formats import tool_format_of
from rollart.chat.tools import ToolCall, check_calls, format_tool_call, tool_calls
from rollart.trainer.losses import target_logprobs

logger = logging.getLogger(__name__)


class WarmupEnvError(RuntimeError):
    """A task's env failed while the warm-up played it (names the task and the method)."""


def play_random(task, tokenizer, seed: int, rng: random.Random,
                fmt: ConversationFormat | None = None,
                counts: dict | None = None, declare_tools: bool = True) -> TokenLog:
    """One episode of ``task`` under its random valid-action policy, as token ids in the
    conversation format ``fmt`` (default: ``"auto"`` for ``tokenizer``, 2048 tokens).
    ``declare_tools=False`` leaves the env's tools out of the template (no tool list
    before the first observation) and still runs the calls the episode makes.

    An episode that outgrows the context budget stops there (``counts["truncated"]``
    counts it); an env that raises or returns the wrong types raises ``WarmupEnvError``.
    """
    if task.warmup_action is None:
        raise ValueError(f"task {task.name!r} has no warmup_action; give the graph a model "
                         "folder (Policy.model) or set Policy.warmup_steps=0")
    fmt = fmt or ConversationFormat(tokenizer)
    env = _env_call(task, "env_factory", without_faults(task).env_factory)
    log = TokenLog()
    try:
        obs = check_observation(_env_call(task, "reset", env.reset, seed), env)
        tools = env_tools(env) if fmt.mode == "chat" else []
        conv = fmt.start(log, task, obs, tools if declare_tools else [])
        for _ in range(task.max_turns):
            if conv.truncated or not conv.room(task.max_new_tokens):
                if counts is not None:
                    counts["truncated"] = counts.get("truncated", 0) + 1
                break
            action = task.warmup_action(rng, obs)
            if tools:
                action = in_family(action, tool_format_of(fmt, task), tools)
            text = conv.add_text_generation(action)
            calls = tool_calls(text, tool_format_of(fmt, task), tools) if tools else []
            if calls:  # a tool turn, as rollout plays it: results come back as messages
                results = _run_tools(task, env, tools, calls)
                conv.add_tool_results(results)
                obs = "\n".join(results)
                continue
            step = check_step_result(_env_call(task, "step", env.step,
                                                task.parse_action(action)), env)
            if step.done:
                break
            obs = step.observation
            conv.add_user(obs)
    except EnvOutputError as e:
        raise WarmupEnvError(f"warm-up of task {task.name!r}: {e}; fix the env, or set "
                             "Policy.warmup_steps=0 to skip the warm-up") from None
    finally:
        _close_quietly(env)
    return log


def in_family(action: str, family: str, tools) -> str:
    """A demonstration's tool calls in the model family's tool format: ``warmup_action``
    writes them as ``hermes`` (``format_tool_call(..., "hermes")``), which a Mistral or
    Llama model does not write. Text without a hermes call is left as it is.

    >>> in_family('<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>',
    ...           "mistral", [])
    '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]'
    """
    if family == "hermes":
        return action
    calls = [c for c in tool_calls(action, "hermes", tools) if isinstance(c, ToolCall)]
    if not calls:
        return action
    return "".join(format_tool_call(c.name, c.arguments, family) for c in calls)


def _run_tools(task, env, tools, calls) -> list[str]:
    results = []
    for checked in check_calls(calls, tools):
        if isinstance(checked, str):
            results.append(checked)
        else:
            out = _env_call(task, "call_tool", env.call_tool, checked.name, checked.arguments)
            results.append(check_tool_result(out, env, checked.name))
    return results


def _env_call(task, method: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - named and re-raised
        raise WarmupEnvError(
            f"warm-up of task {task.name!r}: env {method} raised {type(e).__name__}: "
            f"{str(e)[:500]}; fix the env, or set Policy.warmup_steps=0 to skip the "
            "warm-up") from e


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - closing is best effort
        pass


def warmup_batch(tasks, tokenizer, batch_size: int, rng: random.Random,
                 fmt: ConversationFormat | None = None, counts: dict | None = None,
                 declare_tools: bool = True, pool: Executor | None = None):
    """``(input_ids, attention_mask, loss_mask)`` for ``batch_size`` random episodes.

    Without ``pool`` the episodes are played one after another, all drawing from ``rng``
    (the stream of earlier releases). With ``pool``, ``rng`` draws each episode's task,
    env seed and action seed, in order, and the episodes are played on the pool's threads,
    each with its own ``random.Random``: the same batch for any number of threads.
    """
    fmt = fmt or ConversationFormat(tokenizer)
    if pool is None:
        logs = []
        for _ in range(batch_size):
            task = rng.choice(tasks)
            logs.append(play_random(task, tokenizer, rng.randrange(1_000_000, 2_000_000),
                                    rng, fmt, counts, declare_tools))
        return pad_logs(logs, tokenizer.pad_token_id)
    specs = [(rng.choice(tasks), rng.randrange(1_000_000, 2_000_000), rng.getrandbits(64))
             for _ in range(batch_size)]

    def play(spec):
        task, seed, action_seed = spec
        mine: dict = {}
        log = play_random(task, tokenizer, seed, random.Random(action_seed), fmt, mine,
                          declare_tools)
        return log, mine.get("truncated", 0)

    played = list(pool.map(play, specs))
    if counts is not None:
        cut = sum(n for _, n in played)
        if cut:
            counts["truncated"] = counts.get("truncated", 0) + cut
    return pad_logs([log for log, _ in played], tokenizer.pad_token_id)


def tool_tasks(tasks) -> list:
    """The tasks whose env declares tools (one env of each is made and closed)."""
    out = []
    for task in tasks:
        env = _env_call(task, "env_factory", without_faults(task).env_factory)
        try:
            if env_tools(env):
                out.append(task)
        finally:
            _close_quietly(env)
    return out


def pad_logs(logs, pad_id: int):
    """Right-pad token logs; ``loss_mask[b, t]`` marks tokens the policy generated."""
    length = max(len(l.ids) for l in logs)
    ids = torch.full((len(logs), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(logs), length), dtype=torch.long)
    mask = torch.zeros((len(logs), length), dtype=torch.float32)
    for i, l in enumerate(logs):
        n, p = len(l.ids), len(l.prompt_ids)
        ids[i, :n] = torch.tensor(l.ids)
        attn[i, :n] = 1
        mask[i, p:n] = torch.tensor(l.loss_mask, dtype=torch.float32)
    return ids, attn, mask


def run_warmup(model, tokenizer, tasks, *, steps: int, batch_size: int, lr: float,
               seed: int = 0, obs_weight: float = 1.0, conversation: str = "auto",
               system_prompt: str | None = None, max_context: int | None = None,
               bare_tool_steps: int = 0, episode_threads: int | None = None,
               on_step=None, stop=None) -> list[float]:
    """Supervised steps on random valid actions; returns the loss curve (``on_step(n)``
    after each step: the trainer's progress counter). ``stop`` (a ``threading.Event``,
    set from another thread) ends the warm-up after the step in progress.

    Episodes are rendered in the rollout's conversation format (``conversation``,
    ``system_prompt``: ``rollart.chat.conversation``), within ``max_context`` tokens (the
    model config's ``max_position_embeddings`` by default).

    ``bare_tool_steps`` (``Policy.warmup_bare_tool_steps``; chat format only) come first:
    steps on the tasks whose env declares tools, alone, rendered without the tool list
    (the observation right before the model's call instead of after a long system turn)
    and with the loss on the model's turns only; then ``steps`` on every task, as
    rollout renders them. The chat toy learns to copy an observation into its tool call
    in the short context and keeps the copy in the long one, where 150 steps of the
    second stage alone did not teach it (docs/benchmarks/chat-graph.md and calc-copy.md).
    Each stage has its own optimizer.

    ``episode_threads`` (``Policy.warmup_episode_threads``): batches are played ahead on
    that many threads while the model computes the step before (env steps and tool calls,
    such as calc's sandboxed ``python`` subprocess, wait outside the GIL), one batch ahead;
    the batches do not depend on the thread count (``warmup_batch``). ``None``: each batch
    is played in its step, one episode after another (another episode stream).
    """
    # an HF model's config, or the HF config a Megatron GPTModel was built from
    config = getattr(model, "config", None) or getattr(model, "hf_config", None)
    budget = max_context or int(getattr(config, "max_position_embeddings", 0) or 2048)
    fmt = ConversationFormat(tokenizer, conversation, system_prompt=system_prompt,
                             max_context=budget,
                             model_path=getattr(config, "_name_or_path", None))
    stages = []
    if bare_tool_steps:
        if fmt.mode != "chat":
            raise ValueError(f"Policy.warmup_bare_tool_steps={bare_tool_steps} needs the "
                             f"chat format (tools reach the model through its chat "
                             f"template), but the conversation is {fmt.mode!r}: set it to 0")
        bare = tool_tasks(tasks)
        if not bare:
            raise ValueError(f"Policy.warmup_bare_tool_steps={bare_tool_steps}, but no "
                             f"task's env declares tools ({', '.join(t.name for t in tasks)}"
                             "): set it to 0")
        stages.append((bare, bare_tool_steps, 0.0, False, seed + 1))
    stages.append((list(tasks), steps, obs_weight, True, seed))
    counts: dict = {}
    losses: list[float] = []
    model.train()
    with contextlib.ExitStack() as stack:
        episodes = ahead = None
        if episode_threads is not None:
            episodes = stack.enter_context(
                ThreadPoolExecutor(episode_threads, "rollart-warmup-episode"))
            ahead = stack.enter_context(ThreadPoolExecutor(1, "rollart-warmup-batch"))
        for stage_tasks, n_steps, weight, declare, stage_seed in stages:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            make = functools.partial(warmup_batch, stage_tasks, tokenizer, batch_size,
                                     random.Random(stage_seed), fmt, counts, declare,
                                     pool=episodes)
            for ids, attn, mask in _batches(make, n_steps, ahead):
                losses.append(_step(model, opt, ids, attn, mask, weight))
                if on_step is not None:
                    on_step(len(losses))
                if stop is not None and stop.is_set():
                    break
            if stop is not None and stop.is_set():
                logger.warning("warm-up stopped after %d steps: the run was asked to stop",
                               len(losses))
                break
    model.eval()
    if counts.get("truncated"):
        logger.warning("warm-up: %d episodes cut at the context budget of %d tokens",
                       counts["truncated"], budget)
    return losses


def _batches(make, n: int, ahead: Executor | None):
    """``n`` batches of ``make()``; with ``ahead``, each is made there while the caller
    uses the one before (one in flight at a time, so the stage's rng is drawn in order)."""
    if ahead is None:
        for _ in range(n):
            yield make()
        return
    upcoming = ahead.submit(make) if n else None
    for i in range(n):
        batch = upcoming.result()
        upcoming = ahead.submit(make) if i + 1 < n else None
        yield batch


def _step(model, opt, ids, attn, mask, obs_weight: float) -> float:
    """One supervised step; returns its loss (the batch moves to the model's device)."""
    device = next(model.parameters()).device
    ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
    # Actions carry full weight; every other token (the env's text) is language-modelled
    # too (``obs_weight``), so the model learns to read observations instead of learning
    # that its output may ignore them (the random actions are context-free).
    target_mask = mask[:, 1:] + obs_weight * (attn[:, 1:] - mask[:, 1:]).clamp(min=0)
    nll = -target_logprobs(model, ids, attn, target_mask > 0)
    loss = (nll * target_mask).sum() / target_mask.sum().clamp(min=1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()
