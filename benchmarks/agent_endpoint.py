"""The agent endpoint's cost: a chat completion through it against the same generation
called directly, and an agent task's trajectories/s beside the same game as an env task.

Side by side in one run, on one cluster of worker processes, as ``rollart train``
starts (``resources/local.py``; ``--in-process``: threads of this process, where the
endpoint's and the clients' Python competes with the engine for one GIL): an
``InferenceWorker`` on ``H800``, the callers on ``CPU_ENV``, a model folder built here
(a byte-level BPE with a ChatML template and a tiny Qwen2 of ``--hidden`` width, random
weights, so every generation runs to ``--max-new`` tokens and both sides do the same
work):

1. **Per call** (``endpoint_overhead``): ``--agents`` concurrent conversations of
   ``--calls`` turns each (the user says ``go on .`` between turns). *direct*: each
   turn is ``Conversation`` bookkeeping plus ``LLMProxy.generate`` on the actor's loop,
   as the trajectory runner does for an env. *endpoint*: each turn is an
   ``openai.AsyncOpenAI`` chat completion to rollart's endpoint on that same loop (an
   ``AgentSession`` behind it; the agent resends its history, as agents do). Both use
   the same request seeds, so they generate the same ids (checked). The figure is the
   mean call latency through the endpoint over the direct one, minus 1 (goal: <= 0.10
   at 32 agents). Rounds alternate the sides; the median over rounds is reported.
2. **Per trajectory** (``agent_vs_env_traj_s``): ``EnvManager.run_group`` of
   ``--groups`` groups of ``--group-size`` at once on ``graphs/agent.py``'s two tasks, the game
   ``guess`` as an env task and ``guess_agent`` (the same game played by an
   ``openai``-client agent on a thread), alternating; trajectories/s of the agent task
   over the env task's.

With a tiny random model a generation is cheap, so the endpoint's fixed cost (HTTP, JSON,
the client's parsing, on the same 2 cores) weighs more than it would beside a real
model's decode: the figure is an upper bound of the overhead. Profiled (cProfile, the
garbage collector frozen): about 5.5 ms of CPU a call on the callers' loop, most of it
in the ``openai`` client's own request and response handling (``_transform``: 1.6 ms),
not in the endpoint; the agents' clients are made before the timed calls (~20 ms each,
an SSL context: the agent's cost, which on a shared loop delayed other calls).

Each invocation appends one record to ``benchmarks/results/agent_endpoint.jsonl``
(date, commit, load average before, command, figures). Run it alone on an idle machine::

    flock /tmp/rollart-bench.lock python benchmarks/agent_endpoint.py
    python benchmarks/agent_endpoint.py --quick      # a smoke run

RESULT keys: ``endpoint_overhead`` (median over rounds), ``endpoint_overhead_min`` /
``_max``, ``call_ms_direct`` / ``call_ms_endpoint`` (median mean latency of a call),
``agent_vs_env_traj_s`` (median ratio), ``traj_s_env`` / ``traj_s_agent``, ``agents``,
``calls``, ``max_new``, ``rounds``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results.py

from _results import Run, add_arguments  # noqa: E402


class CallBench:
    """An actor on the env pool: both sides' conversations on its event loop."""

    def __init__(self, proxy, model_path: str):
        from rollart.chat.conversation import ConversationFormat
        from rollart.model import load_tokenizer

        self.proxy = proxy
        self.fmt = ConversationFormat(load_tokenizer(model_path), "chat", max_context=2048)
        self.server = None

    def _request(self, conv, max_new: int, key: str, call: int):
        from rollart.env.trajectory import request_seed
        from rollart.types import GenRequest

        return GenRequest(conv.log.ids, max_new, 1.0, 1.0, self.fmt.stop_ids,
                          request_seed(0, key, call), request_id=f"{key}/{call}")

    async def direct(self, agents: int, calls: int, max_new: int, tag: str) -> dict:
        from rollart.chat.conversation import Conversation, TokenLog

        async def one(i: int):
            conv = Conversation.of_messages(self.fmt, TokenLog(), [
                {"role": "user", "content": f"you play a game {i} . go"}])
            lat = []
            for call in range(calls):
                t0 = time.perf_counter()
                res = await self.proxy.generate(f"{tag}-{i}", self._request(
                    conv, max_new, f"a{i}", call))
                conv.add_generation(res.token_ids, res.logprobs, res.versions,
                                    res.finish_reason)
                if call < calls - 1:
                    conv.add_messages([{"role": "user", "content": "go on ."}])
                lat.append(time.perf_counter() - t0)
            self.proxy.release(f"{tag}-{i}")
            return lat, conv.log.response_ids

        return self._summary(await asyncio.gather(*(one(i) for i in range(agents))))

    async def endpoint(self, agents: int, calls: int, max_new: int, tag: str) -> dict:
        import openai

        from rollart.agents.agent import AgentTask, agent_session
        from rollart.chat.conversation import TokenLog
        from rollart.agents.endpoint import AgentServer

        if self.server is None:
            self.server = AgentServer()
        task = AgentTask(name="bench", agent=_unused, max_turns=calls,
                         max_new_tokens=max_new)

        def opened(i: int):
            async def generate(req, call):
                req = self._request(session.conv, req.max_new_tokens, f"a{i}", call)
                return await self.proxy.generate(f"{tag}-{i}", req)

            session = agent_session(task, self.fmt, TokenLog(), generate)
            ep = self.server.open(session, i)
            return session, ep, openai.AsyncOpenAI(base_url=ep.base_url,
                                                   api_key=ep.api_key, max_retries=0)

        # the agents' clients are made before the calls start: making one (an SSL
        # context, ~20 ms of CPU) is the agent's cost, and on this shared loop it would
        # delay the other agents' calls in flight
        agents = [opened(i) for i in range(agents)]

        async def one(i: int):
            session, ep, client = agents[i]
            messages, lat = [{"role": "user", "content": f"you play a game {i} . go"}], []
            for call in range(calls):
                t0 = time.perf_counter()
                out = await client.chat.completions.create(model=ep.model,
                                                           messages=messages)
                lat.append(time.perf_counter() - t0)
                messages += [out.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "go on ."}]
            await client.close()
            self.server.close(ep)
            self.proxy.release(f"{tag}-{i}")
            return lat, session.log.response_ids

        return self._summary(await asyncio.gather(*(one(i) for i in range(len(agents)))))

    @staticmethod
    def _summary(results) -> dict:
        lat = [x for r, _ in results for x in r]
        return {"mean_s": statistics.fmean(lat), "ids": [ids for _, ids in results]}


