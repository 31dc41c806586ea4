"""Held-out evaluation of a model folder on tasks, in one process, without Dask.

All episodes advance in lock step: each round batches every live episode's next turn
into one ``TorchEngine.generate`` call. Conversations are built exactly as rollout
builds them (``rollart.chat.conversation``: raw text or the chat template, the task's
stop strings and ``parse_action``, tool turns for an env with tools), so held-out success measures the policy that
rollout trains. Used at the end of ``rollart train`` (warm-up policy vs trained policy
on seeds training never saw) and by the learning test.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from rollart.chat.conversation import ConversationFormat, TokenLog, context_budget
from rollart.chaos.faults import without_faults
from rollart.env.protocol import env_tools
from rollart.env.tasks import is_agent_task
from rollart.chat.tool_formats import tool_format_of
from rollart.chat.tools import check_calls, tool_calls
from rollart.env.trajectory import request_seed
from rollart.types import GenRequest

logger = logging.getLogger(__name__)
AGENT_IDLE_S = 300.0  # an agent's own time between two calls, at most (else it failed)


def evaluate(model_path: str, tasks, seeds, *, temperature: float = 1.0,
             max_batch: int = 256, sample_seed: int = 12345, conversation: str = "auto",
             system_prompt: str | None = None,
             max_context: int | None = None) -> dict[str, float]:
    """Success rate per task name over ``seeds`` (sampling at ``temperature``).

    An episode that outgrows the context budget (``max_context``, default the model
    config's) counts as a failure, as a truncated rollout does.
    """
    from rollart.rollout.engine import TorchEngine

    seeds = list(seeds)
    engine = TorchEngine(model_path, max_batch=max_batch,
                         prefix_cache=max(512, len(seeds)))
    fmt = ConversationFormat(engine.tokenizer, conversation, system_prompt=system_prompt,
                             max_context=context_budget(model_path, max_context),
                             model_path=model_path)
    return {task.name: _success_rate(engine, fmt, task, seeds, temperature, sample_seed)
            for task in (without_faults(t) for t in tasks)}


def _success_rate(engine, fmt, task, seeds, temperature, sample_seed) -> float:
    if is_agent_task(task):  # its agent plays, through the endpoint
        return asyncio.run(_agent_success(engine, fmt, task, seeds, temperature,
                                          sample_seed))
    episodes = []
    for seed in seeds:
        env = task.env_factory()
        tools = env_tools(env) if fmt.mode == "chat" else []
        conv = fmt.start(TokenLog(), task, env.reset(seed), tools)
        episodes.append({"env": env, "conv": conv, "tools": tools, "done": False,
                         "success": False, "key": f"eval-{task.name}-{seed}",
                         "seed": seed})
    try:
        for turn in range(task.max_turns):
            live = [e for e in episodes if not e["done"]]
            for e in live:  # out of room: over, as a truncated trajectory is
                if e["conv"].truncated or not e["conv"].room(task.max_new_tokens):
                    e["done"] = True
            live = [e for e in live if not e["done"]]
            if not live:
                break
            # cache_key: an episode's next turn forwards only its new tokens (the
            # engine's prefix cache, sized to the batch)
            # an episode's sampling seed is keyed on its held-out seed (not its place among
            # the live ones), so two evaluations of the same seeds (the warm-up policy and
            # the trained one) sample each episode alike: paired per seed
            reqs = [GenRequest(e["conv"].log.ids, task.max_new_tokens, temperature, 1.0,
                               fmt.stop_ids,
                               request_seed(sample_seed, f"{task.name}-{e['seed']}", turn),
                               stop_strings=task.stop, cache_key=e["key"])
                    for e in live]
            for e, res in zip(live, engine.generate(reqs)):
                text = e["conv"].add_generation(res.token_ids, finish_reason=res.finish_reason)
                calls = tool_calls(text, tool_format_of(fmt, task),
                                   e["tools"]) if e["tools"] else []
                if calls:  # a tool turn, as in rollout
                    e["conv"].add_tool_results([
                        c if isinstance(c, str) else e["env"].call_tool(c.name, c.arguments)
                        for c in check_calls(calls, e["tools"])])
                    continue
                step = e["env"].step(task.parse_action(text))
                if step.done:
                    e["done"], e["success"] = True, bool(step.info.get("success"))
                else:
                    e["conv"].add_user(step.observation)
    finally:
        for e in episodes:
            e["env"].close()
    return sum(e["success"] for e in episodes) / max(len(episodes), 1)


# -- agent tasks ----------------------------------------------------------------------------
async def _agent_success(engine, fmt, task, seeds, temperature, sample_seed) -> float:
    """Success rate of an ``AgentTask``: every seed's agent at once against a local
    endpoint, their calls batched into the engine. A failed episode counts as a failure
    (a warning says how many failed, and the first error)."""
    from rollart.agents.agent import agent_session, play
    from rollart.agents.endpoint import AgentServer

    server, batcher = AgentServer(), _Batcher(engine)
    pool = ThreadPoolExecutor(max_workers=max(min(len(seeds), 64), 1),
                              thread_name_prefix="rollart-eval-agent")
    errors: list[str] = []

    async def one(seed) -> bool:
        async def generate(req, call: int):
            return await batcher.generate(replace(
                req, temperature=temperature, top_p=1.0, cache_key=f"eval-{task.name}-{seed}",
                seed=request_seed(sample_seed, f"{task.name}-{seed}", call)))

        session = agent_session(task, fmt, TokenLog(), generate)
        try:
            done = await play(server, session, seed, AGENT_IDLE_S, pool)
        except Exception as e:  # noqa: BLE001 - counted, named below
            errors.append(f"{type(e).__name__}: {e}"[:300])
            return False
        return bool(done.info.get("success"))

    try:
        wins = await asyncio.gather(*(one(s) for s in seeds))
    finally:
        server.stop()
        pool.shutdown(wait=False, cancel_futures=True)
    if errors:
        logger.warning("evaluation of %s: %d of %d agent episodes failed (counted as "
                       "failures); the first: %s", task.name, len(errors), len(seeds),
                       errors[0])
    return sum(wins) / max(len(wins), 1)


class _Batcher:
    """Concurrent agents' generations, batched into ``engine.generate`` on a thread:
    what arrives while a batch runs goes into the next."""

    def __init__(self, engine):
        self.engine, self.pending, self.running = engine, [], None

    async def generate(self, req):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((req, fut))
        if self.running is None or self.running.done():
            self.running = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # the calls of this loop turn join the batch
        while self.pending:
            batch, self.pending = self.pending, []
            try:
                results = await asyncio.to_thread(self.engine.generate,
                                                  [r for r, _ in batch])
            except Exception as e:  # noqa: BLE001 - each caller gets the error
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)
