"""End to end: the default multi-task graph trains on a local tagged cluster and the
policy really learns — held-out success rises above the warm-up policy's on every task;
the chat graph (``graphs/chat.py``, the tool-calling calc included) learns on every task
too, and its games' Parquet rows decode to well-formed ChatML conversations with the loss
mask exactly on the assistant's tokens.

Marked ``learning`` (the default graph's 80-step run is ~6 min on 2 cores, the chat
graph's ~15-20): deselected from ``python -m pytest``, whose suite stays within its 15-minute
budget; ``.ci/run`` runs both as a step of its own
(``python -m pytest -m learning tests/test_e2e.py``).
"""

import json
import re
from collections import Counter
from dataclasses import replace

import pytest

from rollart import load_graph, train
from rollart.buffer import read_samples
from rollart.buffer.schema import SCHEMA
from rollart.model import load_model
from rollart.runtime.resources import cluster_tags, load_resources

# one 80-step training run shared by the module (in-process cluster: ~5 min on 2 cores,
# with room for a slower CI machine). Measured held-out gains at 80 steps: gridnav 0.58,
# guess 0.16, boxpush 0.63 (at 60 steps guess gained only 0.12: too close to the bound)
pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(1200)]
STEPS = 80


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from distributed import Client

    graph, _ = load_graph()  # graphs/multitask.py, as `rollart train` runs it
    graph = replace(graph, steps=STEPS)
    res = load_resources()
    res = replace(res, processes=False, dashboard_address=":0")
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    with res.make_cluster() as cluster, Client(cluster) as client:
        tags = cluster_tags(client)
        result = train(graph, client=client, run_dir=run_dir, progress=False, eval_seeds=128)
    return result, tags


# In the default suite again: with two steps' worth of async slots gridnav gained only
# 0.055 / 0.078 (rollart.control.modes.asynchronous.slot_capacity says why); with one step's
# worth the same run gained gridnav 0.61, guess 0.21, boxpush 0.60.
def test_reward_rises_above_the_warmup_policy_on_every_task(run):
    result, _ = run
    ev = result.evaluation
    print("held-out success, warm-up -> trained:", ev)
    gains = {t: ev["trained"][t] - ev["warmup"][t] for t in ("gridnav", "guess", "boxpush")}
    # every task clearly better than the warm-up policy (128 held-out seeds: a gain of
    # 0.1 is > 2 standard errors), and a large gain on average
    assert all(g >= 0.1 for g in gains.values()), (gains, ev)
    assert sum(gains.values()) / 3 >= 0.25, (gains, ev)


def test_metrics_log_has_per_task_reward_and_accounting(run):
    result, _ = run
    rows = result.metrics
    samples = read_samples(result.run_dir)
    trained_at = Counter(s for s, state in zip(samples.column("trained_step").to_pylist(),
                                               samples.column("state").to_pylist())
                         if state == "trained")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert {"time", "traj/trained", "traj/dropped", "traj/failed", "traj/in_flight",
                "traj/aborted", "traj/cancelled"} <= set(r)
        assert r["trainer/staleness_max"] <= 1  # alpha = 1
        # the ledger's trained count against the Parquet rows trained by this step (the
        # row is written after the step's train_step confirmed its batch: mark_trained)
        assert r["traj/trained"] == sum(n for s, n in trained_at.items() if s <= r["step"])
    assert all(any(r[f"reward/{t}"] is not None for r in rows)  # every row has every key
               for t in ("gridnav", "guess", "boxpush"))
    with open(f"{result.run_dir}/metrics.jsonl") as f:
        assert len(f.readlines()) == STEPS


