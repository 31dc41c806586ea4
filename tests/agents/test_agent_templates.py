"""Agent tasks against a chat template that ignores ``tools=`` (issue 54), trained on a
real in-process cluster with a real tokenizer and model folder built here: with
``AgentTask(tools_in_prompt=True)`` the Parquet rows' prompts hold the tool schemas (as an
env task's would); without it the run stops at the first request, from the command line
with one line and exit code 2, not after a failure storm. The agent's history rewrites
reach the metrics rows (``rollout/agent_*``)."""

import json
import time

import pytest

openai = pytest.importorskip("openai", reason="the agents here use the openai client")

from rollart.testing import ADD_TOOL, CHATML_SPECIALS, bpe_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # ~40 s on 2 cores

#: ChatML that never shows ``tools=`` (as many small models' templates)
NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM, QUESTION = "you play a game", "what is 2 plus 3 ?"


def add_agent(endpoint, seed):
    """Asks with ``tools``, then summarises its history (a new prompt, counted)."""
    c = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    c.chat.completions.create(model=endpoint.model, messages=msgs, tools=[ADD_TOOL])
    msgs[1] = {"role": "user", "content": QUESTION + " again"}
    out = c.chat.completions.create(model=endpoint.model, messages=msgs, tools=[ADD_TOOL])
    return float(len(out.choices[0].message.content or "") % 2)


def graph(tools_in_prompt: bool = False):
    """One agent task on a model folder given by ``--model`` (or ``Policy.model``)."""
    from rollart import GRPO, AgentTask, Graph, Policy

    task = AgentTask(name="add_agent", agent=add_agent, max_turns=2, max_new_tokens=6,
                     tools_in_prompt=tools_in_prompt)
    return Graph(name="agent_tools", tasks=(task,), steps=1,
                 policy=Policy(model=None, conversation="chat", warmup_steps=0),
                 algo=GRPO(group_size=2, groups_per_step=2))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from rollart.testing import save_folder, tiny_qwen2

    tok = bpe_tokenizer(CHATML_SPECIALS, NO_TOOLS, eos="<|im_end|>", pad="<|endoftext|>")
    return save_folder(tmp_path_factory.mktemp("model") / "m", tiny_qwen2(tok), tok)


@pytest.fixture(scope="module")
def cluster():
    from dataclasses import replace

    from rollart.runtime.resources import load_resources

    res = replace(load_resources(), processes=False, dashboard_address=":0")
    with res.make_cluster() as c:
        yield c


def test_tools_in_prompt_reach_the_trained_prompt_and_rewrites_the_metrics(
        folder, cluster, tmp_path):
    from dataclasses import replace

    from distributed import Client

    from rollart import train
    from rollart.buffer import read_samples
    from rollart.chat.template_support import tools_prompt
    from rollart.model import load_tokenizer

    g = graph(tools_in_prompt=True)
    g = replace(g, policy=replace(g.policy, model=folder))
    with Client(cluster) as client:
        result = train(g, client=client, run_dir=tmp_path / "run", progress=False,
                       eval_seeds=0)
    rows = read_samples(result.run_dir).to_pylist()
    assert rows and all(r["outcome"] != "failed" for r in rows), rows[0]["error"]
    tok = load_tokenizer(folder)
    for r in rows:  # the second (rewritten) prompt, with the tools in its system turn
        prompt = tok.decode(r["prompt_ids"])
        assert prompt.startswith("<|im_start|>system\n" + tools_prompt([ADD_TOOL], SYSTEM))
        assert json.dumps(ADD_TOOL) in prompt and QUESTION + " again" in prompt
    (row,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    # every finished trajectory rewrote once, dropping its first reply (>= 1 token);
    # one cancelled while it ran may have made a call without
    rewrites = row["rollout/agent_rewrites"]
    assert rewrites >= row["trainer/batch_size"] >= 1
    assert row["rollout/agent_calls"] >= 2 * rewrites
    assert row["rollout/agent_dropped_tokens"] >= rewrites


def test_tools_the_template_ignores_stop_the_run_with_one_line_and_rc_2(
        folder, cluster, tmp_path, capfd):
    from rollart.app.cli import main

    t0 = time.monotonic()
    rc = main(["train", "test_agent_templates:graph", "--model", folder, "--resources",
               cluster.scheduler_address, "--run-dir", str(tmp_path / "run"),
               "--no-progress", "--eval-seeds", "0", "--set", "rollout.failure_streak_limit=50"])
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and "never retrieved" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rollart: error:")]
    assert len(lines) == 1, err
    assert "'add_agent'" in lines[0] and "AgentTask(tools_in_prompt=True)" in lines[0]
    assert "FailureStorm" not in err and "resume" not in lines[0]
    assert took < 60, took
