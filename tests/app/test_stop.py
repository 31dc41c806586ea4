"""``start_run(...).stop()`` during a long warm-up ends the run within seconds: the stop
reaches the trainer's warm-up (``Trainer.stop_warmup``), which ends after its current
step; no RL step runs, the warm-up model is saved and the run is ``stopped``."""

import time
from pathlib import Path

from rollart.app.api import start_run
from rollart.testing import tiny_graph

WARMUP_STEPS = 100_000  # hours on the tiny model: only a stop that reaches it ends it


def _warmup_done(client) -> int:
    """The warm-up steps the run's trainer has done (read on its worker)."""
    def probe(dask_worker):
        return [a.warmup_done for a in dask_worker.state.actors.values()
                if hasattr(a, "stop_warmup")]
    return max((n for ns in client.run(probe).values() for n in ns), default=0)


def test_stop_during_the_warm_up_ends_the_run_within_seconds(local_cluster, tmp_path):
    graph = tiny_graph("t-stop-warmup", steps=5, warmup_steps=WARMUP_STEPS)
    run = start_run(local_cluster, graph, run_dir=tmp_path / "run")
    deadline = time.time() + 300
    while _warmup_done(local_cluster) < 2:  # the warm-up is computing
        assert not run.done(), run.error
        assert time.time() < deadline, "the warm-up did not start in 300 s"
        time.sleep(0.2)
    t0 = time.time()
    run.stop()
    result = run.wait(timeout=60)  # generous: it takes a few seconds on a laptop
    assert time.time() - t0 < 60
    assert run.status == "stopped" and result.metrics == []
    assert _warmup_done(local_cluster) < WARMUP_STEPS
    assert Path(result.warmup_model_dir).is_dir() and Path(result.model_dir).is_dir()