def test_run_directory_outputs(run):
    result, _ = run
    d = result.run_dir
    samples = read_samples(d)
    assert samples.schema.equals(SCHEMA, check_metadata=False)
    assert samples.num_rows >= STEPS * 96
    # rows that left, and (from the buffer's journal) groups still buffered at the end
    assert set(samples.column("state").to_pylist()) <= {"trained", "dropped", "failed",
                                                         "buffered"}
    import os

    assert os.path.getsize(f"{d}/reward.png") > 5000
    load_model(result.model_dir)
    assert json.load(open(f"{d}/eval.json"))["seeds"] == 128


def test_every_actor_ran_on_its_tag(run):
    result, tags = run
    placement = json.load(open(f"{result.run_dir}/placement.json"))
    assert tags[placement["trainer"][0]] == {"TRAIN": 1, "BUFFER": 1}
    assert placement["buffer"] == placement["trainer"]  # off the env pool
    assert {next(iter(tags[a])) for a in placement["inference"]} == {"H800", "H20"}
    assert all(tags[a] == {"CPU_ENV": 1} for a in placement["env"])


# -- the chat graph ----------------------------------------------------------------------
# graphs/chat.py whole: the three games and the tool-calling calc in chat format on the
# chat toy (its two-stage warm-up, 450 steps, then 100 RL steps), on the laptop layout in
# process. Every task must gain, calc included (issue 42 item 7: no negative floor).
# Measured: this test, 2026-12-05 (19.8 min with other work on the 2 cores, load 5-6),
# 256 held-out seeds paired per seed: gridnav 0.23 -> 0.61, guess 0.38 -> 0.97, boxpush
# 0.35 -> 0.48, calc 0.22 -> 0.88; the graph's three seeds on an idle machine
# (docs/benchmarks/history.md, 128-256 seeds): gains gridnav +0.24..+0.50, guess
# +0.06..+0.64, boxpush +0.38..+0.60, calc +0.34..+0.69. A gain's standard error is
# ~0.04 at 256 paired seeds: each task must gain more than 0.02 (a task that does not
# learn passes that about a third of the time) and the four on average 0.15 (the lowest
# seed's mean was 0.28; a run that does not learn has a mean near 0, sd ~0.02).
# The earlier form of this test ran graphs/chat.py:quick (the three games, 60 steps,
# guess allowed to fall 0.05).
CHAT_GRAPH = "graphs/chat.py"
CHAT_EVAL_SEEDS = 256
CHAT_TASKS = ("gridnav", "guess", "boxpush", "calc")
CHAT_MIN_GAIN = 0.02  # every task
CHAT_MIN_MEAN_GAIN = 0.15  # over the four
TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    from distributed import Client

    graph, _ = load_graph(CHAT_GRAPH)
    res = replace(load_resources("laptop"), processes=False, dashboard_address=":0")
    run_dir = tmp_path_factory.mktemp("e2e-chat") / "run"
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = train(graph, client=client, run_dir=run_dir, progress=False,
                       eval_seeds=CHAT_EVAL_SEEDS)
    return result


@pytest.mark.learning  # ~15 min on 2 cores: deselected by default (python -m pytest -m learning)
@pytest.mark.timeout(2700)  # the fixture's run: 19.8 min on 2 cores shared with other work
def test_chat_graph_learns_above_the_warmup_policy(chat_run):
    ev = chat_run.evaluation
    print("chat held-out success, warm-up -> trained:", ev)
    assert set(ev["trained"]) == set(CHAT_TASKS)
    gains = {t: ev["trained"][t] - ev["warmup"][t] for t in CHAT_TASKS}
    assert all(g > CHAT_MIN_GAIN for g in gains.values()), (gains, ev)
    assert sum(gains.values()) / len(gains) >= CHAT_MIN_MEAN_GAIN, (gains, ev)
    saved = json.load(open(f"{chat_run.run_dir}/eval.json"))
    assert saved["warmup"] == ev["warmup"] and saved["trained"] == ev["trained"]


def _mask_runs(mask):
    runs, start = [], 0
    for j in range(1, len(mask) + 1):
        if j == len(mask) or mask[j] != mask[start]:
            runs.append((start, j, mask[start]))
            start = j
    return runs


