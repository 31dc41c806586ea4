"""OpenEnv environments (Meta's ``openenv-core``) behind rollart's ``Env`` / ``ToolEnv``.

``OpenEnvEnv`` plays one OpenEnv environment, either

* in process: ``OpenEnvEnv(environment=CalcEnvironment, action_cls=CalcAction)``, the
  factory making an ``openenv`` ``Environment`` (typed pydantic Action / Observation)
  where the env manager runs; or
* over OpenEnv's server: ``OpenEnvEnv(base_url="http://127.0.0.1:8000")``, through its
  WebSocket client (``GenericEnvClient(...).sync()``, one session per env instance);
  ``OpenEnvServer`` starts such a server from a script on 127.0.0.1 (tests, local runs).

Both speak OpenEnv's wire format: an action is a dict (the model's text under
``action_field``), a result ``{"observation": {...}, "reward", "done"}``. The
observation becomes text from ``text_field`` (default: its only string field, else its
JSON); ``reward`` (``None`` -> 0) and ``done`` pass through; ``info["success"]`` is the
observation's ``success`` (or its ``metadata["success"]`` in process), else
``done and reward > 0``. An env with MCP tools (an ``MCPEnvironment``, or ``tools=True``
for a server) offers them as the ``ToolEnv``'s tools: ``ListToolsAction`` -> OpenAI tool
dicts, ``call_tool`` -> a ``CallToolAction`` whose result's text (or ``error : ...``)
the model reads. ``openenv_calc_task()`` is a task on ``servers.openenv_calc.CalcEnvironment``.
Needs ``pip install openenv-core`` (``rollart[envs]``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from functools import partial

from rollart.env.adapters.base import AdapterEnv, make_task
from rollart.env.adapters.mcp import calc_warmup_action, openai_tool  # the same call
from rollart.runtime.waits import stop_process

_MCP_TYPES = ("list_tools", "call_tool")


class _Local:
    """An ``Environment`` in this process, spoken to in the wire format."""

    def __init__(self, factory, action_cls) -> None:
        from openenv.core.env_server import MCPEnvironment

        self.env, self.action_cls = factory(), action_cls
        self.has_tools = isinstance(self.env, MCPEnvironment)

    def _payload(self, obs) -> dict:
        from openenv.core.env_server.serialization import serialize_observation

        out = serialize_observation(obs)
        out["observation"] = json.loads(json.dumps(out["observation"], default=str))
        out["metadata"] = dict(getattr(obs, "metadata", None) or {})
        return out

    def reset(self, seed: int) -> dict:
        return self._payload(self.env.reset(seed=seed))

    def step(self, action: dict) -> dict:
        from openenv.core.env_server import CallToolAction, ListToolsAction

        kind = action.get("type")
        if kind in _MCP_TYPES:
            cls = ListToolsAction if kind == "list_tools" else CallToolAction
            typed = cls.model_validate(action)
        else:
            typed = self.action_cls.model_validate(action)
        return self._payload(self.env.step(typed))

    def close(self) -> None:
        self.env.close()


class _Remote:
    """A session on an OpenEnv server (its WebSocket client, made synchronous). Tool
    actions go as the server's ``mcp`` messages (JSON-RPC ``tools/list``,
    ``tools/call``), which it routes to the session's env whatever its action class."""

    def __init__(self, base_url: str, timeout: float, has_tools: bool | None) -> None:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=base_url, connect_timeout_s=timeout,
                                       message_timeout_s=timeout).sync()
        self.client.connect()
        self.has_tools = True if has_tools is None else has_tools
        self._rpc_id = 0

    def reset(self, seed: int) -> dict:
        return _result(self.client.reset(seed=seed))

    def step(self, action: dict) -> dict:
        kind = action.get("type")
        if kind == "list_tools":
            reply = self._rpc("tools/list", {})
            return _mcp_payload({"tools": (reply.get("result") or {}).get("tools") or []})
        if kind == "call_tool":
            reply = self._rpc("tools/call", {"name": action["tool_name"],
                                             "arguments": action["arguments"]})
            return _mcp_payload({"tool_name": action["tool_name"],
                                 "result": reply.get("result"), "error": reply.get("error")})
        return _result(self.client.step(action))

    def _rpc(self, method: str, params: dict) -> dict:
        self._rpc_id += 1
        message = {"type": "mcp", "data": {"jsonrpc": "2.0", "id": self._rpc_id,
                                           "method": method, "params": params}}
        # the sync client has no public call for an ``mcp`` message: run the async one's
        reply = self.client._run(self.client.async_client._send_and_receive(message))
        return reply.get("data") or {}

    def close(self) -> None:
        self.client.close()


def _result(result) -> dict:
    return {"observation": dict(result.observation or {}), "reward": result.reward,
            "done": bool(result.done), "metadata": {}}


def _mcp_payload(observation: dict) -> dict:
    return {"observation": observation, "reward": None, "done": False, "metadata": {}}


