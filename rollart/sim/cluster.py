"""The simulator's engine: a rollart cluster as simpy processes, driven by the runtime's
own policy objects.

Consumes a ``SimConfig`` (``rollart.sim.config``); produces a ``SimResult``. Called by
``rollart.sim.simulate``, ``rollart.sim.paper``, ``rollart.sim.calibrate`` and
``benchmarks/cluster_sim.py``.

What is simulated (and what is aggregated to stay fast at thousands of GPUs):

* **Env managers**: each trajectory is one simpy process (an event chain, not a thread):
  env reset, then per turn a generation request and an env step (``EnvCost``
  latencies, failures and retries), then its reward and the buffer. A trajectory holds
  one of its env pool's slots while it lives (``EnvManager``'s ``max_concurrency``).
* **Inference workers**: one object per worker (``tp`` GPUs) batching many requests
  continuously; it wakes only at arrivals and completions (never per decode step):
  between two events its batch and step time (``GenCost.decode_step_s``) are constant.
  Prefill (``GenCost.prefill_s``, minus the tokens its prefix cache holds for a sticky
  trajectory) pauses the batch's decoding. Requests are routed by the runtime's
  ``Router``; PD (prefill pool → KV transfer → decode pool) follows the task's affinity.
* **Reward** on a dedicated pool (fixed workers) or the elastic pool, scaled by the
  runtime's ``Scaling`` with cold starts (``RewardCost``).
* **Buffer and trainer**: the runtime's ``Slots``/``GroupSequence`` admit groups; the
  trainer step (``TrainCost``) takes ``groups_per_step`` groups that the runtime's
  ``StalenessBound`` calls fresh, publishes a version; workers pull it (``WeightSync``:
  exposed pull time) at their next step boundary and re-prefill in-flight contexts.
* **Modes** ``sync``, ``sync+``, ``one-off``, ``areal``, ``async`` (``rollart.sim.modes``).
* **Control plane**: Dask messages counted per turn and per step, their cost
  (``ControlPlane``) summed into scheduler and driver load.
"""
