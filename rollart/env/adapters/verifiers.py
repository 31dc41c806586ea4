"""verifiers adapter: a prime-intellect ``verifiers`` (v1) taskset trains as a rollart
``AgentTask``.

Consumes a verifiers taskset — a ``vf.Taskset`` whose ``load()`` yields ``vf.Task``\\ s
(a prompt, the answer, ``@vf.reward`` methods) — or a single-agent ``vf.Env`` (its
``taskset`` is used; a multi-agent env is refused, its ``run()`` would be skipped),
built on the worker by a picklable ``factory`` (a module-level function or class, called
with no arguments). Produces ``verifiers_task(factory, name=...)``: an
``AgentTask`` whose agent plays task ``seed % len(taskset)`` as one verifiers rollout
(``vf.Agent(...).run(task)``: verifiers' interception server, its own client, the
task's setup, scoring and rewards) against the OpenAI-compatible endpoint rollart
serves for the trajectory, and returns a ``rollart.Episode`` whose reward is the
trace's (``trace.reward``: the sum of the task's weighted rewards), with
``info["success"]`` when it reaches ``success_at`` and each named reward in
``info["verifiers_rewards"]``.

The program that talks to the model is ``ChatHarness``: verifiers' built-in harnesses
launch a ``uv`` script in a runtime (installing packages at run time); this one runs the
chat in process (the harness contract allows it: every call goes through verifiers'
interception endpoint) and answers once per segment, without tools: one model call per
rollout (``max_turns=1``). A task whose taskset declares MCP toolsets is refused by
verifiers' pairing check.

Nothing silent: a rollout verifiers marks failed (``trace.ok`` false: a model error, a
task hook or a reward that raised, a time-out) raises ``VerifiersRolloutError`` with
verifiers' own message, so the trajectory fails with it and is counted, never scored 0.
Client settings fit rollart's endpoint: no retries (``max_retries=0``, verifiers'
``retries.max_retries`` 0), no sampling overrides (the endpoint ignores
``temperature``/``top_p``; ``n`` stays 1), the local ``subprocess`` runtime, no network
notice added to the prompt. Needs ``verifiers>=0.4`` (``pip install 'rollart[agents]'``);
this module imports it, so ``rollart.env.adapters`` does not import this module.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Callable

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from rollart.agents.agent import AgentEndpoint, AgentTask
from rollart.types import Episode

__all__ = ["ChatHarness", "VerifiersRolloutError", "load_tasks", "play_verifiers",
           "verifiers_task"]

_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


class VerifiersRolloutError(RuntimeError):
    """A verifiers rollout that failed (its trace's errors, verifiers' messages)."""


# -- the taskset ---------------------------------------------------------------------------
def load_tasks(factory: Callable) -> list:
    """The tasks of the taskset ``factory()`` builds (a ``vf.Taskset`` or a ``vf.Env``),
    loaded once per process and factory."""
    with _CACHE_LOCK:
        if factory not in _CACHE:
            _CACHE[factory] = _tasks_of(factory())
        return _CACHE[factory]


def _tasks_of(built) -> list:
    if isinstance(built, vf.Env) and not isinstance(built, vf.SingleAgentEnv):
        raise TypeError(f"{type(built).__name__} is a multi-agent verifiers Env: rollart "
                        "plays a taskset with one agent and would skip its run() and "
                        "finalize(); return its taskset from the factory if that is meant")
    taskset = built.taskset if isinstance(built, vf.Env) else built
    if not isinstance(taskset, vf.Taskset):
        raise TypeError(f"the verifiers factory returned {type(built).__name__}; it must "
                        "return a verifiers.v1.Taskset (or a verifiers.v1.Env)")
    if not taskset.bounded:
        raise ValueError(f"{type(taskset).__name__} is infinite; bound it in the factory "
                         "(taskset.take(n)) so seed s can play task s % n")
    tasks = list(taskset)
    if not tasks:
        raise ValueError(f"{type(taskset).__name__}.load() yielded no task")
    return tasks


# -- the program that talks to the model ---------------------------------------------------
class ChatHarness(vf.Harness):
    """An in-process chat program: the task's prompt (and system prompt) sent once to
    verifiers' interception endpoint, the reply recorded by verifiers. No tools."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     tool_interception_url=None):
        import openai

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        # verifiers' interception server is on this host (plain http): no CA bundle to
        # load (half the CPU time of a rollout otherwise)
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                                    http_client=openai.DefaultAsyncHttpxClient(verify=False))
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


