"""MCP tools as a ``ToolEnv``'s tools: any task env plus the tools of an MCP server.

``MCPClient`` runs one MCP server process over stdio (the official ``mcp`` SDK:
``stdio_client`` + ``ClientSession``) from an event loop on a thread of its own, since
the trajectory runner calls ``call_tool`` synchronously on its env thread pool. At
``start`` it spawns the server, ``initialize``s and lists the tools (OpenAI-style dicts:
``inputSchema`` becomes ``parameters``); ``call(name, arguments)`` returns the result's
text content, an ``isError`` result as ``error : <text>`` for the model to read; a
server that is gone or hangs raises ``MCPServerError`` with the tail of its stderr.

``MCPToolEnv(env_factory, command, args)`` wraps any env (``reset``/``step``/``close``
pass through) and adds the server's tools (``tools`` / ``call_tool``; the inner env's own
tools stay and win on a name clash). Its server starts at first use, one per env
instance, and stops in ``close()``; pickling keeps the configuration only.

``mcp_calc_task()`` is a task built on it: one-digit arithmetic (``ArithmeticEnv``)
with the calculator server of ``servers/mcp_calc.py`` (``CALC_SERVER``); reward = the
exact answer. Needs ``pip install mcp`` (``rollart[envs]``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import re
import sys
import tempfile
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial

from rollart.env.adapters.base import INVALID_PENALTY, AdapterEnv, make_task
from rollart.chat.tools import format_tool_call

#: the calculator MCP server, run as a script (its start does not import rollart) from
#: ``servers/``, where no module shadows the ``mcp`` package as this ``mcp.py`` would
CALC_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "servers",
                           "mcp_calc.py")


class MCPServerError(RuntimeError):
    """The MCP server could not start, died, or stopped answering."""


def openai_tool(tool) -> dict:
    """An MCP ``Tool`` (the SDK's object, or its JSON dict as OpenEnv sends it) as the
    OpenAI-style dict chat templates and ``check_call`` use."""
    get = tool.get if isinstance(tool, dict) else (lambda k: getattr(tool, k, None))
    schema = dict(get("input_schema") or get("inputSchema")
                  or {"type": "object", "properties": {}})
    return {"type": "function", "function": {"name": get("name"),
                                             "description": get("description") or "",
                                             "parameters": schema}}


def result_text(result) -> str:
    """The text a model reads from an MCP ``CallToolResult``: its text blocks joined
    (other blocks named by type; structured content as JSON when there is no text);
    ``error : ...`` when the server flagged it ``isError``."""
    parts = []
    for block in result.content or ():
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, default=str))
    text = "\n".join(parts).strip() or "no output"
    is_error = getattr(result, "is_error", None)
    if is_error is None:  # mcp 1.x spelling
        is_error = getattr(result, "isError", False)
    return f"error : {text}" if is_error else text


class MCPClient:
    """One MCP server over stdio, driven from a private event loop thread."""

    def __init__(self, command: str, args=(), env: dict | None = None,
                 cwd: str | None = None, timeout: float = 30.0) -> None:
        self.command, self.args, self.env, self.cwd = command, list(args), env, cwd
        self.timeout = timeout
        self.tools: list[dict] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session = None
        self._stop: asyncio.Event | None = None
        self._main: Future | None = None
        self._stderr = None
        self._thread: threading.Thread | None = None

    @property
    def label(self) -> str:
        return " ".join([os.path.basename(self.command), *self.args])[:200]

    def start(self) -> list[dict]:
        """Spawn the server, initialize the session, list its tools."""
        if importlib.util.find_spec("mcp") is None:
            raise ImportError("MCPClient needs the mcp SDK: pip install mcp "
                              "(or pip install 'rollart[envs]')")
        self._stderr = tempfile.TemporaryFile("w+")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="rollart-mcp")
        self._thread.start()
        ready: Future = Future()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        self._main.add_done_callback(lambda f: ready.done() or ready.set_exception(
            f.exception() or MCPServerError("the server exited during start-up")))
        try:
            self.tools = ready.result(self.timeout)
        except Exception as e:
            error = self._error("did not start", e)
            self.close()
            raise error from None
        return self.tools

    async def _serve(self, ready: Future) -> None:
        from mcp import ClientSession, StdioServerParameters, stdio_client

        self._stop = asyncio.Event()
        params = StdioServerParameters(command=self.command, args=self.args, env=self.env,
                                       cwd=self.cwd)
        async with stdio_client(params, errlog=self._stderr) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools, cursor = [], None
                while True:
                    from mcp.types import PaginatedRequestParams

                    page = await session.list_tools(
                        params=PaginatedRequestParams(cursor=cursor) if cursor else None)
                    tools += [openai_tool(t) for t in page.tools]
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self._session = session
                ready.set_result(tools)
                await self._stop.wait()

    def call(self, name: str, arguments: dict) -> str:
        """Run one tool; its text (``error : ...`` for a tool error)."""
        if self._session is None or self._main is None or self._main.done():
            raise self._error("is not running (closed, or it exited)")
        coro = self._session.call_tool(name, arguments, read_timeout_seconds=self.timeout)
        cfut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return result_text(cfut.result(self.timeout + 5))
        except FutureTimeout:
            cfut.cancel()
            raise self._error(f"did not answer {name!r} within {self.timeout}s") from None
        except Exception as e:
            raise self._error(f"failed on {name!r}", e) from None

    def close(self) -> None:
        """Stop the session; ``stdio_client`` ends the server process (stdin closed,
        then SIGTERM, then SIGKILL). Idempotent."""
        loop, self._loop, self._session = self._loop, None, None
        if loop is None:
            return
        if self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        if self._main is not None:
            try:
                self._main.result(self.timeout)
            except Exception:
                self._main.cancel()
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
            if not self._thread.is_alive():
                loop.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _error(self, what: str, cause: BaseException | None = None) -> MCPServerError:
        tail = ""
        try:
            if self._stderr is not None:
                self._stderr.seek(0)
                tail = self._stderr.read()[-800:].strip()
        except (OSError, ValueError):
            pass
        while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
            cause = cause.exceptions[0]  # anyio's task groups wrap the real error
        because = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        return MCPServerError(f"MCP server `{self.label}` {what}{because}"
                              + (f"; its stderr ends:\n{tail}" if tail else
                                 "; check that the command runs on its own"))


class MCPToolEnv:
    """Any env, plus the tools of an MCP stdio server (``rollart.env.protocol.ToolEnv``)."""

    def __init__(self, env_factory, command: str, args=(), env: dict | None = None,
                 cwd: str | None = None, timeout: float = 30.0) -> None:
        self.env_factory = env_factory
        self.command, self.args, self.server_env, self.cwd = command, tuple(args), env, cwd
        self.timeout = timeout
        self.tool_calls = 0  # calls that reached the server
        self._inner = None
        self._client: MCPClient | None = None
        # a close while reset starts the server (a trajectory cancelled then) waits for
        # the start and stops that server, rather than miss it
        self._lock = threading.Lock()

    @property
    def inner(self):
        if self._inner is None:
            self._inner = self.env_factory()
        return self._inner

    @property
    def affinity(self):
        return getattr(self.inner, "affinity", None)

    def _server(self) -> MCPClient:
        with self._lock:
            if self._client is None:
                client = MCPClient(self.command, self.args, self.server_env, self.cwd,
                                   self.timeout)
                client.start()
                self._client = client
            return self._client

    @property
    def tools(self) -> list[dict]:
        own = list(getattr(self.inner, "tools", None) or [])
        names = {t["function"]["name"] for t in own}
        return own + [t for t in self._server().tools if t["function"]["name"] not in names]

    def call_tool(self, name: str, arguments: dict) -> str:
        own = getattr(self.inner, "tools", None) or []
        if any(t["function"]["name"] == name for t in own):
            return self.inner.call_tool(name, arguments)
        self.tool_calls += 1
        return self._server().call(name, arguments)

    def reset(self, seed: int) -> str:
        self._server()  # start (or fail) before the episode, not in its first tool turn
        return self.inner.reset(seed)

    def step(self, action):
        return self.inner.step(action)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        try:
            if self._inner is not None:
                self._inner.close()
        finally:
            if client is not None:
                client.close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_inner": None, "_client": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


# -- a task: arithmetic with the calculator server ---------------------------------------
OPS = ("+", "-", "*")


class ArithmeticEnv(AdapterEnv):
    """``a op b`` with one-digit operands; ``answer <n>`` (or a bare number) ends the
    episode, success when exact. Tools come from the wrapper (``MCPToolEnv``)."""

    _live = ()

    def __init__(self, max_turns: int = 3, name: str = "mcp_calc") -> None:
        super().__init__(max_turns)
        self.name = name
        self._question, self._answer = "", 0

    def _reset(self, seed: int) -> str:
        rng = random.Random(seed)
        a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice(OPS)
        self._question = f"{a} {op} {b}"
        self._answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{self.name} : what is {self._question} ? use calculate or answer . act :"

    def _step(self, action: str):
        words = action.strip().split()
        number = words[1] if len(words) == 2 and words[0].lower() == "answer" else (
            words[0] if len(words) == 1 else None)
        if number is None or not number.lstrip("-").isdigit():
            return (f"invalid . {self.name} : what is {self._question} ? answer <number> . "
                    "act :", -INVALID_PENALTY, False, {"invalid": True})
        right = int(number) == self._answer
        return (f"{self.name} : {'success' if right else 'failure'} .", float(right), True,
                {"success": right})


def python_path_env() -> dict | None:
    """This process's ``PYTHONPATH`` for a Python server (an MCP stdio server gets only a
    minimal environment: ``HOME``, ``PATH``, ...), or None when unset."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path} if path else None


