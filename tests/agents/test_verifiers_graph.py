"""graphs/verifiers.py trains end to end on a real in-process cluster: a verifiers (v1)
taskset, each trajectory one verifiers rollout against rollart's endpoint scored by
verifiers' reward, beside the same sums as an env task (the chat toy is warmed up on
its text). No trajectory fails, the verifiers task has rows that decode to its prompt
and answer, and evaluation plays it too."""

import pytest

pytest.importorskip("verifiers.v1", reason="the verifiers graph needs verifiers")
pytest.importorskip("openai", reason="the verifiers adapter's harness uses openai")

from test_agent_graph import train_briefly  # noqa: E402 (tests/agents/)

pytestmark = pytest.mark.slow


def test_a_verifiers_taskset_trains_from_a_graph_file(tmp_path):
    graph, result, ours, tok = train_briefly("verifiers", "sums_verifiers", tmp_path)
    for s in ours:
        text = tok.decode(s["prompt_ids"] + s["response_ids"])
        # verifiers sent the task's prompt as the user turn; one assistant answer
        assert text.startswith("<|im_start|>user\nsum : ") and text.count(
            "<|im_start|>assistant\n") == 1
        assert 1 <= sum(s["loss_mask"]) <= graph.tasks[1].max_new_tokens
        assert s["reward"] in (0.0, 1.0)
    assert set(result.evaluation["trained"]) == {"sums", "sums_verifiers"}
