"""One door: control code reaches actors only through ``rollart.control.door.Door`` (the
run's ``Fleet`` is one), which applies the one time-out rule and the one lost rule.

Read from the source with ``ast`` (no cluster): outside ``door.py``, no module of
``rollart.control`` may import ``bounded`` (the old bounded wait) nor wait on a call
directly (``actor.method(...).result(...)``); each finding names its file and line.
The check is shown to catch planted violations. The door's own rules (its time-out is
a ``StuckError``, never an ``OSError``; its call's own errors come out as raised) are
checked on stand-in futures."""

import ast
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from rollart.control.door import ActorLost, Door
from rollart.runtime.waits import StuckError

CONTROL = Path(__file__).resolve().parents[2] / "rollart" / "control"
DOOR = CONTROL / "door.py"


def around_the_door(source: str, name: str) -> list[str]:
    """``"name:line: what"`` for each way ``source`` reaches an actor around the door."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any(a.name == "bounded" for a in node.names):
            out.append(f"{name}:{node.lineno}: imports bounded (wait through a Door)")
        elif isinstance(node, ast.Attribute) and node.attr == "bounded":
            out.append(f"{name}:{node.lineno}: uses .bounded (wait through a Door)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "result" and isinstance(node.func.value, ast.Call):
            out.append(f"{name}:{node.lineno}: waits on a call's .result() directly "
                       "(Door.call / Fleet.call)")
    return sorted(out, key=lambda f: int(f.split(":")[1]))


def test_control_reaches_actors_only_through_the_door():
    found = []
    for path in sorted(CONTROL.rglob("*.py")):
        if path != DOOR:
            found += around_the_door(path.read_text(), str(path.relative_to(CONTROL)))
    assert not found, "control code reaches actors around the door:\n" + "\n".join(found)


def test_the_check_catches_planted_violations():
    planted = ("from rollart.runtime.waits import StuckError, bounded\n"
               "x = waits.bounded(f, 1, 'w')\n"
               "y = trainer.save(path).result(timeout=60)\n"
               "z = fleet.call(trainer, 'save', path, timeout=60)\n"  # the door: fine
               "w = fut.result(timeout=1)\n")  # a future already in hand: fine
    assert around_the_door(planted, "planted.py") == [
        "planted.py:1: imports bounded (wait through a Door)",
        "planted.py:2: uses .bounded (wait through a Door)",
        "planted.py:3: waits on a call's .result() directly (Door.call / Fleet.call)"]


class _Actor:
    _address = "tcp://w:1"

    def __init__(self, fut):
        self.fut = fut

    def work(self):
        return self.fut


def test_a_time_out_is_a_stuck_error_naming_what_and_the_setting():
    never = Future()
    t0 = time.monotonic()
    with pytest.raises(StuckError, match=r"the trainer did not save within 0.2 s.*"
                                         r"rollart.waits.call"):
        Door().call(_Actor(never), "work", timeout=0.2, stuck="the trainer did not save")
    assert time.monotonic() - t0 < 5
    with pytest.raises(StuckError, match=r"the actor on tcp://w:1 gave no answer within "
                                         r"0.1 s") as e:
        Door().result(never, _Actor(never), 0.1)
    assert not isinstance(e.value, OSError)  # a time-out is never a lost worker
    with pytest.raises(StuckError, match=r"did not start within 0.1 s.*rollart.waits.start"):
        Door().result(never, None, 0.1, stuck="the X did not start", setting="start")


def test_the_calls_own_errors_are_as_raised_and_a_view_judges_loss():
    own = Future()
    own.set_exception(TimeoutError("the buffer had no batch"))  # the call's own
    with pytest.raises(TimeoutError, match="no batch"):
        Door().result(own, _Actor(own), 5, stuck="never said")
    gone = Future()
    gone.set_exception(OSError("Unable to contact Actor's worker"))
    with pytest.raises(OSError) as e:
        Door().result(gone, _Actor(gone))
    assert not isinstance(e.value, ActorLost)  # without a view nothing is judged lost
    with pytest.raises(ActorLost, match="tcp://w:1"):
        Door(live=lambda: {"tcp://w:1": {}}).result(gone, _Actor(gone))
    with pytest.raises(ActorLost, match="left the cluster"):  # its worker is gone
        Door(live=dict).result(Future(), _Actor(None), 5)
    ok = Future()
    ok.set_result(3)
    assert Door(live=dict).call(_Actor(ok), "work", timeout=1) == 3  # done: its result