def observation_text(observation: dict, field: str | None = None) -> str:
    """The text a model reads: ``observation[field]``, else the only string field, else
    the observation as JSON (sorted keys)."""
    if field is not None:
        return str(observation.get(field, ""))
    strings = [v for v in observation.values() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    return json.dumps(observation, sort_keys=True, default=str)


def tool_result_text(observation: dict) -> str:
    """A ``CallToolObservation`` (as a dict) as the text the model reads."""
    error = observation.get("error")
    if error:
        return f"error : {error.get('message', error) if isinstance(error, dict) else error}"
    result = observation.get("result")
    if isinstance(result, dict):
        texts = [b.get("text") for b in result.get("content") or () if isinstance(b, dict)]
        text = "\n".join(t for t in texts if isinstance(t, str)) or str(result.get("data"))
        return f"error : {text}" if result.get("is_error") else text
    return "no output" if result is None else str(result)


class OpenEnvEnv(AdapterEnv):
    """An OpenEnv environment as a rollart env (module docstring)."""

    _live = ("_env", "_tools")

    def __init__(self, environment=None, *, action_cls=None, base_url: str | None = None,
                 action_field: str = "message", text_field: str | None = None,
                 tools: bool | None = None, max_turns: int = 4, name: str = "openenv",
                 timeout: float = 30.0) -> None:
        super().__init__(max_turns)
        if (environment is None) == (base_url is None):
            raise ValueError("OpenEnvEnv: give environment=<Environment factory> (in "
                             "process) or base_url='http://host:port' (a server), not both")
        if environment is not None and action_cls is None:
            raise ValueError("OpenEnvEnv: an in-process environment needs action_cls=<its "
                             "Action subclass> to build actions from the model's text")
        self.environment, self.action_cls, self.base_url = environment, action_cls, base_url
        self.action_field, self.text_field, self.use_tools = action_field, text_field, tools
        self.name, self.timeout = name, timeout
        self._tools: list | None = None
        self.tool_calls = 0

    def _backend(self):
        if self._env is None:
            if self.base_url is not None:
                self._env = _Remote(self.base_url, self.timeout, self.use_tools)
            else:
                self._env = _Local(self.environment, self.action_cls)
                if self.use_tools is not None:
                    self._env.has_tools = self.use_tools
        return self._env

    # -- tools -----------------------------------------------------------------------------
    @property
    def tools(self) -> list[dict]:
        if self._tools is None:
            backend, listed = self._backend(), {}
            if backend.has_tools:
                try:
                    listed = backend.step({"type": "list_tools"})
                except RuntimeError:  # a server whose env has no tools: none, unless asked
                    if self.use_tools:
                        raise
            self._tools = [openai_tool(t) for t in
                           (listed.get("observation") or {}).get("tools") or ()]
        return self._tools

    def call_tool(self, name: str, arguments: dict) -> str:
        self.tool_calls += 1
        out = self._backend().step({"type": "call_tool", "tool_name": name,
                                    "arguments": dict(arguments)})
        return tool_result_text(out["observation"])

    # -- the AdapterEnv hooks --------------------------------------------------------------
    def reset(self, seed: int) -> str:
        tools = self._tools
        obs = super().reset(seed)
        self._tools = tools  # the listing outlives episodes (same env, same tools)
        return obs

    def _reset(self, seed: int) -> str:
        return observation_text(self._backend().reset(seed)["observation"], self.text_field)

    def _step(self, action: str):
        out = self._backend().step({self.action_field: action})
        obs, reward, done = out["observation"], float(out["reward"] or 0.0), out["done"]
        success = obs.get("success", out["metadata"].get("success"))
        success = bool(done and reward > 0) if success is None else bool(success)
        return (observation_text(obs, self.text_field), reward, bool(done),
                {"success": success})


class OpenEnvServer:
    """An OpenEnv server script run on 127.0.0.1 (``python script --port N``) for the
    life of a ``with`` block; ``base_url`` is where it answers."""

    def __init__(self, script: str, timeout: float = 60.0) -> None:
        self.script, self.timeout = script, timeout
        self.proc: subprocess.Popen | None = None
        self.base_url = ""

    def __enter__(self) -> "OpenEnvServer":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, self.script, "--port", str(port)],
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"OpenEnv server {self.script} exited with "
                                   f"{self.proc.returncode}; run it by hand to see why")
            try:
                urllib.request.urlopen(f"{self.base_url}/health", timeout=2).close()
                return self
            except OSError:
                time.sleep(0.2)
        self.__exit__()
        raise TimeoutError(f"OpenEnv server {self.script} did not answer {self.base_url}"
                           f"/health within {self.timeout}s")

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)


def openenv_calc_task(name: str = "openenv_calc", max_turns: int = 3,
                      max_new_tokens: int = 48, top_p: float | None = None, **task_fields):
    """Arithmetic on ``servers.openenv_calc.CalcEnvironment`` in process, with its MCP
    ``calculate`` tool (chat format). Reward: the env's return."""
    from rollart.env.adapters.servers.openenv_calc import CalcAction, CalcEnvironment

    factory = partial(OpenEnvEnv, CalcEnvironment, action_cls=CalcAction,
                      max_turns=max_turns, name=name)
    words = ["calculate", "answer", "what", "is", "?", "use", "or", "error", "+", "-", "*",
             *(str(n) for n in range(-8, 82))]
    return make_task(name, factory, max_turns=max_turns, warmup_action=calc_warmup_action,
                     max_new_tokens=max_new_tokens, extra_words=words, vocab_seeds=range(2),
                     description="arithmetic on an OpenEnv environment with an MCP tool",
                     top_p=top_p, **task_fields)
