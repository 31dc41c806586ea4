"""Where a tool's code runs: a fresh process per call, forked from a clean zygote.

``run_code(code, cpu_seconds, memory_mb, wall_seconds)`` returns ``Finished(returncode,
stdout, stderr, timed_out)`` of ``code`` run in a process that

* starts from a ``python -I -S`` interpreter with an empty environment (``PATH`` only)
  that never runs tool code itself (the zygote, one per rollart process, started on
  first use), forked anew for every call: nothing one call does reaches the next;
* runs in its own temporary working directory with no stdin, every other file
  descriptor closed, and ``setrlimit`` caps on CPU seconds, address space, file size
  and open files;
* is killed at the wall-clock time-out;
* prints a lone expression's value, like a REPL; an uncaught exception prints its
  traceback and exits 1, ``SystemExit`` exits with its code, as ``python -c`` would.

Why a zygote: starting an interpreter per call cost ~15-20 ms of CPU, and calc's
warm-up and rollouts make dozens of calls a step on the same two cores as the model
(``benchmarks/tool_sandbox.py`` measures both ways side by side). A fork of the small
zygote costs ~1-2 ms. Callers on many threads share it: each call gets its own
socket pair, handed to the zygote with ``SCM_RIGHTS``; a zygote that died is started
again. Where ``os.fork`` or ``socket.send_fds`` is missing (Windows), or with
``fresh=True``, each call starts its own interpreter, as before.

Called by ``rollart.env.adapters.tool.run_python``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

#: the most bytes of stdout and of stderr a call keeps (the first of stdout, the last of
#: stderr, where an error's last line is)
KEEP_BYTES = 1 << 20


@dataclass(frozen=True)
class Finished:
    """How a call ended: the process's return code (negative: killed by that signal),
    its output, and whether the wall-clock time-out killed it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


# The code both ways run: a function ``_run_tool(code, cpu, mem)`` that caps the process
# and runs ``code``, returning the exit status. The fresh way calls it in its own
# interpreter; the zygote in each call's grandchild.
_TOOL = """\
def _run_tool(code, cpu, mem):
    import resource, sys, traceback
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem * 1024 * 1024, mem * 1024 * 1024))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    scope = {"__name__": "__tool__"}
    try:
        try:
            tree = compile(code, "<tool>", "eval")
        except SyntaxError:
            exec(compile(code, "<tool>", "exec"), scope)
        else:
            value = eval(tree, scope)
            if value is not None:
                print(value)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
"""

_FRESH = _TOOL + """\
import sys
sys.exit(_run_tool(sys.stdin.read(), int(sys.argv[1]), int(sys.argv[2])))
"""

# The zygote: waits for a socket per call on its control socket (fd argv[1]); for each it
# forks a supervisor, which reads the request, forks the grandchild that runs the code
# (pipes for its output), enforces the wall clock, and writes the result back.
_ZYGOTE = _TOOL + """\
import json, os, resource, select, selectors, signal, socket, sys, tempfile, time, traceback

KEEP = int(sys.argv[2])


def _grandchild(req, out_w, err_w, cwd):
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, 1 << 16)  # the zygote's, the supervisor's and the caller's sockets
    os.chdir(cwd)
    os._exit(_run_tool(req["code"], req["cpu"], req["mem"]))


def _exit_code(pid, deadline):
    # the process's exit code once it exits, or None if it still runs at the deadline
    # (waits on a pidfd where Linux has one, else polls with growing naps)
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    nap = 0.0005
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if fd is not None:
                select.select([fd], [], [], left)
            else:
                time.sleep(min(nap, left))
                nap = min(2 * nap, 0.05)
    finally:
        if fd is not None:
            os.close(fd)


def _supervise(conn):
    chunks = []
    while True:
        b = conn.recv(1 << 16)
        if not b:
            break
        chunks.append(b)
    req = json.loads(b"".join(chunks))
    with tempfile.TemporaryDirectory(prefix="rollart-tool-") as cwd:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _grandchild(req, out_w, err_w, cwd)
        os.close(out_w)
        os.close(err_w)
        bufs = {out_r: bytearray(), err_r: bytearray()}
        sel = selectors.DefaultSelector()
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + req["wall"]
        timed_out = False
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                buf += data
                if key.fd == err_r and len(buf) > KEEP:
                    del buf[:-KEEP]  # an error's last line is what is read
                elif key.fd == out_r and len(buf) > KEEP:
                    del buf[KEEP:]
        sel.close()
        rc = None if timed_out else _exit_code(pid, deadline)
        if rc is None:  # the wall clock ran out (with its output closed, it may still run)
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = -signal.SIGKILL
    reply = {"rc": rc, "out": bytes(bufs[out_r]).decode("utf-8", "replace"),
             "err": bytes(bufs[err_r]).decode("utf-8", "replace"), "timed_out": timed_out}
    conn.sendall(json.dumps(reply).encode())


def _serve(control):
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    tempfile.gettempdir()  # found once here, not probed again in every call's process
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not fds:
            return  # the caller's process is gone (or closed the zygote)
        if os.fork() == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it waits for its grandchild
            code = 1
            try:
                with socket.socket(fileno=fds[0]) as conn:
                    _supervise(conn)
                code = 0
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)


_serve(socket.socket(fileno=int(sys.argv[1])))
"""


