"""The new modes recover as the others do (tests/faults/test_recovery.py's run: an env, an
inference and the trainer's worker die mid-run) in ``sync+`` and ``areal``. A module of
its own: its in-process cluster must not run while another module's client is open (a
second in-process cluster's actor calls hung then, as in tests/faults/test_durability.py)."""

import pyarrow.compute as pc
import pytest

from rollart import GRPO
from rollart.buffer import read_samples
from rollart.testing import check_run_record


@pytest.mark.parametrize("mode", ["sync+", "areal"])
def test_new_modes_survive_losing_env_inference_and_trainer_workers(tmp_path, mode):
    """tests/faults/test_recovery.py's run (an env, an inference and the trainer's worker die)
    in the new modes: the run completes, the ledger adds up with nothing left in
    flight, no trajectory is trained twice."""
    from rollart.types import CPU_ENV, H20, TRAIN
    from test_recovery import run_losing_env_inference_and_trainer

    result, killed = run_losing_env_inference_and_trainer(
        tmp_path, f"t-recovery-{mode}", mode=mode, algo=GRPO(group_size=2, groups_per_step=3))
    assert [tag for tag, _ in killed] == [CPU_ENV, H20, TRAIN]
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, 8))
    check_run_record(result)  # the ledger against the trainer's reports and the rows
    assert {e["role"] for e in result.recovery} == {"env", "inference", "trainer"}
    final = result.final_counts
    assert final["in_flight"] == 0
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))["traj_id"].to_pylist()
    assert len(trained) == len(set(trained))
    if mode == "areal":
        assert all(r["traj/aborted"] == 0 for r in rows)

