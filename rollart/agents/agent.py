"""Agents that talk to the policy through an OpenAI-compatible chat endpoint.

A user who already has an agent (a loop written against the ``openai`` client, or a
framework on top of it) trains it as it is: ``AgentTask(name=..., agent=fn,
max_turns=...)`` where ``fn(endpoint, seed)`` gets an ``AgentEndpoint`` (``base_url``,
``api_key``, ``model``: what any OpenAI-compatible client needs) and returns a float
reward or a ``rollart.Episode``. Plain and ``async`` functions both work. The env
managers run an agent task like any env task: one trajectory per call of ``fn``, with
the trajectory time-out, failures contained and counted, redundant members cancelled.

Underneath, each chat completion is token in, token out (``AgentSession``):

* the request's messages (and ``tools``) are rendered by the policy's chat template
  once, at the first call (``Conversation.of_messages``; with ``Task.tools_in_prompt``
  the tool schemas join the system message instead of ``tools=``, as on the env path:
  ``rollart.chat.template_support.agent_opening``); every later call must repeat the
  conversation so far — the earlier request's messages, then the assistant message this
  endpoint returned (as it came back, or replayed with its raw text, or with its tool
  calls alone; arguments compared as JSON values: ``same_turn``) — and only the new
  messages after it are added, as the template's delta (``Conversation.add_messages``):
  ``user``/``tool`` messages, and ``assistant`` messages the agent wrote itself (a
  replayed tool-call exchange), which the policy reads but is not trained on. The ids
  the policy generated are kept verbatim, with their behaviour log-probs and policy
  versions; the loss mask is 1 on them only; requests go through the ``LLMProxy`` like
  any rollout turn, so the staleness protocol (versions, aborts) applies unchanged.
* a request whose history differs from what was returned (an agent that edited or
  summarised its history, dropped a tool call, changed ``tools``: ``continues``) is a
  **new prompt**: the trajectory's ids restart from its render. The trajectory keeps the
  ids of its last prompt and what followed it (what the final answer was generated
  from); the dropped part is counted (``rollout/agent_rewrites``,
  ``rollout/agent_dropped_tokens``), never silently glued on to a context the policy
  did not see.
* a request the chat template can never serve (``tools`` it ignores without
  ``Task.tools_in_prompt``, a role it refuses) is refused (HTTP 400, the message naming
  the fix) and kept as the session's ``fatal``: the trajectory fails with that
  ``ChatTemplateError`` and the run stops with it (``rollart.env.trajectory``,
  ``rollart.control.modes``). ``AgentTask.tools`` declares the tools up front, so the
  start check (``rollart.config.templates``) refuses such a template before a run.
* the assistant text is parsed for tool calls in the task's format
  (``Task.tool_format``, else the one the chat template writes:
  ``rollart.chat.tool_formats``), when the request has ``tools``:
  well-formed calls come back as OpenAI ``tool_calls`` (arguments a JSON string,
  ``finish_reason`` ``"tool_calls"``); a malformed one is counted as an invalid tool
  call and its raw text comes back as ``content``.
* sampling stays the policy's: ``temperature``/``top_p`` of the request are ignored
  (the behaviour log-probs must be the policy's); ``max_tokens`` (or
  ``max_completion_tokens``) can only lower ``Task.max_new_tokens``; ``stop`` adds
  stop strings; ``n`` must be 1. ``stream=True`` is answered as one chunk then
  ``[DONE]``.
* ``max_turns`` bounds the calls: one more is refused (HTTP 400) and the episode is
  truncated; a conversation out of context room is answered with empty content and
  ``finish_reason`` ``"length"`` (truncated too).

The HTTP side is ``rollart.agents.endpoint`` (one server per env manager, a route per
trajectory). Consumed by ``rollart.env.trajectory`` (rollout) and
``rollart.observe.evaluate`` (held-out evaluation, against a local engine).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2 import TemplateError

from rollart.chat.conversation import Conversation, ConversationError, TokenLog, cap_text
from rollart.agents.wire import (AgentError, _internal, _list, _max_tokens, _message,
                                 _stops, _tools, continues, same_turn)
from rollart.chat.template_support import ChatTemplateError, agent_opening
from rollart.env.protocol import EnvOutputError
from rollart.env.tasks import Task, is_agent_task  # noqa: F401 (re-exported)
from rollart.types import Episode, GenRequest

__all__ = ["AgentEndpoint", "AgentError", "AgentSession", "AgentTask", "agent_reward",
           "agent_session", "continues", "is_agent_task", "play", "run_agent", "same_turn"]


@dataclass(frozen=True)
class AgentEndpoint:
    """What an agent needs to reach the policy: ``openai.OpenAI(base_url=e.base_url,
    api_key=e.api_key)`` and ``model=e.model``. ``seed`` is the episode's seed."""

    base_url: str
    api_key: str
    model: str
    seed: int = 0


