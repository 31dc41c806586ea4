"""Chaos: envs that misbehave or cost on purpose, wrapped around any task.

Consumes a task (a ``rollart.env.tasks.Task`` or a built-in name) and a declaration of
what goes wrong; produces a copy of the task whose envs do it, reproducibly from seeds:
``faults`` (``with_faults(task, Faults(...))``: slow start-up, heavy-tailed step
latency, crashes and hangs; ``without_faults`` undoes it) and ``workload``
(``with_workload(task, Workload(...))``: envs that burn CPU and wait like pooled agentic
sandboxes). Used by tests, benchmarks and the simulator (``rollart.sim``) to stress the
rollout stage; the warm-up, held-out evaluation and the chat toy's corpus unwrap a task
with ``without_faults`` (injected latency says nothing about the policy).
``rollart.Faults``, ``rollart.Latency``, ``rollart.with_faults`` and
``rollart.straggler_profile`` are the public names.
"""
