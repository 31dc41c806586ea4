"""rollart's cluster-scale simulator: a whole rollart cluster in simulated time.

The simulator (``simulate(SimConfig) -> SimResult``, ``rollart.sim.cluster``) calls the
same policy objects the runtime calls — routing (``rollart.policy.routing.Router``),
the staleness bound (``rollart.policy.staleness.StalenessBound``), redundancy
(``rollart.policy.redundancy.Redundancy``), the buffer's slots
(``rollart.policy.admission.Slots``/``GroupSequence``), the elastic reward pool's scaling
(``rollart.policy.scaling.Scaling``) — with the cost models of ``rollart.sim.costs`` in
place of engines, envs, rewards, trainer and weight transfers (a version's way to the
workers, from one store node or relayed from the trainer gang: ``rollart.sim.fanout``).
``rollart.sim.calibrate`` measures this machine and checks the simulator against a real
run; ``rollart.sim.paper`` holds the paper's experiments. ``benchmarks/cluster_sim.py``
runs them all.

>>> from rollart.sim import ClusterSpec, GPUPool, SimConfig, simulate  # doctest: +SKIP
>>> from rollart import Graph                                          # doctest: +SKIP
>>> cfg = SimConfig(ClusterSpec((GPUPool("H20", "H20", 8),)), Graph(), steps=2)  # doctest: +SKIP
>>> simulate(cfg).throughput["trajectories_s"]                         # doctest: +SKIP
"""

from rollart.sim.config import (ClusterSpec, EnvPool, GPUPool, RewardPool, SimConfig,
                                SimConfigError, SimResult, TaskShape)

__all__ = ["ClusterSpec", "EnvPool", "GPUPool", "RewardPool", "SimConfig",
           "SimConfigError", "SimResult", "TaskShape", "simulate"]


def simulate(config: SimConfig) -> SimResult:
    """Run ``config`` in simulated time; see ``rollart.sim.cluster.simulate``."""
    from rollart.sim.cluster import simulate as run

    return run(config)
