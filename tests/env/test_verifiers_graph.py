"""graphs/verifiers.py trains end to end on a real in-process cluster: a verifiers (v1)
taskset, each trajectory one verifiers rollout against rollart's endpoint scored by
verifiers' reward, beside the same sums as an env task (the chat toy is warmed up on
its text). No trajectory fails, the verifiers task has rows that decode to its prompt
and answer, and evaluation plays it too."""

import json
from dataclasses import replace

import pytest

pytest.importorskip("verifiers.v1", reason="the verifiers graph needs verifiers")
pytest.importorskip("openai", reason="the verifiers adapter's harness uses openai")

from rollart import load_graph, train  # noqa: E402
from rollart.buffer import read_samples  # noqa: E402
from rollart.model import load_tokenizer  # noqa: E402
from rollart.runtime.resources import load_resources  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_verifiers_taskset_trains_from_a_graph_file(tmp_path):
    from distributed import Client

    graph, _ = load_graph("verifiers")
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
    assert any("reward/sums_verifiers" in r for r in rows)
    samples = read_samples(result.run_dir).to_pylist()
    ours = [s for s in samples if s["task"] == "sums_verifiers"]
    assert ours and not [s["error"] for s in ours if s["outcome"] == "failed"]
    tok = load_tokenizer(result.model_dir)
    for s in ours:
        text = tok.decode(s["prompt_ids"] + s["response_ids"])
        # verifiers sent the task's prompt as the user turn; one assistant answer
        assert text.startswith("<|im_start|>user\nsum : ") and text.count(
            "<|im_start|>assistant\n") == 1
        assert 1 <= sum(s["loss_mask"]) <= graph.tasks[1].max_new_tokens
        assert s["reward"] in (0.0, 1.0)
    assert set(result.evaluation["trained"]) == {"sums", "sums_verifiers"}
