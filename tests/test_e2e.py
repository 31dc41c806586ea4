"""End to end: the default multi-task graph trains on a local tagged cluster and the
policy really learns — held-out success rises above the warm-up policy's on every task;
the chat graph (``graphs/chat.py:quick``) learns too, and its Parquet rows decode to
well-formed ChatML conversations with the loss mask exactly on the assistant's tokens.

Marked ``learning`` (the default graph's 80-step run is ~6 min on 2 cores, the chat
graph's ~5): deselected from ``python -m pytest``, whose suite stays within its 15-minute
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
# graphs/chat.py:quick (the three games in chat format on the chat toy, 60 steps after
# its 150-step warm-up) on the laptop layout (the CLI's worker processes): 6.0 min under
# the lock on the shared 2-core machine (load ~3), held-out gains (128 seeds): gridnav
# 0.23 -> 0.30, guess 0.38 -> 0.48, boxpush 0.31 -> 0.45 (an earlier run, before the
# template cache and the async slots fix, 13 min: 0.05, 0.16, 0.11). After the chat toy's
# tokenizer change (rollart.model.CHAT_SPLIT; 6.9 min under the lock, load 2.5-3.7):
# gridnav 0.20 -> 0.20, guess 0.34 -> 0.38, boxpush 0.36 -> 0.50 (the bounds hold). The
# full graph (100 steps with calc, 22.8 min at load 5-8): gridnav +0.17, guess +0.06,
# boxpush +0.19, calc -0.02. The bounds sit about two standard errors (one is ~0.057 for
# a gain, ~0.033 for the mean of three) below the quick runs, so a run that learns
# passes and one that does not fails.
# With the warm-up at lr 1e-3 (graphs/chat.py WARMUP_LR; the figures above were at 3e-3):
# gridnav 0.16 -> 0.46 (+0.30), guess 0.38 -> 0.53 (+0.15), boxpush 0.27 -> 0.47 (+0.20),
# 4.7 min in all for this test on the 2-core machine, 2026-12-02 22:24 UTC (one run; the
# full graph's three seeds at 1e-3: docs/benchmarks/). The bounds sit two or more standard
# errors below that: gridnav and boxpush must gain, guess must not fall, and the mean of
# the three must gain 0.08 (a run that does not learn has a mean near 0, sd ~0.035).
# The test stays under the `learning` marker (deselected by default, ~5 min); .ci/run
# runs it as its own step. The graph's GRPO scales advantages by the batch's reward std
# since 2026-12-03 (scale_rewards="batch", for calc; these bounds were measured with the
# per-group std, and the full graph's games gained as much or more with "batch" on three
# seeds: docs/benchmarks/). The full chat graph's calc learns on two seeds of three (ibid.).
CHAT_GAMES = ("gridnav", "guess", "boxpush")
# the least gain per task the quick run must show
CHAT_MIN_GAIN = {"gridnav": 0.05, "guess": -0.05, "boxpush": 0.05}
CHAT_MIN_MEAN_GAIN = 0.08  # over the three games (measured 0.22)
TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    from distributed import Client

    graph, _ = load_graph("graphs/chat.py:quick")
    res = replace(load_resources("laptop"), processes=False, dashboard_address=":0")
    run_dir = tmp_path_factory.mktemp("e2e-chat") / "run"
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = train(graph, client=client, run_dir=run_dir, progress=False, eval_seeds=128)
    return result


@pytest.mark.learning  # ~6 min on 2 shared cores: deselected by default (python -m pytest -m learning)
@pytest.mark.timeout(1800)  # the fixture's run: ~6 min on 2 shared cores, 13 when busier
def test_chat_graph_learns_above_the_warmup_policy(chat_run):
    ev = chat_run.evaluation
    print("chat held-out success, warm-up -> trained:", ev)
    assert set(ev["trained"]) == set(CHAT_GAMES)
    gains = {t: ev["trained"][t] - ev["warmup"][t] for t in CHAT_GAMES}
    assert all(gains[t] >= g for t, g in CHAT_MIN_GAIN.items()), (gains, ev)
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
    graph, _ = load_graph("graphs/chat.py:quick")
    max_new = {t.name: t.max_new_tokens for t in graph.tasks}
    rows = [r for r in read_samples(chat_run.run_dir).to_pylist() if r["state"] == "trained"]
    assert len(rows) >= 60 * 96
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