def _unused(endpoint, seed):  # the benchmark drives the endpoint itself
    raise RuntimeError("not called")


def _model(path: Path, hidden: int) -> str:
    from rollart.testing import (CHATML, CHATML_SPECIALS, bpe_tokenizer, save_folder,
                                 tiny_qwen2)

    tok = bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    return save_folder(path, tiny_qwen2(tok, hidden_size=hidden), tok)


def _traj_rate(mgr, task, groups: int, size: int, seed: int) -> float:
    """Trajectories/s of ``groups`` groups of ``task`` run at once, each free (as the
    asynchronous modes run them)."""
    t0 = time.perf_counter()
    calls = [mgr.run_group(task, seed + g, f"{task.name}-{seed}-{g}", size)
             for g in range(groups)]
    out = [c.result() for c in calls]
    dt = time.perf_counter() - t0
    failed = [o for s in out for o in s["outcomes"] if o == "failed"]
    assert not failed, f"{len(failed)} {task.name} trajectories failed"
    return groups * size / dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--in-process", action="store_true",
                    help="the cluster as threads of this process (tests, profiling)")
    add_arguments(ap)
    args = ap.parse_args(argv)
    run = Run("agent_endpoint", args, argv)
    if args.quick:
        args.agents, args.calls, args.hidden, args.rounds, args.groups = 4, 2, 64, 1, 2

    from distributed import Client

    from graphs.agent import tasks as agent_graph_tasks
    from rollart.buffer import SampleBuffer
    from rollart.env.manager import EnvManager
    from rollart.model import load_model
    from rollart.rollout import InferenceWorker, LLMProxy
    from rollart.runtime.resources import load_resources
    from rollart.types import CPU_ENV, H800
    from rollart.weights import WeightStore

    overhead, direct_ms, endpoint_ms, env_rate, agent_rate = [], [], [], [], []
    env_task, agent_task = (replace(t, max_new_tokens=args.max_new)
                            for t in agent_graph_tasks())
    with tempfile.TemporaryDirectory(prefix="rollart-agent-bench-") as tmp:
        model = _model(Path(tmp) / "model", args.hidden)
        store = str(Path(tmp) / "weights")
        WeightStore(store).put(0, load_model(model).state_dict())
        res = replace(load_resources(), processes=not args.in_process,
                      dashboard_address=":0")
        with res.make_cluster() as cluster, Client(cluster) as client:
            worker = client.submit(InferenceWorker, model, store, pool=H800, actor=True,
                                   resources={H800: 1}).result()
            proxy = LLMProxy([(worker, H800)])
            bench = client.submit(CallBench, proxy, model, actor=True,
                                  resources={CPU_ENV: 1}).result()
            buf = client.submit(SampleBuffer, None, actor=True,
                                resources={CPU_ENV: 1}).result()
            mgr = client.submit(EnvManager, proxy, buf, model, actor=True,
                                resources={CPU_ENV: 1}, conversation="chat").result()
            bench.direct(2, 1, 2, "warm").result()  # compile paths, fill caches
            bench.endpoint(2, 1, 2, "warm").result()
            for r in range(args.rounds):
                order = ("direct", "endpoint") if r % 2 == 0 else ("endpoint", "direct")
                got = {side: getattr(bench, side)(args.agents, args.calls, args.max_new,
                                                  f"{side}-{r}").result() for side in order}
                assert got["direct"]["ids"] == got["endpoint"]["ids"], \
                    "the two sides generated different ids: not the same work"
                d, e = got["direct"]["mean_s"], got["endpoint"]["mean_s"]
                overhead.append(e / d - 1)
                direct_ms.append(1000 * d)
                endpoint_ms.append(1000 * e)
                tasks = (env_task, agent_task) if r % 2 == 0 else (agent_task, env_task)
                rates = {t.name: _traj_rate(mgr, t, args.groups, args.group_size, 100 * r)
                         for t in tasks}
                env_rate.append(rates[env_task.name])
                agent_rate.append(rates[agent_task.name])
            mgr.close().result()
    ratios = [a / e for a, e in zip(agent_rate, env_rate)]
    # unrounded: the RESULT line gives 4 significant digits (a call of 2.3 ms rounded to
    # 0.1 ms would be 2% off the overhead it is printed beside)
    out = {"endpoint_overhead": statistics.median(overhead),
           "endpoint_overhead_min": min(overhead), "endpoint_overhead_max": max(overhead),
           "call_ms_direct": statistics.median(direct_ms),
           "call_ms_endpoint": statistics.median(endpoint_ms),
           "agent_vs_env_traj_s": statistics.median(ratios),
           "traj_s_env": statistics.median(env_rate),
           "traj_s_agent": statistics.median(agent_rate),
           "agents": args.agents, "calls": args.calls, "max_new": args.max_new,
           "hidden": args.hidden, "rounds": args.rounds,
           "processes": int(not args.in_process)}
    run.result(out, {"overhead_rounds": overhead, "agent_vs_env_rounds": ratios})
    return out


if __name__ == "__main__":
    main()
