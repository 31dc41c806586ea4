"""The tool sandbox (``rollart.env.adapters.sandbox``): a process forked from the zygote per call
behaves as an interpreter started per call, keeps calls apart, and survives its zygote."""

import os
import signal
import threading
import time

import pytest

from rollart.env.adapters.tool import ToolLimits, run_python
from rollart.env.adapters.sandbox import _ZYGOTE_PROCESS, can_fork, run_code

pytestmark = pytest.mark.skipif(not can_fork(), reason="no os.fork / socket.send_fds here")

CASES = [  # code, limits, (ok, output or the start of it)
    ("6 * 7", ToolLimits(), (True, "42")),
    ("print('hi'); None", ToolLimits(), (True, "hi")),
    ("x = [i * i for i in range(4)]\nprint(x)", ToolLimits(), (True, "[0, 1, 4, 9]")),
    ("1 / 0", ToolLimits(), (False, "ZeroDivisionError: division by zero")),
    ("import sys; sys.exit(3)", ToolLimits(), (False, "exit 3")),
    ("import sys; sys.exit('bye')", ToolLimits(), (False, "bye")),
    ("import sys; sys.exit(0)", ToolLimits(), (True, "")),
    ("import sys; print(repr(sys.stdin.read()))", ToolLimits(), (True, "''")),
    # nothing inherited: PATH, and the C locale coercion Python itself adds at start
    ("import os; print(sorted(os.environ))", ToolLimits(), (True, "['LC_CTYPE', 'PATH']")),
    ("import os; print(os.listdir('.'))", ToolLimits(), (True, "[]")),
    ("import os; os.kill(os.getpid(), 15)", ToolLimits(), (False, "killed by signal 15")),
    ("import time; time.sleep(30)", ToolLimits(wall_seconds=1.0), (False, "timeout after 1.0s")),
    ("while True: pass", ToolLimits(cpu_seconds=1, wall_seconds=60),
     (False, "cpu time limit of 1s exceeded")),
    ("x = bytearray(1 << 31)", ToolLimits(memory_mb=200), (False, "MemoryError")),
    ("print('a' * 3_000_000)", ToolLimits(), (True, "a" * ToolLimits().max_output)),
    ("import sys; sys.stderr.write('noise\\n' * 300_000); raise KeyError('last')",
     ToolLimits(), (False, "KeyError: 'last'")),
]


@pytest.mark.parametrize("code,limits,expected", CASES, ids=[c[0][:30] for c in CASES])
def test_a_forked_call_ends_as_a_fresh_interpreter_does(code, limits, expected):
    forked = run_python(code, limits)
    fresh = run_python(code, limits, fresh=True)
    assert (forked.ok, forked.output) == expected
    assert (fresh.ok, fresh.output) == expected


def test_nothing_of_one_call_reaches_the_next():
    # a module's state, a file in the working directory, the process itself
    assert run_python("import json; json.leak = 1; open('note', 'w').write('x')").ok
    after = run_python("import json, os; print(hasattr(json, 'leak'), os.listdir('.'))")
    assert after.output == "False []"
    pids = {run_python("import os; print(os.getpid())").output for _ in range(3)}
    assert len(pids) == 3


def test_the_code_reaches_no_descriptor_of_the_zygote_or_the_caller():
    # only stdin, stdout and stderr are open: not the zygote's control socket, not the
    # socket its reply goes back on
    out = run_python("import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))")
    assert out.ok and out.output in ("[0, 1, 2]", "[0, 1, 2, 3]")  # 3: listdir's own
    assert not run_python("import os; os.fstat(4)").ok


def test_a_timed_out_call_is_killed_before_it_returns(tmp_path):
    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    out = run_python(code, ToolLimits(wall_seconds=1.0))
    assert not out.ok and out.output.startswith("timeout")
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(int(pidfile.read_text()), 0)


def test_a_slow_call_does_not_hold_up_the_others():
    slow: dict = {}
    t = threading.Thread(target=lambda: slow.update(
        out=run_python("import time; time.sleep(4); print(1)", ToolLimits(wall_seconds=20))))
    t.start()
    try:
        time.sleep(0.5)  # the slow call is in its sandbox
        fast = [run_python(f"{i} + 1").output for i in range(5)]
        assert fast == ["1", "2", "3", "4", "5"]
        assert t.is_alive()  # the five returned while the slow one still ran
    finally:
        t.join()
    assert slow["out"].ok and slow["out"].output == "1"


def test_calls_on_many_threads_get_their_own_output():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: run_python(f"print({i} * 3)").output, range(64)))
    assert outs == [str(i * 3) for i in range(64)]


def test_a_zygote_that_died_is_started_again():
    assert run_python("2 + 2").output == "4"  # a zygote is running
    proc, starts = _ZYGOTE_PROCESS._proc, _ZYGOTE_PROCESS.starts
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert run_python("3 + 3").output == "6"
    assert _ZYGOTE_PROCESS.starts == starts + 1 and _ZYGOTE_PROCESS._proc.pid != proc.pid


def test_run_code_reports_how_the_process_ended():
    done = run_code("print('x'); raise SystemExit(5)", 2, 256, 5.0)
    assert (done.returncode, done.stdout, done.timed_out) == (5, "x\n", False)
    done = run_code("import time; time.sleep(5)", 2, 256, 0.5)
    assert done.timed_out and done.returncode == -signal.SIGKILL
