"""Chat: how a trajectory becomes token ids, and how models write tool calls.

Consumes a tokenizer (its chat template), a task's system prompt and tools, the env's
text and the ids the policy generated; produces token ids with a loss mask
(``conversation``: raw concatenation or the chat template, token in, token out; its
renders cached by ``template_cache``; templates that re-render a growing conversation
kept as appended deltas by ``deltas``), what a template can and cannot do
(``template_support``), the env's action read out of the assistant's text
(``actions``), and parsed, checked tool calls in each model family's syntax
(``tool_formats``, ``tools``). It knows nothing of envs or actors: the env managers'
trajectory runner (``rollart.env.trajectory``), the agent endpoint (``rollart.agents``),
the trainer's warm-up and held-out evaluation all call it, so a model is trained, warmed
up and evaluated on one format.
"""
