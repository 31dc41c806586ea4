"""One trajectory, turn by turn: env ↔ ``LLMProxy`` ↔ env … → reward task.

``TrajectoryRunner.run`` plays a task from a seed: reset, then per turn generate through
the ``LLMProxy`` and step the env, then score the episode on the REWARD pool (on a
thread of this worker when it carries the pool's tag, else as a Dask task there). Env
calls run in a thread pool it owns with a per-step time-out (or are awaited directly
when the env has ``areset``/``astep``), and the whole episode may have a per-trajectory
time-out (an owner's ``refresh`` hook runs at each turn boundary and before delivery:
``rollart.env.rescore``); an env or reward that raises, hangs or returns the wrong types
makes that trajectory ``failed`` with the error kept, and nothing else (a
``ChatTemplateError``, e.g. an agent's request the template can never serve, fails it
too; the buffer then tells the driver, which stops the run with it:
``rollart.buffer.arrivals.STOPS_RUN``). A timed-out env
is closed at once from a thread of its own (closing releases a hung call, so its pool
thread comes back); ``stuck_calls`` counts env calls and rewards that were given up on
(timed out) and still hold a thread. Used by ``EnvManager``.

How the turns become token ids is ``rollart.chat.conversation`` (the one definition,
shared with the warm-up and evaluation): raw concatenation or the tokenizer's chat
template, generated ids kept verbatim. A generation that calls tools (an env with
``tools``, chat format) is a tool turn: its calls are parsed in the task's tool format
and checked (``rollart.chat.tools.tool_calls``, ``check_calls``: the rule the warm-up
and evaluation share), each valid one run by ``env.call_tool`` on the env thread pool
with the step time-out, and its result (or the error of an invalid call, which costs
``Task.invalid_penalty``) returns as ``tool`` messages. A conversation that outgrows
the context budget ends ``truncated``. ``stats`` counts cut generations, truncations, tool
turns and invalid calls. A ``TurnBarrier`` (``rollart.env.barrier``), when given, makes
a batch of trajectories advance turn by turn (the synchronous baselines).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from rollart.agents.agent import agent_session, is_agent_task, play
from rollart.chat.conversation import ConversationFormat, TokenLog, cap_text
from rollart.chat.tool_formats import tool_format_of
from rollart.chat.tools import check_calls, tool_calls
from rollart.env.barrier import TurnBarrier
from rollart.env.protocol import (EnvOutputError, check_observation, check_step_result,
                                  check_tool_result, env_tools)
from rollart.reward import check_reward
from rollart.policy.affinity import reward_tag
from rollart.reward.dispatch import Dispatchers
from rollart.reward.offload import is_serverless
from rollart.types import Episode, GenRequest, TrajState, Trajectory
from rollart.runtime.waits import wait_result

# TokenLog, TurnBarrier, check_calls and tool_calls are re-exported from their homes
# (rollart.chat.conversation, rollart.env.barrier, rollart.chat.tools)
__all__ = ["StepTimeout", "TokenLog", "TrajectoryRunner", "TurnBarrier", "check_calls",
           "request_seed", "score_episode", "tool_calls"]

logger = logging.getLogger(__name__)
_TOOL_COUNTS = ("invalid_tool_calls", "tool_calls")  # ep.info keys the tool turns keep


class StepTimeout(TimeoutError):
    """One env call or reward took longer than its time-out."""


def score_episode(reward_fn, episode: Episode) -> float:
    """Run a reward function (a Dask task on the REWARD pool) and check its value."""
    return check_reward(reward_fn(episode), getattr(reward_fn, "__name__", repr(reward_fn)))


def request_seed(base: int, traj_id: str, turn: int) -> int:
    """A per-request sampling seed, stable across processes (no ``hash()``)."""
    return zlib.crc32(f"{base}/{traj_id}/{turn}".encode()) & 0x7FFFFFFF


class TrajectoryRunner:
    """Plays trajectories for an ``EnvManager`` (which owns one)."""

    def __init__(self, proxy, tokenizer, *, temperature: float = 1.0, top_p: float = 1.0,
                 env_step_timeout: float = 30.0, reward_timeout: float = 30.0,
                 trajectory_timeout: float | None = None,
                 inference_pools: tuple[str, ...] | None = None, seed: int = 0,
                 max_context: int = 2048, env_threads: int = 8, local_reward: bool = True,
                 conversation: str = "auto", system_prompt: str | None = None,
                 model_path: str | None = None):
        self.proxy = proxy
        self.tokenizer = tokenizer
        self.format = ConversationFormat(tokenizer, conversation, system_prompt=system_prompt,
                                         max_context=max_context, model_path=model_path)
        self.stop_ids = self.format.stop_ids
        self.counts = {"cut_generations": 0, "truncated": 0, "tool_turns": 0,
                       "invalid_tool_calls": 0, "bad_env_outputs": 0, "agent_calls": 0,
                       "agent_rewrites": 0, "agent_dropped_tokens": 0}
        self.temperature, self.top_p = temperature, top_p
        self.env_step_timeout, self.reward_timeout = env_step_timeout, reward_timeout
        self.trajectory_timeout = trajectory_timeout
        self.stuck_calls = 0  # env calls / rewards abandoned (timed out) still on a thread
        self._stuck_lock = threading.Lock()
        self.inference_pools = inference_pools
        self.seed = seed
        self.max_context = max_context
        self.env_threads = env_threads  # env calls at once (more wait: rollart.control.scaling)
        self._executor = ThreadPoolExecutor(max_workers=env_threads,
                                            thread_name_prefix="rollart-env")
        self.running: dict[str, str] = {}  # traj_id -> state
        self.env_latency: list[float] = []
        self.turns = 0
        self.turn_seconds = 0.0  # wall time of turns (generation + env + overhead)
        self.gen_seconds = 0.0
        self.env_seconds = 0.0
        self.barrier_wait = 0.0
        self.render_seconds = 0.0  # CPU seconds rendering and tokenising turns (loop)
        self.serverless = Dispatchers()  # serverless rewards: batched, retried
        self.local_reward = local_reward
        self._reward_slots: dict[str, asyncio.Semaphore | None] = {}  # tag -> slots here
        self._reward_executor: ThreadPoolExecutor | None = None
        self.rewards = {"here": 0, "tasks": 0}  # how rewards ran: on this worker / as tasks
        self._server = None  # the agent endpoint (rollart.agents.endpoint), made on first use
        self._agent_executor: ThreadPoolExecutor | None = None  # plain agent functions
        # ``await refresh(traj, task, log)`` at each turn boundary and once the reward is
        # in: the owner's chance to re-score stale tokens (rollart.env.rescore); None: off
        self.refresh = None

    def stats(self) -> dict:
        """Conversation counters, namespaced ``rollout/…`` (merged into
        ``EnvManager.stats``)."""
        return {f"rollout/{k}": v for k, v in self.counts.items()}

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._agent_executor.shutdown(wait=False, cancel_futures=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._reward_executor is not None:
            self._reward_executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, task, seed: int, traj_id: str, group_id: str, log: TokenLog,
                  barrier: TurnBarrier | None = None) -> Trajectory:
        """Play one trajectory to the end and score it; errors make it ``failed``."""
        ep = Episode(task.name, seed, [], [], [], {})
        traj = Trajectory(traj_id, task.name, group_id, seed, [], [], [], [], [])
        holder: list = []  # the env, once made (the episode may time out before)
        timed_out = False
        try:
            try:
                await asyncio.wait_for(self._episode(task, seed, log, ep, traj, barrier,
                                                     holder), self.trajectory_timeout)
            except asyncio.TimeoutError as e:
                if isinstance(e, StepTimeout):
                    raise
                raise TimeoutError(f"trajectory took longer than trajectory_timeout="
                                   f"{self.trajectory_timeout}s") from None
            finally:
                if barrier is not None:  # done with turns: the others stop waiting for it
                    barrier.leave()
            self.running[traj_id] = TrajState.SCORING.value
            traj.reward = await self._score(task, ep, traj_id)
            if self.refresh is not None:  # before delivery: no token below the bound
                await self.refresh(traj, task, log)
            traj.outcome = "success" if ep.info.get("success") else (
                "truncated" if ep.truncated else "failure")
            traj.state = TrajState.BUFFERED.value
        except asyncio.CancelledError as e:
            if asyncio.current_task().cancelling():
                raise  # this trajectory was cancelled (redundant, aborted, shut down)
            # something it awaited was cancelled (e.g. a reward future): a failure
            traj.state, traj.outcome = TrajState.FAILED.value, "failed"
            traj.error = f"CancelledError inside the trajectory: {e!r}"
        except Exception as e:  # contained: this trajectory fails, the run goes on
            if isinstance(e, EnvOutputError):
                self.counts["bad_env_outputs"] += 1
            traj.state, traj.outcome = TrajState.FAILED.value, "failed"
            traj.error = f"{type(e).__name__}: {e}"[:2000]
            timed_out = isinstance(e, TimeoutError)
        finally:
            self.running.pop(traj_id, None)
            self.proxy.release(traj_id)
            if holder:
                self._close_env(holder[0], urgent=timed_out or traj.state != "buffered")
        traj.prompt_ids, traj.response_ids = log.prompt_ids, log.response_ids
        traj.loss_mask, traj.logprobs, traj.versions = log.loss_mask, log.logprobs, log.versions
        traj.num_turns = len(ep.actions)
        return traj

    async def _episode(self, task, seed, log, ep, traj, barrier, holder) -> None:
        if is_agent_task(task):  # its agent plays it through the chat endpoint
            return await self._agent_episode(task, seed, log, ep, traj)
        env = await self._env_call(traj, task.env_factory)
        holder.append(env)
        obs = check_observation(await self._env_call(
            traj, env.reset, seed, is_async=hasattr(env, "areset")))
        await self._turns(task, env, obs, log, ep, traj, barrier)

    async def _agent_episode(self, task, seed, log, ep, traj) -> None:
        """An ``AgentTask``'s episode: its agent's calls to a route of this runner's
        endpoint (``rollart.agents.agent``), each a generation through the proxy."""
        if self._server is None:
            from rollart.agents.endpoint import AgentServer

            self._server = AgentServer()
            self._agent_executor = ThreadPoolExecutor(
                max_workers=256, thread_name_prefix="rollart-agent")
        top_p = self.top_p if getattr(task, "top_p", None) is None else task.top_p

        async def generate(req, call: int):
            self.running[traj.traj_id] = TrajState.GENERATING.value
            t0 = time.perf_counter()
            req = replace(req, temperature=self.temperature, top_p=top_p,
                          seed=request_seed(self.seed, traj.traj_id, call),
                          request_id=f"{traj.traj_id}/{call}")
            try:
                return await self.proxy.generate(traj.traj_id, req, self.inference_pools,
                                                 task=task.name)
            finally:
                dt = time.perf_counter() - t0
                traj.gen_time += dt
                self.gen_seconds += dt
                self.turns += 1
                self.running[traj.traj_id] = TrajState.IN_ENV.value

        session = agent_session(task, self.format, log, generate)
        self.running[traj.traj_id] = TrajState.IN_ENV.value
        try:
            done = await play(self._server, session, seed, self.env_step_timeout,
                              self._agent_executor)
        except Exception:
            if session.fatal is not None:  # the agent failed on a request refused as such
                raise session.fatal from None
            raise
        finally:
            c = session.counts
            for key, n in (("agent_calls", c.calls), ("agent_rewrites", c.rewrites),
                           ("agent_dropped_tokens", c.dropped_tokens),
                           ("invalid_tool_calls", c.invalid_tool_calls)):
                self.counts[key] += n
            self.counts["cut_generations"] += session.conv.cut if session.conv else 0
            traj.tool_calls, traj.invalid_tool_calls = c.tool_calls, c.invalid_tool_calls
        if session.fatal is not None:  # refused as never servable: the run stops with it
            raise session.fatal
        ep.observations, ep.actions = done.observations, done.actions
        ep.env_rewards, ep.info, ep.truncated = done.env_rewards, done.info, done.truncated
        if ep.truncated:
            self.counts["truncated"] += 1

    def _render(self, fn, *args):
        """``fn(*args)``, a conversation's rendering or tokenising, its CPU time
        (``time.thread_time``: the event loop's thread) added to ``render_seconds``."""
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.render_seconds += time.thread_time() - t0

    def _close_env(self, env, urgent: bool) -> None:
        """Close ``env`` off the loop. A failed/timed-out env may hold every pool thread
        (hung calls), so it gets a thread of its own: closing it releases those calls."""
        if urgent:
            threading.Thread(target=_close_quietly, args=(env,), daemon=True,
                             name="rollart-env-close").start()
        else:
            self._executor.submit(_close_quietly, env)

    def _stuck(self, delta: int) -> None:
        with self._stuck_lock:
            self.stuck_calls += delta

    def _held(self, cfut) -> bool:
        """A call given up on: cancel it, or, when it already runs, count its thread in
        ``stuck_calls`` until it returns. True when it runs on."""
        if cfut.cancel():
            return False
        self._stuck(1)
        cfut.add_done_callback(lambda _: self._stuck(-1))
        return True

    async def _turns(self, task, env, obs, log, ep, traj, barrier) -> None:
        tools = env_tools(env) if self.format.mode == "chat" else []
        conv = self._render(self.format.start, log, task, obs, tools)
        if tools:  # counted on the record (null: no tools offered)
            traj.tool_calls, traj.invalid_tool_calls = 0, 0
        budget = self.format.max_context
        ep.observations.append(cap_text(obs, budget))  # bounded: the reward travels
        try:
            for turn in range(task.max_turns):
                if barrier is not None:  # sync / one-off: the batch moves turn by turn
                    # (sync+ and the asynchronous modes pass none: each trajectory runs free)
                    t_wait = time.perf_counter()
                    await barrier.wait()
                    self.barrier_wait += time.perf_counter() - t_wait
                if conv.truncated or not conv.room(task.max_new_tokens):
                    ep.truncated = True
                    self.counts["truncated"] += 1
                    return
                if self.refresh is not None and turn:
                    await self.refresh(traj, task, log)
                t0 = time.perf_counter()
                env_before, gen_before = traj.env_time, traj.gen_time
                text = await self._generate(task, conv, traj, turn)
                calls = tool_calls(text, tool_format_of(self.format, task),
                                   tools) if tools else []
                if calls:
                    await self._tool_turn(task, env, tools, calls, conv, ep, traj)
                    done = False
                else:
                    done = await self._env_turn(task, env, text, conv, ep, traj)
                # counted per completed turn, all three together: a member cancelled
                # between its generation and the end of its env step has no turn here,
                # so its generation time must not count either
                self.turns += 1
                self.turn_seconds += time.perf_counter() - t0
                self.gen_seconds += traj.gen_time - gen_before
                self.env_seconds += traj.env_time - env_before
                if done:
                    return
            ep.truncated = True
        finally:
            self.counts["cut_generations"] += conv.cut

    async def _generate(self, task, conv, traj, turn: int) -> str:
        """One generation through the proxy, appended verbatim; the assistant text."""
        self.running[traj.traj_id] = TrajState.GENERATING.value
        t0 = time.perf_counter()
        top_p = self.top_p if getattr(task, "top_p", None) is None else task.top_p
        req = GenRequest(conv.log.ids, task.max_new_tokens, self.temperature, top_p,
                         self.stop_ids, request_seed(self.seed, traj.traj_id, turn),
                         request_id=f"{traj.traj_id}/{turn}", stop_strings=task.stop)
        res = await self.proxy.generate(traj.traj_id, req, self.inference_pools,
                                        task=task.name)
        gen = time.perf_counter() - t0
        traj.gen_time += gen
        return self._render(conv.add_generation, res.token_ids, res.logprobs, res.versions,
                            res.finish_reason)

    async def _env_turn(self, task, env, text: str, conv, ep, traj) -> bool:
        """``env.step`` on the parsed action; True when the episode is over."""
        action = task.parse_action(text)
        self.running[traj.traj_id] = TrajState.IN_ENV.value
        step = check_step_result(await self._env_call(
            traj, env.step, action, is_async=hasattr(env, "astep")), env)
        ep.actions.append(action)
        ep.env_rewards.append(float(step.reward))
        tool_counts = {k: ep.info[k] for k in _TOOL_COUNTS if k in ep.info}
        ep.info = {**step.info, **tool_counts}  # the last step's info + the tool counts
        ep.observations.append(cap_text(step.observation, self.format.max_context))
        if step.done:
            ep.truncated = bool(step.info.get("truncated", False))
            return True
        self._render(conv.add_user, step.observation)
        return False

    async def _tool_turn(self, task, env, tools, calls, conv, ep, traj) -> None:
        """Run the generation's tool calls; their results (or errors) go back to the
        model as ``tool`` messages. An invalid call costs ``task.invalid_penalty``."""
        self.running[traj.traj_id] = TrajState.IN_ENV.value
        self.counts["tool_turns"] += 1
        results, invalid = [], 0
        for checked in check_calls(calls, tools):
            if isinstance(checked, str):  # invalid: the model reads the error
                invalid += 1
                results.append(checked)
                continue
            out = await self._env_call(traj, env.call_tool, checked.name, checked.arguments)
            results.append(check_tool_result(out, env, checked.name))
        self.counts["invalid_tool_calls"] += invalid
        ep.info["invalid_tool_calls"] = ep.info.get("invalid_tool_calls", 0) + invalid
        ep.info["tool_calls"] = ep.info.get("tool_calls", 0) + len(calls)
        traj.tool_calls += len(calls)
        traj.invalid_tool_calls += invalid
        if invalid:
            ep.env_rewards.append(-float(task.invalid_penalty) * invalid)
        self._render(conv.add_tool_results, results)

    async def _env_call(self, traj, fn, *args, is_async: bool = False):
        """Call an env method off the event loop with the per-step time-out."""
        t0 = time.perf_counter()
        cfut = None
        if is_async:  # the env offers areset/astep: await it directly
            coro = getattr(fn.__self__, "a" + fn.__name__)(*args)
        else:
            cfut = self._executor.submit(fn, *args)
            coro = asyncio.wrap_future(cfut)
        try:
            return await asyncio.wait_for(coro, self.env_step_timeout)
        except asyncio.TimeoutError:
            name = getattr(fn, "__qualname__", "env")
            if cfut is not None and self._held(cfut):
                logger.warning("%s timed out and still holds an env thread until it "
                               "returns (closing the env should release it)", name)
            raise StepTimeout(f"{name} took longer than env_step_timeout="
                               f"{self.env_step_timeout}s") from None
        finally:
            dt = time.perf_counter() - t0
            traj.env_time += dt
            self.env_latency.append(dt)
            if len(self.env_latency) > 5000:
                del self.env_latency[:2500]

    async def _score(self, task, episode: Episode, traj_id: str) -> float:
        """Score the episode with the task's reward function on its pool (``REWARD``
        unless the reward declares ``reward_affinity(...)``).

        When this worker carries that pool's tag (``resources/laptop.py``), the reward
        runs here on a thread (``_score_here``): placement is the same, without a Dask
        task's trip through the scheduler. Otherwise it is a Dask task on the pool. Its
        wait is shielded: the Dask client batches concurrent gathers into one shared
        future, so cancelling this trajectory (redundant, aborted) must not cancel the
        gather that other trajectories' rewards are riding on. A ``@serverless`` reward
        goes to its own backend instead (``rollart.reward.dispatch``: batched, with its
        own time-outs and retries; one that fails for good raises ``RewardFailed``, so
        the trajectory is ``failed`` and counted as such).
        """
        from distributed import get_client

        if is_serverless(task.reward_fn):
            return await self.serverless.get(task.reward_fn).score(episode)

        tag = reward_tag(task)  # REWARD unless the reward declares reward_affinity(...)
        slots = self._slots_here(tag)
        if slots is not None:
            return await self._score_here(task.reward_fn, episode, slots)
        self.rewards["tasks"] += 1
        client = get_client()
        key = f"reward-{task.name}-{traj_id}-{uuid.uuid4().hex[:8]}"  # unique across runs
        fut = client.submit(score_episode, task.reward_fn, episode, resources={tag: 1},
                            pure=False, key=key)
        try:
            return await wait_result(fut, client, self.reward_timeout)
        except asyncio.TimeoutError:
            raise StepTimeout(f"reward {task.reward_fn!r} took longer than reward_timeout="
                               f"{self.reward_timeout}s") from None

    def _slots_here(self, tag: str) -> asyncio.Semaphore | None:
        """The reward slots of this worker for ``tag`` (as many as the worker has of the
        resource, as Dask would allow tasks), or None: not on a worker, the worker lacks
        the tag, or ``local_reward`` is off."""
        if tag not in self._reward_slots:
            n = 0
            if self.local_reward:
                try:
                    from distributed import get_worker

                    n = int(get_worker().state.total_resources.get(tag, 0))
                except (ImportError, ValueError):
                    n = 0
            self._reward_slots[tag] = asyncio.Semaphore(n) if n > 0 else None
            if n > 0 and self._reward_executor is None:  # spare threads for hung rewards
                self._reward_executor = ThreadPoolExecutor(
                    max_workers=n + 4, thread_name_prefix="rollart-reward")
        return self._reward_slots[tag]

    async def _score_here(self, reward_fn, episode: Episode, slots: asyncio.Semaphore):
        """Run the reward on a thread of this worker (``get_worker()`` works inside it),
        at most ``slots`` at once. The reward time-out counts from the request, waiting
        for a slot included, as for a Dask task; a reward that times out gives its slot
        back and keeps only its thread (counted in ``stuck_calls`` until it returns)."""
        self.rewards["here"] += 1
        try:
            return await asyncio.wait_for(self._reward_thread(reward_fn, episode, slots),
                                          self.reward_timeout)
        except asyncio.TimeoutError:
            raise StepTimeout(f"reward {reward_fn!r} took longer than reward_timeout="
                              f"{self.reward_timeout}s") from None

    async def _reward_thread(self, reward_fn, episode: Episode, slots: asyncio.Semaphore):
        async with slots:
            ctx = contextvars.copy_context()
            cfut = self._reward_executor.submit(ctx.run, score_episode, reward_fn, episode)
            try:
                return await asyncio.wrap_future(cfut)
            except asyncio.CancelledError:  # timed out, or the trajectory was cancelled
                self._held(cfut)
                raise


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:
        pass
