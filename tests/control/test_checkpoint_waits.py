"""A checkpoint save or restore whose actor call never returns is a StuckError naming the
actor, its worker and the checkpoint, within ``rollart.waits.call`` (not a silent hang).
Real in-process Dask cluster; the actors are real Dask actors whose calls block."""

import threading
from types import SimpleNamespace

import dask
import pytest

from rollart.control import checkpoint as ck
from rollart.runtime.waits import StuckError
from rollart.testing import cluster_fixture


class Blocking:
    """An actor whose state calls block until released (a stuck disk, a hung worker)."""

    def __init__(self):
        self.gate = threading.Event()

    def save_state(self, path):
        self.gate.wait(30)
        return {}

    def snapshot(self, path):
        return {}

    def load_state(self, path):
        self.gate.wait(30)

    def restore(self, path):
        return None

    def stats(self):
        return {"version": 1}

    async def release(self):  # on the worker's event loop: not behind a blocked call
        self.gate.set()


client = cluster_fixture(threads=4)


def test_a_stuck_save_and_restore_say_which_actor_and_checkpoint(client, tmp_path):
    trainer = client.submit(Blocking, actor=True).result()
    fine = client.submit(Blocking, actor=True).result()
    fine.release().result()
    actors = SimpleNamespace(trainer=trainer, buffer=fine)
    try:
        with dask.config.set({"rollart.waits.call": 1}):
            with pytest.raises(StuckError, match=r"Blocking on .* did not save its state "
                                                 r"\(checkpoint step 3 at .*step-0*3"):
                ck.save(str(tmp_path / "ck"), 3, actors)
            assert ck.steps(str(tmp_path / "ck")) == []  # no marker: not a checkpoint
            stub = SimpleNamespace(path=str(tmp_path / "ck" / "x"), state={})
            with pytest.raises(StuckError, match=r"did not load its state \(restoring "):
                ck.restore(stub, actors)
    finally:
        trainer.release().result()
