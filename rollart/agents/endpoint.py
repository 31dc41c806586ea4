"""The HTTP side of the agent endpoint: an OpenAI-compatible server on the loop it runs in.

``AgentServer`` serves ``POST /{token}/v1/chat/completions`` (and ``GET
/{token}/v1/models``) on 127.0.0.1 with Tornado (a dependency of ``distributed``
already), on the event loop of the env manager (or of the evaluation) that starts it,
bound to a port the OS picks. Each trajectory ``open``\\ s a route under a random token,
which is also its API key (``Authorization: Bearer <token>``); the route goes when the
trajectory ``close``\\ s it, and later calls are answered 410. The chat logic is
``rollart.agents.agent.AgentSession``; errors come back in OpenAI's error shape, so the
``openai`` client raises its usual exceptions.
"""

from __future__ import annotations

import json
import logging
import secrets

from rollart.agents.agent import AgentEndpoint, AgentError, AgentSession

logger = logging.getLogger(__name__)


class AgentServer:
    """One server, a route per open trajectory (start it inside a running loop)."""

    def __init__(self, host: str = "127.0.0.1"):
        import tornado.httpserver
        import tornado.netutil
        import tornado.web

        self.host = host
        self.sessions: dict[str, AgentSession] = {}
        app = tornado.web.Application([
            (r"/([0-9a-f]+)/v1/chat/completions", _Completions, {"server": self}),
            (r"/([0-9a-f]+)/v1/models", _Models, {"server": self}),
        ])
        sockets = tornado.netutil.bind_sockets(0, host)
        self.port = sockets[0].getsockname()[1]
        self._http = tornado.httpserver.HTTPServer(app)
        self._http.add_sockets(sockets)

    def open(self, session: AgentSession, seed: int) -> AgentEndpoint:
        token = secrets.token_hex(16)
        self.sessions[token] = session
        return AgentEndpoint(f"http://{self.host}:{self.port}/{token}/v1", token,
                             session.model, seed)

    def close(self, endpoint: AgentEndpoint) -> None:
        session = self.sessions.pop(endpoint.api_key, None)
        if session is not None:
            session.close()

    def stop(self) -> None:
        self._http.stop()
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()


def _handler_base():
    import tornado.web

    class Base(tornado.web.RequestHandler):
        def initialize(self, server: AgentServer):
            self.server = server

        def session(self, token: str) -> AgentSession:
            session = self.server.sessions.get(token)
            if session is None:
                raise AgentError("no such trajectory, or it is over; its endpoint takes "
                                 "no more calls", status=410)
            auth = self.request.headers.get("Authorization", "")
            if auth and auth != f"Bearer {token}":
                raise AgentError("the API key does not match this endpoint's "
                                 "(use endpoint.api_key)", status=401)
            return session

        def fail(self, e: AgentError) -> None:
            self.set_status(e.status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"error": {"message": str(e), "type": "invalid_request"
                                              "_error", "code": e.status}}))

    return Base


_Base = _handler_base()


class _Completions(_Base):
    async def post(self, token: str):
        try:
            session = self.session(token)
            try:
                body = json.loads(self.request.body or b"{}")
            except ValueError:
                raise AgentError("the request body is not valid JSON") from None
            reply = await session.complete(body)
        except AgentError as e:
            return self.fail(e)
        if isinstance(body, dict) and body.get("stream"):
            return self._stream(reply)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(reply))

    def _stream(self, reply: dict) -> None:
        """The whole reply as one chunk, then ``[DONE]`` (server-sent events)."""
        choice = reply["choices"][0]
        delta = dict(choice["message"])
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in
                                   enumerate(delta["tool_calls"])]
        base = {k: reply[k] for k in ("id", "created", "model")}
        chunks = [{**base, "object": "chat.completion.chunk", "choices": [
                      {"index": 0, "delta": delta, "finish_reason": None}]},
                  {**base, "object": "chat.completion.chunk", "choices": [
                      {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                   "usage": reply["usage"]}]
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        for chunk in chunks:
            self.write(f"data: {json.dumps(chunk)}\n\n")
        self.write("data: [DONE]\n\n")
        self.finish()


class _Models(_Base):
    def get(self, token: str):
        try:
            session = self.session(token)
        except AgentError as e:
            return self.fail(e)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"object": "list", "data": [
            {"id": session.model, "object": "model", "owned_by": "rollart"}]}))
