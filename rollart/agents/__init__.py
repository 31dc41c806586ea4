"""Agents: a user's own agent loop trained through an OpenAI-compatible endpoint.

Consumes an agent function (``AgentTask(name, agent, max_turns)``, ``agent(endpoint,
seed)``) and the policy's chat format; produces episodes whose token ids are exactly the
ones the policy generated (``agent``: ``AgentSession`` turns each chat completion into a
generation on the trajectory's token log) and serves the HTTP side (``endpoint``: one
``AgentServer`` per env manager, a route per trajectory). The env managers' trajectory
runner (``rollart.env.trajectory``) and held-out evaluation (``rollart.observe.evaluate``)
play agent tasks; an ``AgentTask`` is a ``rollart.env.tasks.Task``, so a graph mixes them
with env tasks. ``rollart.AgentTask`` and ``rollart.AgentEndpoint`` are the public names.
"""
