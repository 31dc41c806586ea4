"""graphs/agent.py trains end to end on a real in-process cluster: an ``openai``-client
agent (``play_guess``) beside the same game as an env task, the chat toy warmed up on
the env task's text. The agent's Parquet rows decode to the chat turns it sent, with the
loss on generated tokens only, as the env task's do; evaluation plays the agent too."""

import pytest

pytest.importorskip("openai", reason="the agent graph's agent uses the openai client")

import graph_runs  # noqa: E402 (tests/)
from rollart.model import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # ~30 s on 2 cores


def train_briefly(name: str, task: str, tmp_path):
    """``graph_runs.train_briefly`` of graph ``name``; ``task`` has a reward in a row and
    rows. Returns ``(graph, result, task's rows, tokenizer)``; the verifiers graph's test
    uses it too."""
    graph, result, rows = graph_runs.train_briefly(name, tmp_path / "run")
    assert any(r.get(f"reward/{task}") is not None for r in result.metrics)
    mine = [s for s in rows if s["task"] == task]
    assert mine
    return graph, result, mine, load_tokenizer(result.model_dir)


def test_an_openai_client_agent_trains_from_a_graph_file(tmp_path):
    graph, result, agent, tok = train_briefly("agent", "guess_agent", tmp_path)
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