def agent_reward(ep: Episode) -> float:
    """The reward an agent returned (its float, or its ``Episode``'s env rewards).

    >>> agent_reward(Episode("t", 0, [], [], [0.5, 0.25], {}))
    0.75
    """
    return float(sum(ep.env_rewards))


def _no_env():
    raise TypeError("an AgentTask has no env: its episodes are played by its agent "
                    "through rollart's OpenAI-compatible endpoint")


@dataclass(frozen=True)
class AgentTask(Task):
    """A task played by an agent function against an OpenAI-compatible endpoint.

    ``agent(endpoint, seed)`` (plain or ``async``) returns a float reward or a
    ``rollart.Episode``; ``reward_fn`` (default ``agent_reward``: what it returned)
    scores the episode. ``max_turns`` bounds the agent's chat completion calls.
    ``env_factory`` is not used. ``tools`` (optional) declares the tool schemas the
    agent sends, so the start check sees them (``rollart.config.templates``).

    >>> def fn(endpoint, seed): return 1.0
    >>> AgentTask(name="qa", agent=fn, max_turns=4).max_new_tokens
    256
    """

    env_factory: Callable = _no_env  # not used: the agent is the env
    reward_fn: Callable = agent_reward  # default: the reward the agent returned
    max_turns: int = 8  # the agent's chat completion calls at most
    max_new_tokens: int = 256  # tokens per completion at most
    agent: Callable | None = None  # agent(endpoint, seed) -> float | Episode (plain or async)
    # the OpenAI tool schemas the agent sends, if declared: the start check
    # (rollart.config.templates) then refuses a chat template that ignores them unless
    # tools_in_prompt; undeclared, the first request with tools is checked
    tools: tuple = field(default=(), hash=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(self.agent):
            raise TypeError(f"AgentTask {self.name!r}: agent must be a function "
                            "(endpoint, seed) -> float | rollart.Episode (plain or async, "
                            f"module-level so it pickles), got {type(self.agent).__name__}")
        try:
            tools = _tools(list(self.tools)) or ()
        except (AgentError, TypeError):
            raise TypeError(f"AgentTask {self.name!r}: tools must be a list of OpenAI tool "
                            "schemas {'type': 'function', 'function': {'name', "
                            f"'description', 'parameters'}}, got {self.tools!r:.80}") from None
        object.__setattr__(self, "tools", tuple(tools))


# -- one trajectory's endpoint state -----------------------------------------------------
@dataclass
class _Counts:
    calls: int = 0
    rewrites: int = 0
    dropped_tokens: int = 0
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    truncated: bool = False


@dataclass
class AgentSession:
    """One trajectory's conversation behind the endpoint.

    ``generate(request, call_index)`` is an async function returning a ``GenResult``
    (the runner's ``LLMProxy`` call, or a local engine's in evaluation); ``fmt`` the
    policy's ``ConversationFormat``; ``log`` the trajectory's ``TokenLog`` (refilled in
    place when a rewritten history restarts it); ``parse_calls(text, tools)`` and
    ``strip_calls(text)`` the task's tool-call format's (``rollart.chat.tool_formats``).
    """

    task: Task
    fmt: Any
    log: TokenLog
    generate: Callable
    parse_calls: Callable
    strip_calls: Callable
    model: str = "rollart-policy"
    counts: _Counts = field(default_factory=_Counts)
    conv: Conversation | None = None
    wire: list = field(default_factory=list)  # the conversation as the agent must resend it
    tools: list | None = None
    actions: list = field(default_factory=list)  # the assistant texts, in order
    observations: list = field(default_factory=list)  # the text that reached the policy
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0  # calls being served
    closed: bool = False
    # a request the chat template can never serve (ChatTemplateError): refused, and the
    # trajectory fails with it, which stops the run (rollart.env.trajectory)
    fatal: Exception | None = None
    _serving: set = field(default_factory=set)  # the tasks serving calls now

    async def complete(self, body: dict) -> dict:
        """One chat completion: the OpenAI response dict, or ``AgentError``."""
        if self.closed:
            raise AgentError("this trajectory is over (finished, cancelled or timed out); "
                             "its endpoint takes no more calls", status=410)
        self.busy += 1
        task = asyncio.current_task()
        self._serving.add(task)
        try:
            return await self._complete(body)
        except asyncio.CancelledError:
            if self.closed:  # the trajectory ended under this call: it is refused
                raise AgentError("this trajectory ended during the call", 410) from None
            raise
        finally:
            self._serving.discard(task)
            self.busy -= 1
            self.last_active = time.monotonic()

    def close(self) -> None:
        """No more calls; a call being served is cancelled (its generation aborted)."""
        self.closed = True
        for task in list(self._serving):
            task.cancel()

    async def _complete(self, body: dict) -> dict:
        if not isinstance(body, dict):
            raise AgentError("the request body must be a JSON object")
        if body.get("n", 1) != 1:
            raise AgentError("n must be 1: each call is one sample of the policy")
        if self.counts.calls >= self.task.max_turns:
            self.counts.truncated = True
            raise AgentError(f"task {self.task.name!r}: max_turns={self.task.max_turns} "
                             "chat completion calls reached; the episode is over")
        messages = [_message(m, i) for i, m in enumerate(_list(body, "messages"))]
        if not messages:
            raise AgentError("messages is empty")
        tools = _tools(body.get("tools"))
        self.counts.calls += 1
        self._extend(messages, tools)
        conv = self.conv
        limit = _max_tokens(body, self.task.max_new_tokens)
        if conv.truncated or not conv.room(limit):
            self.counts.truncated = True
            self.wire = messages + [{"role": "assistant", "content": ""}]
            return self._response("", [], "length", 0)
        req = GenRequest(conv.log.ids, limit, stop_ids=self.fmt.stop_ids,
                         stop_strings=tuple(self.task.stop) + _stops(body.get("stop")))
        res = await self.generate(req, self.counts.calls - 1)
        text = conv.add_generation(res.token_ids, res.logprobs, res.versions,
                                   res.finish_reason)
        self.actions.append(text)
        calls, content = self._calls(text) if self.tools else ([], text)
        reply = {"role": "assistant", "content": content, "generated": text}
        if calls:
            reply["tool_calls"] = calls
        self.wire = messages + [reply]
        reason = "tool_calls" if calls else ("length" if res.finish_reason == "length"
                                             else "stop")
        return self._response(content, calls, reason, len(res.token_ids))

    def _extend(self, messages: list[dict], tools) -> None:
        """Add the request's new messages to the conversation, or start a new prompt
        (the rule: ``continues``)."""
        n = len(self.wire)
        if self.conv is not None and continues(messages, tools, self.wire, self.tools):
            new = messages[n:]
            self.observations += [cap_text(m["content"], self.fmt.max_context)
                                  for m in new if m["role"] != "assistant"]
            conv = self.conv
            self._template(lambda: conv.add_messages([_internal(m) for m in new]), messages)
            return
        if self.conv is not None:  # a history the agent rewrote: a new prompt
            self.counts.rewrites += 1
            self.counts.dropped_tokens += sum(self.log.loss_mask)
        self._check_tools(tools)
        self.tools = tools
        self.log.prompt_ids, self.log.response_ids = [], []
        self.log.loss_mask, self.log.logprobs, self.log.versions = [], [], []
        self.observations += [cap_text(m["content"], self.fmt.max_context)
                              for m in messages if m["role"] != "assistant"]  # bounded
        # Task.tools_in_prompt: the tools join the system message, as on the env path
        msgs, shown = agent_opening(self.fmt, self.task, [_internal(m) for m in messages],
                                    tools)
        self.conv = self._template(lambda: Conversation.of_messages(
            self.fmt, self.log, msgs, shown), messages)

    def _check_tools(self, tools) -> None:
        """A request with ``tools`` that the template ignores, without
        ``Task.tools_in_prompt``, can never be served: refused, and the run stops."""
        if not tools or self.fmt.mode != "chat" or self.fmt.tools_rendered or getattr(
                self.task, "tools_in_prompt", False):
            return
        names = ", ".join(t["function"]["name"] for t in tools)
        self._stop(ChatTemplateError(
            f"agent task {self.task.name!r} sent tools ({names}), but the chat template of "
            f"{self.fmt.name} ignores tools= (it renders the same ids with and without "
            f"them), so the model would never be shown them: set AgentTask("
            f"tools_in_prompt=True) on {self.task.name!r} (its tool schemas are then "
            "written into the system prompt) or use a model folder whose chat template "
            "renders tools"))

    def _template(self, render, sent: list[dict]):
        """``render()``, the template's render of the agent's messages ``sent``: a
        template that refuses them (it raises on a role, or on a system message under
        ``Policy.strict_template``) can never serve this agent, so the request is
        refused and the run stops."""
        try:
            return render()
        except ChatTemplateError as e:
            self._stop(e)
        except (TemplateError, ConversationError) as e:  # the latter: not even as a delta
            roles = " ".join(m["role"] for m in sent)
            self._stop(ChatTemplateError(
                f"the chat template of {self.fmt.name} refuses the messages of agent task "
                f"{self.task.name!r} (roles: {roles}): {e}. Send messages the template "
                "accepts (no 'tool' or 'system' role where it has none; user and "
                "assistant alternating where it requires that) or use a model folder "
                "whose chat template renders them"))

    def _stop(self, error: ChatTemplateError):
        """Refuse the request with ``error`` (HTTP 400) and keep it as ``fatal``: the
        trajectory fails with it and the run stops (``rollart.env.trajectory``)."""
        self.fatal = self.fatal or error
        raise AgentError(str(error)) from None

    def _calls(self, text: str) -> tuple[list[dict], str | None]:
        calls, out = self.parse_calls(text, self.tools), []
        for i, call in enumerate(calls):
            if hasattr(call, "message"):  # a ToolError: the raw text goes back as content
                self.counts.invalid_tool_calls += 1
                continue
            out.append({"id": f"call_{self.counts.calls}_{i}", "type": "function",
                        "function": {"name": call.name,
                                     "arguments": json.dumps(call.arguments)}})
        self.counts.tool_calls += len(calls)
        if len(out) < len(calls) or not out:
            return [], text
        return out, self.strip_calls(text) or None

    def _response(self, content, calls, reason: str, generated: int) -> dict:
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        prompt = len(self.log) - generated
        return {"id": f"chatcmpl-{self.counts.calls}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": reason,
                             "logprobs": None}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": generated,
                          "total_tokens": prompt + generated}}

    def episode(self, task_name: str, seed: int, returned) -> Episode:
        """The ``Episode`` of this trajectory from what the agent returned."""
        c = self.counts
        info = {"agent_calls": c.calls, "agent_rewrites": c.rewrites,
                "tool_calls": c.tool_calls, "invalid_tool_calls": c.invalid_tool_calls}
        if isinstance(returned, Episode):
            ep = Episode(task_name, seed, list(returned.observations) or self.observations,
                         list(returned.actions) or self.actions,
                         [float(r) for r in returned.env_rewards],
                         {**info, **returned.info}, returned.truncated or c.truncated)
            return ep
        if isinstance(returned, bool) or not isinstance(returned, numbers.Real) or \
                not math.isfinite(float(returned)):
            raise EnvOutputError(
                f"the agent of task {task_name!r} returned {type(returned).__name__} "
                f"({returned!r:.60}); expected a finite float reward or a rollart.Episode")
        reward = float(returned)
        return Episode(task_name, seed, self.observations, self.actions, [reward],
                       {**info, "success": reward > 0}, c.truncated)