def check_chatml_row(tok, row, max_new: int) -> list[dict]:
    """Assert ``row`` decodes to ChatML turns in order with the loss mask exactly on the
    assistant's tokens and their ``<|im_end|>``; return the messages."""
    end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    prompt = tok.decode(row["prompt_ids"], skip_special_tokens=False)
    assert TURN.findall(prompt) == ["user", "assistant"], prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n"), prompt
    messages = [{"role": "user", "content": prompt.split("\n", 1)[1].split("<|im_end|>")[0]}]
    resp, mask = row["response_ids"], row["loss_mask"]
    assert len(mask) == len(resp) and mask[:1] == [1]
    for k, (a, b, m) in enumerate(_mask_runs(mask)):
        ids = resp[a:b]
        if m == 1:  # the policy's tokens, ended by <|im_end|> (or another eos), or cut
            stopped = ids[-1] in (end, eot)
            assert stopped or len(ids) == max_new, ids
            assert not {end, eot} & set(ids[:-1])
            content = ids[:-1] if stopped else ids
            messages.append({"role": "assistant",
                             "content": tok.decode(content, skip_special_tokens=False)})
            continue
        # rollart's tokens: the end-of-turn token when the policy did not write it, then
        # "\n", one user turn and the next assistant prompt
        text = tok.decode(ids, skip_special_tokens=False)
        closed = resp[a - 1] == end
        assert text.startswith("\n" if closed else "<|im_end|>\n"), (text, resp[a - 1])
        assert TURN.findall(text) == ["user", "assistant"], text
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n"), text
        messages.append({"role": "user", "content": text.split("user\n", 1)[1]
                        .split("<|im_end|>")[0]})
    return messages


def _renders_alike(tok, gen, end, special) -> bool:
    """A generation a re-render gives back: its own <|im_end|>, no other special token,
    text that re-encodes to the same ids and no whitespace at its ends (which the
    template's "\n" would merge with)."""
    from rollart.model import encode

    text = tok.decode(gen[:-1])
    return (gen[-1] == end and not special & set(gen[:-1]) and text == text.strip()
            and encode(tok, text) == gen[:-1])


@pytest.mark.learning  # shares the chat run above
def test_chat_parquet_rows_decode_to_chatml_conversations(chat_run):
    from rollart.model import encode, load_tokenizer

    tok = load_tokenizer(chat_run.model_dir)
    graph, _ = load_graph(CHAT_GRAPH)
    max_new = {t.name: t.max_new_tokens for t in graph.tasks}
    rows = [r for r in read_samples(chat_run.run_dir).to_pylist() if r["state"] == "trained"]
    assert len(rows) >= graph.steps * graph.algo.group_size * graph.algo.groups_per_step
    # the games' rows (calc's carry a system turn with its tools and tool turns: their
    # rendering is checked by tests/env/test_tool_formats.py and the tool-task tests)
    rows = [r for r in rows if r["task"] != "calc"]
    end, special = tok.convert_tokens_to_ids("<|im_end|>"), set(tok.all_special_ids)
    clean = 0
    for row in rows:
        messages = check_chatml_row(tok, row, max_new[row["task"]])
        roles = [m["role"] for m in messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2)
        gens = [row["response_ids"][a:b] for a, b, m in _mask_runs(row["loss_mask"]) if m]
        if roles[-1] != "assistant" or any(not _renders_alike(tok, g, end, special)
                                           for g in gens):
            continue  # kept verbatim, so unlike a re-render (token in, token out)
        # every turn the policy's own text and <|im_end|>: the ids are the template's render
        ids = row["prompt_ids"] + row["response_ids"]
        full = encode(tok, tok.apply_chat_template(messages, tokenize=False))
        assert full[:len(ids)] == ids and tok.decode(full[len(ids):]) == "\n"
        clean += 1
    assert clean >= len(rows) // 2, (clean, len(rows))
