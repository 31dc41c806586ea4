"""A small function server: host reward functions (or any stateless step) behind HTTP.

The shape of a cloud function: ``POST /<name>`` with a JSON body
``{"inputs": [...]}`` (plus ``"kind": "episode"`` when the inputs are
``rollart.types.Episode`` records, which the server rebuilds and whose values it
checks as rewards) answers ``{"outputs": [...], "errors": [...]}`` — one entry per
input, an error text where that input failed. Nothing is pickled. ``GET /health``
lists the functions; ``GET /metrics`` gives request counts and busy seconds.
Functions with a ``batch(list) -> list`` method get a whole request in one call (an
``LLMJudge`` scores a request with one forward pass). Binds 127.0.0.1 by default.

    python -m rollart.reward.server mypkg.rewards:score --port 8900
    # then: serverless reward at http://127.0.0.1:8900/score

>>> # with FunctionServer({"score": my_reward}) as srv:
>>> #     reward = rollart.reward.http_reward(srv.url("score"))
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from rollart.reward.offload import (
    EPISODE_KIND,
    ServerlessReward,
    _jsonable,
    _lookup,
    decode_inputs,
    run_batch,
    score_batch,
)

MAX_BODY = 64 * 2**20  # bytes


class FunctionServer:
    """Serves ``{name: function}`` on ``host:port`` (port 0 = any free port)."""

    def __init__(self, functions: dict[str, Callable], host: str = "127.0.0.1",
                 port: int = 0):
        if not functions:
            raise ValueError("FunctionServer needs at least one {name: function}")
        for name, fn in functions.items():
            if not name or "/" in name or not callable(fn):
                raise ValueError(f"FunctionServer: {name!r} must map a name without '/' "
                                 f"to a function, got {type(fn).__name__}")
            if isinstance(fn, ServerlessReward) and fn.fn is None:
                raise ValueError(f"FunctionServer: {name!r} is itself only a URL")
        self.functions = dict(functions)
        self.stats = {"requests": 0, "items": 0, "errors": 0, "busy_seconds": 0.0,
                      "in_flight": 0}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, name: str) -> str:
        if name not in self.functions:
            raise KeyError(f"no function {name!r}; serving {sorted(self.functions)}")
        return f"{self.address}/{name}"

    def start(self) -> "FunctionServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="rollart-function-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "FunctionServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def call(self, name: str, body: dict) -> tuple[int, dict]:
        """Run one request; ``(status, response body)``."""
        fn = self.functions.get(name)
        if fn is None:
            return 404, {"error": f"no function {name!r}; serving {sorted(self.functions)}"}
        try:
            items = decode_inputs(body)
        except (TypeError, ValueError) as e:
            return 400, {"error": f"bad request: {e}"}
        with self._lock:
            self.stats["in_flight"] += 1
        t0 = time.perf_counter()
        try:
            run = score_batch if body.get("kind") == EPISODE_KIND else run_batch
            outputs, errors = run(fn, items)
        finally:
            with self._lock:
                self.stats["in_flight"] -= 1
                self.stats["busy_seconds"] += time.perf_counter() - t0
                self.stats["requests"] += 1
                self.stats["items"] += len(items)
        with self._lock:
            self.stats["errors"] += sum(e is not None for e in errors)
        return 200, {"outputs": outputs, "errors": errors}


def _handler(server: FunctionServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"ok": True, "functions": sorted(server.functions)})
            elif self.path == "/metrics":
                with server._lock:
                    self._send(200, dict(server.stats))
            else:
                self._send(404, {"error": "GET /health or /metrics; POST /<function>"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                self._send(413, {"error": f"body over {MAX_BODY} bytes"})
                return
            try:
                body = json.loads(self.rfile.read(n) or b"null")
                if not isinstance(body, dict):
                    raise ValueError('expected a JSON object {"inputs": [...]}')
            except ValueError as e:
                self._send(400, {"error": f"bad JSON: {e}"})
                return
            try:
                status, out = server.call(self.path.strip("/"), body)
            except Exception as e:  # a bug in the server itself, not in a function
                status, out = 500, {"error": f"{type(e).__name__}: {e}"}
            self._send(status, out)

        def _send(self, status: int, body: dict) -> None:
            try:
                raw = json.dumps(body, default=_jsonable).encode()
            except (TypeError, ValueError) as e:
                status, raw = 500, json.dumps({"error": f"output is not JSON: {e}"}).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the caller gave up (its time-out); nothing to answer

        def log_message(self, *args):  # quiet: metrics are at /metrics
            pass

    return Handler


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Serve reward functions over HTTP (JSON).")
    p.add_argument("functions", nargs="+", help="module:attribute[=name] to serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8900)
    a = p.parse_args(argv)
    functions = {}
    for spec in a.functions:
        target, _, name = spec.partition("=")
        module, _, attr = target.partition(":")
        fn = _lookup(module, attr)
        if fn is None:
            p.error(f"{module} has no attribute {attr!r}")
        functions[name or attr.rsplit(".", 1)[-1]] = fn
    srv = FunctionServer(functions, a.host, a.port)
    print(f"serving {sorted(functions)} at {srv.address}", flush=True)
    try:
        srv._httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv._httpd.server_close()


if __name__ == "__main__":
    main()