# -- one episode ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Spec:
    """What the agent needs on the worker (pickles: a module-level factory and numbers)."""

    factory: Callable
    name: str
    success_at: float
    rollout_timeout: float | None


def _agent(endpoint: AgentEndpoint, key_var: str, spec: _Spec):
    """A ``vf.Agent`` on rollart's endpoint, the chat harness in the local runtime."""
    client = vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=key_var)
    config = vf.AgentConfig(
        harness={"id": "null"}, runtime=vf.SubprocessConfig(), model=endpoint.model,
        client=client, network_notice=False,
        timeout={"rollout": spec.rollout_timeout})
    agent = vf.Agent(config)
    # verifiers loads a harness by installed package id; ours lives here, so it replaces
    # the tool-less "null" chat harness the config names (same contract, in process)
    agent.harness = ChatHarness(agent.config.harness)
    return agent


def _failure(trace) -> str:
    errors = "; ".join(f"{e.type}: {e.message}" for e in trace.errors)
    return errors or f"the rollout stopped with {trace.stop_condition!r}"


async def _play(endpoint: AgentEndpoint, seed: int, spec: _Spec):
    tasks = load_tasks(spec.factory)
    task = tasks[seed % len(tasks)]
    # verifiers reads the API key from an environment variable: one per trajectory
    key_var = f"ROLLART_VERIFIERS_KEY_{uuid.uuid4().hex}"
    os.environ[key_var] = endpoint.api_key
    try:
        trace = await _agent(endpoint, key_var, spec).run(task)
    finally:
        os.environ.pop(key_var, None)
    if not trace.ok:
        raise VerifiersRolloutError(f"verifiers rollout of task {spec.name!r} (seed {seed}, "
                                    f"task {task.data.idx}) failed: {_failure(trace)}")
    rewards = {k: (None if r is None else r.value) for k, r in trace.rewards.items()}
    reward = float(trace.reward)
    return Episode(spec.name, seed, [], [], [reward],
                   {"success": reward >= spec.success_at, "verifiers_rewards": rewards},
                   trace.is_truncated)


def play_verifiers(spec: _Spec, endpoint: AgentEndpoint, seed: int) -> Episode:
    """The agent of ``verifiers_task``: one verifiers rollout of task ``seed % n``, on an
    event loop of its own (the env manager runs it on a worker thread)."""
    return asyncio.run(_play(endpoint, seed, spec))


def verifiers_task(factory: Callable, *, name: str, max_turns: int = 1,
                   max_new_tokens: int = 64, success_at: float = 1.0,
                   rollout_timeout: float | None = None, **task_kw) -> AgentTask:
    """A verifiers taskset as a rollart task.

    ``factory()`` (module-level, so it pickles) returns a ``vf.Taskset`` or ``vf.Env``;
    seed ``s`` plays its task ``s % n``. The reward is verifiers' (``trace.reward``);
    ``success_at`` is the reward from which an episode counts as a success.
    ``rollout_timeout`` bounds verifiers' agent stage (seconds). Other keywords go to
    ``AgentTask`` (``reward_fn``, ``tool_format``, ...).
    """
    if not callable(factory):
        raise TypeError(f"verifiers_task {name!r}: factory must be a module-level function "
                        f"or class building the verifiers taskset, got {factory!r}")
    spec = _Spec(factory, name, float(success_at), rollout_timeout)
    task_kw.setdefault("description", f"verifiers taskset of {factory.__name__}()")
    return AgentTask(name=name, agent=partial(play_verifiers, spec), max_turns=max_turns,
                     max_new_tokens=max_new_tokens, **task_kw)