def _sandbox_env() -> dict:
    return {"PATH": os.defpath}


def can_fork() -> bool:
    """Whether this platform runs tool calls through the zygote."""
    return hasattr(os, "fork") and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")


class _Zygote:
    """The zygote process of this rollart process, and the control socket to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._pid = 0  # the process that started it (a fork of this one starts its own)
        self.starts = 0

    def _start(self) -> None:
        self._close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _ZYGOTE, str(theirs.fileno()),
                 str(KEEP_BYTES)],
                pass_fds=(theirs.fileno(),), env=_sandbox_env(), cwd="/",
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)
        self._control, self._pid = ours, os.getpid()
        if not self.starts:  # closed at exit; registered on first use, not at import
            atexit.register(self.close)
        self.starts += 1

    def _close(self) -> None:
        if self._control is not None:
            self._control.close()  # the zygote reads EOF and exits
            self._control = None
        if self._proc is not None and self._pid == os.getpid():
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def submit(self, request: bytes) -> socket.socket:
        """Hand a new call's socket to the zygote and send it ``request``; returns the
        caller's end, where the reply arrives."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                for attempt in (0, 1):
                    if (self._control is None or self._pid != os.getpid()
                            or self._proc.poll() is not None):
                        self._start()
                    try:
                        socket.send_fds(self._control, [b"c"], [theirs.fileno()])
                        break
                    except OSError:
                        if attempt:
                            raise
                        self._control.close()
                        self._control = None  # dead: start another, once
        finally:
            theirs.close()
        ours.sendall(request)
        ours.shutdown(socket.SHUT_WR)
        return ours

    def close(self) -> None:
        with self._lock:
            self._close()


_ZYGOTE_PROCESS = _Zygote()


def run_code(code: str, cpu_seconds: int, memory_mb: int, wall_seconds: float,
             fresh: bool = False) -> Finished:
    """Run ``code`` sandboxed (see the module docstring); ``fresh=True`` (or a platform
    without ``fork``) starts an interpreter for the call instead of forking the zygote."""
    if fresh or not can_fork():
        return _run_fresh(code, cpu_seconds, memory_mb, wall_seconds)
    request = json.dumps({"code": code, "cpu": int(cpu_seconds), "mem": int(memory_mb),
                          "wall": float(wall_seconds)}).encode()
    with _ZYGOTE_PROCESS.submit(request) as conn:
        # the supervisor kills the code at the wall clock; this bounds a zygote that hangs
        conn.settimeout(float(wall_seconds) + 30.0)
        chunks = []
        try:
            while True:
                b = conn.recv(1 << 16)
                if not b:
                    break
                chunks.append(b)
        except socket.timeout:
            return Finished(-signal.SIGKILL, "", "", timed_out=True)
    if not chunks:  # the supervisor died before it replied
        return Finished(-signal.SIGKILL, "", "the tool's sandbox process died")
    reply = json.loads(b"".join(chunks))
    return Finished(reply["rc"], reply["out"], reply["err"], reply["timed_out"])


def _run_fresh(code: str, cpu_seconds: int, memory_mb: int, wall_seconds: float) -> Finished:
    with tempfile.TemporaryDirectory(prefix="rollart-tool-") as cwd:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _FRESH, str(int(cpu_seconds)),
                 str(int(memory_mb))],
                input=code, capture_output=True, text=True, cwd=cwd, env=_sandbox_env(),
                timeout=wall_seconds)
        except subprocess.TimeoutExpired:
            return Finished(-signal.SIGKILL, "", "", timed_out=True)
    return Finished(proc.returncode, proc.stdout, proc.stderr[-KEEP_BYTES:])
