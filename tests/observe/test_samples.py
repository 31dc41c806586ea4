"""Decoding stored trajectories: the loss mask splits a row into observation / action turns,
in the raw format and in the chat template's (its role turns left out), as rollout's own
conversation code built them."""

import pytest

from rollart.chat.conversation import ConversationFormat, TokenLog
from rollart.env.tasks import get_task
from rollart.observe.samples import decode, format_trajectory, select


def _row(fmt, task, turns):
    """A stored row of a conversation built the way rollout builds it."""
    log = TokenLog()
    conv = fmt.start(log, task, turns[0][0])
    for i, (obs, action) in enumerate(turns):
        if i:
            conv.add_user(obs)
        ids = list(fmt.tokenizer.encode(action, add_special_tokens=False))
        ids.append(fmt.stop_ids[0])
        conv.add_generation(ids, versions=[i + 2] * len(ids))
    return {"traj_id": "t-1", "task": task.name, "seed": 5, "reward": 1.0,
            "outcome": "success", "state": "trained", "version": 2, "num_turns": len(turns),
            "error": "", "prompt_ids": log.prompt_ids, "response_ids": log.response_ids,
            "loss_mask": log.loss_mask, "versions": log.versions}


TURNS = [("gridnav : goal 2 left . act :", "left"),
         ("gridnav : goal 1 left . act :", "left")]


def test_raw_rows_decode_to_their_turns(tiny_model):
    from rollart.model import load_tokenizer

    fmt = ConversationFormat(load_tokenizer(tiny_model), "raw")
    t = decode(_row(fmt, get_task("gridnav"), TURNS), fmt.tokenizer)
    assert [(x["observation"], x["action"], x["version"]) for x in t["turns"]] == \
        [(TURNS[0][0], "left", 2), (TURNS[1][0], "left", 3)]
    text = format_trajectory(t)
    assert "turn 2 action (v3): left" in text and "outcome: success, reward 1.000" in text


def test_chat_rows_decode_without_the_templates_role_turns(tmp_path):
    from rollart.corpus import chat_corpus
    from rollart.model import build_tiny_model, load_tokenizer

    task = get_task("gridnav")
    path = build_tiny_model(str(tmp_path / "chat"), chat_corpus([task]), chat=True)
    fmt = ConversationFormat(load_tokenizer(path), "chat")
    assert fmt.mode == "chat"
    t = decode(_row(fmt, task, TURNS), fmt.tokenizer)
    obs = [x["observation"] for x in t["turns"]]
    assert obs[1] == TURNS[1][0] and obs[0].endswith(TURNS[0][0])  # after a system prompt
    assert [x["action"] for x in t["turns"]] == ["left", "left"]


def test_select_keeps_the_latest_per_task_in_written_order():
    pa = pytest.importorskip("pyarrow")
    rows = [{"task": k, "state": s, "i": i} for i, (k, s) in enumerate(
        [("a", "trained"), ("b", "trained"), ("a", "dropped"), ("a", "trained"),
         ("b", "failed")])]
    table = pa.Table.from_pylist(rows)
    assert [r["i"] for r in select(table, n=1)] == [3, 4]
    assert [r["i"] for r in select(table, n=2)] == [1, 2, 3, 4]
    assert [r["i"] for r in select(table, task="a", state="trained", n=5)] == [0, 3]
