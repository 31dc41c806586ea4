"""graphs/agent.py trains end to end on a real in-process cluster: an ``openai``-client
agent (``play_guess``) beside the same game as an env task, the chat toy warmed up on
the env task's text. The agent's Parquet rows decode to the chat turns it sent, with the
loss on generated tokens only, as the env task's do; evaluation plays the agent too."""

import json
from dataclasses import replace

import pytest

pytest.importorskip("openai", reason="the agent graph's agent uses the openai client")

from rollart import load_graph, train  # noqa: E402
from rollart.buffer import read_samples  # noqa: E402
from rollart.model import load_tokenizer  # noqa: E402
from rollart.runtime.resources import load_resources  # noqa: E402

pytestmark = pytest.mark.slow  # ~30 s on 2 cores


def test_an_openai_client_agent_trains_from_a_graph_file(tmp_path):
    from distributed import Client

    graph, _ = load_graph("agent")
    graph = replace(graph, steps=2, policy=replace(graph.policy, warmup_steps=2,
                                                   warmup_batch=8),
                    algo=replace(graph.algo, group_size=2, groups_per_step=4))
    res = replace(load_resources(), processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = train(graph, client=client, run_dir=tmp_path / "run", progress=False,
                       eval_seeds=3)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/group_errors"] == 0 for r in rows)
    assert any(r.get("reward/guess_agent") is not None for r in rows)
    samples = read_samples(result.run_dir).to_pylist()
    agent = [s for s in samples if s["task"] == "guess_agent"]
    assert agent and not [s["error"] for s in agent if s["outcome"] == "failed"]
    tok = load_tokenizer(result.model_dir)
    for s in agent:
        text = tok.decode(s["prompt_ids"] + s["response_ids"])
        # the agent's first message is the game's observation, as the env task's is
        assert text.startswith("<|im_start|>user\nguess : pick")
        mask = s["loss_mask"]
        runs = [j for j in range(len(mask)) if mask[j] and (j == 0 or not mask[j - 1])]
        # one run of trained ids per assistant turn, each right after the template's
        # generation prompt and at most max_new_tokens long; nothing else is trained
        turns = text.count("<|im_start|>assistant\n")
        assert len(runs) == turns >= 1 and sum(mask) <= turns * graph.tasks[1].max_new_tokens
        ids = s["prompt_ids"] + s["response_ids"]
        start = len(s["prompt_ids"])
        for j in runs:
            assert tok.decode(ids[:start + j]).endswith("<|im_start|>assistant\n")
        assert all(v == -1 for v, m in zip(s["versions"], s["loss_mask"]) if not m)
        assert all(v >= 0 for v, m in zip(s["versions"], s["loss_mask"]) if m)
    assert set(result.evaluation["trained"]) == {"guess", "guess_agent"}