def agent_session(task, fmt, log: TokenLog, generate: Callable) -> AgentSession:
    """The session of one trajectory of ``task`` in the format ``fmt``."""
    from rollart.chat.tool_formats import get_tool_format, tool_format_of

    calls = get_tool_format(tool_format_of(fmt, task))
    return AgentSession(task, fmt, log, generate, calls.parse, calls.content,
                        model=str(fmt.name or "rollart-policy"))


async def play(server, session: AgentSession, seed: int, idle_timeout: float | None,
               executor) -> Episode:
    """One episode of ``session``'s task: its agent against a route of ``server``
    (``rollart.agents.endpoint.AgentServer``), closed when the agent returns or fails
    (``run_agent``); the ``Episode`` of what it returned."""
    endpoint = server.open(session, seed)
    try:
        returned = await run_agent(session.task.agent, endpoint, session, idle_timeout,
                                   executor)
    finally:
        server.close(endpoint)
    return session.episode(session.task.name, seed, returned)


async def run_agent(agent: Callable, endpoint: AgentEndpoint, session: AgentSession,
                    idle_timeout: float | None, executor) -> Any:
    """Call ``agent(endpoint, seed)`` (awaited when async, else on ``executor``) and
    return what it returned. ``idle_timeout`` bounds the agent's own time between two
    calls (and before its first and after its last): past it, ``TimeoutError``."""
    if inspect.iscoroutinefunction(agent):
        fut = asyncio.ensure_future(agent(endpoint, endpoint.seed))
    else:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(executor, agent, endpoint, endpoint.seed)
    try:
        while True:
            wait = None if idle_timeout is None else max(
                idle_timeout - (time.monotonic() - session.last_active), 0.01)
            done, _ = await asyncio.wait({fut}, timeout=wait)
            if done:
                return fut.result()
            idle = time.monotonic() - session.last_active
            if session.busy == 0 and idle >= idle_timeout:
                raise TimeoutError(f"the agent made no call for {idle:.1f}s (more than "
                                   f"env_step_timeout={idle_timeout}s) and has not returned")
    finally:
        session.close()
        if not fut.done():
            fut.cancel()  # an async agent stops; a thread's next call gets 410
