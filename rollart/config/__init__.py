"""What a run is made of: the graph, ``--set`` overrides, the checks before a run starts.

Consumes a graph module or a ``Graph(...)`` (``graph``: Graph, Policy, GRPO, Rollout;
``training``: LoRA, TrainerParallel), ``--set FIELD=VALUE`` overrides (``overrides``) and
the cluster or resources a run gets; produces a checked ``Graph`` (task names resolved
through ``rollart.env.tasks``; a mistake is a ``GraphError`` saying what to change) and,
before a cluster or a model is made, the start checks (``preflight``; ``templates``: the
tasks against the model's chat template). Called by the control plane, the CLI and the
simulator; no data-plane package imports it (the stages take plain values).
"""