def calc_warmup_action(rng: random.Random, observation: str) -> str:
    """A well-formed move: while the question is in view, the question as a
    ``calculate`` call; after a tool result, an answer (a number seen, half the time)."""
    m = re.search(r"what is (-?\d+ [-+*] -?\d+) \?", observation)
    if m:
        return format_tool_call("calculate", {"expression": m.group(1)})
    seen = re.findall(r"-?\d+", observation)
    if seen and rng.random() < 0.5:
        return f"answer {rng.choice(seen)}"
    return f"answer {rng.randint(-8, 81)}"


def mcp_calc_task(name: str = "mcp_calc", max_turns: int = 3, max_new_tokens: int = 48,
                  top_p: float | None = None, timeout: float = 30.0, **task_fields):
    """Arithmetic with the calculator MCP server's tools (chat format: the model calls
    ``calculate`` in ``<tool_call>`` blocks). Reward: the env's return."""
    factory = partial(MCPToolEnv, partial(ArithmeticEnv, max_turns=max_turns, name=name),
                      sys.executable, (CALC_SERVER,), env=python_path_env(),
                      timeout=timeout)
    words = ["calculate", "answer", "what", "is", "?", "use", "or", "error", *OPS,
             *(str(n) for n in range(-8, 82))]
    return make_task(name, factory, max_turns=max_turns, warmup_action=calc_warmup_action,
                     max_new_tokens=max_new_tokens, extra_words=words, vocab_seeds=range(2),
                     description="arithmetic with an MCP calculator server's tools",
                     top_p=top_p, **task_fields)
