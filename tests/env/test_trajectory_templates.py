"""The trajectory runner (``rollart.env.trajectory``) under a chat template whose rendering
moves as the conversation grows (a Mistral-v0.3-style one from tests/tool_families.py:
tools before the last user turn, strict alternation): a three-turn tool episode (a
call, a wrong answer, the right one after a new user turn) runs to success, and its row
holds the ids the policy saw: each prompt given to the engine is a prefix of the row,
and the generated ids stand exactly at the loss-masked positions. And (slow) the chat
graph trains on such a folder with no calc trajectory failing."""

import json
import logging
from pathlib import Path

import pytest

from rollart.chat.tool_formats import get_tool_format
from rollart.env.tasks import Task
from rollart.env.trajectory import TrajectoryRunner
from rollart.testing import ADD_TOOL, bpe_tokenizer, play_episode
from rollart.types import GenResult, StepResult
from tool_families import MISTRAL_SPECIALS, MISTRAL_V03  # tests/

REPO = Path(__file__).resolve().parents[2]
QUESTION = "what is 2 plus 3 ?"


class AddTwiceEnv:
    """Asks a sum with an ``add`` tool; a wrong answer gets "try again ." (a new user
    turn, so the template moves its tools block); the right one ends it."""

    tools = [ADD_TOOL]

    def reset(self, seed):
        return QUESTION

    def call_tool(self, name, arguments):
        return str(arguments["a"] + arguments["b"])

    def step(self, action):
        if action == "5":
            return StepResult("done .", 1.0, True, {"success": True})
        return StepResult("try again .", 0.0, False, {})

    def close(self):
        pass


class RecordingProxy:
    """Generates the given texts in turn (each ending with ``stop``) and keeps each
    request's prompt ids and the ids it returned."""

    def __init__(self, tok, texts, stop):
        self.tok, self.texts, self.stop = tok, list(texts), stop
        self.prompts, self.generated = [], []

    async def generate(self, traj_id, req, pools, task=None):
        self.prompts.append(list(req.prompt_ids))
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.stop]
        self.generated.append(ids)
        return GenResult(ids, [-0.5] * len(ids), [0] * len(ids), "stop")

    def release(self, traj_id):
        pass


def _reward(episode):
    return float(episode.info.get("success", False))


def test_a_tool_episode_under_a_moving_template_trains_on_the_ids_the_policy_saw():
    tok = bpe_tokenizer(MISTRAL_SPECIALS, MISTRAL_V03, eos="</s>")
    tok.bos_token = "<s>"
    call = get_tool_format("mistral").format("add", {"a": 2, "b": 3})
    proxy = RecordingProxy(tok, [call, "4", "5"], tok.eos_token_id)
    runner = TrajectoryRunner(proxy, tok, conversation="chat", max_context=1024,
                              system_prompt="you add numbers")
    assert runner.format.tool_format == "mistral"  # detected from the template
    task = Task("add", AddTwiceEnv, _reward, max_turns=3, max_new_tokens=60)
    ep, log = play_episode(runner, task)
    assert ep.info["success"] and ep.actions == ["4", "5"] and ep.info["tool_calls"] == 1
    row = log.prompt_ids + log.response_ids  # what the buffer stores
    assert len(proxy.prompts) == 3
    for prompt in proxy.prompts:  # every prompt the engine got is a prefix of the row
        assert row[:len(prompt)] == prompt
    # the generated ids stand verbatim right after each prompt, and the loss mask is 1
    # on exactly them
    mask = [0] * len(log.prompt_ids) + log.loss_mask
    expected = [0] * len(row)
    for prompt, ids in zip(proxy.prompts, proxy.generated):
        assert row[len(prompt):len(prompt) + len(ids)] == ids
        expected[len(prompt):len(prompt) + len(ids)] = [1] * len(ids)
    assert mask == expected
    logprobs = [0.0] * len(log.prompt_ids) + log.logprobs
    assert [lp for lp, m in zip(logprobs, mask) if m] == [-0.5] * sum(mask)
    text = tok.decode(row)
    assert text.count("[AVAILABLE_TOOLS]") == 2  # moved before the new user turn: appended
    assert text.endswith("[INST] try again .[/INST]5</s>")
    assert '[TOOL_RESULTS] {"content": "5"}[/TOOL_RESULTS]4</s>' in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_chat_graph_trains_calc_on_a_moving_template(tmp_path, caplog):
    """``rollart train graphs/chat.py --model`` a Mistral-v0.3-style folder, with a system
    prompt: no calc trajectory fails (before delta mode every one did, with
    ``ConversationError: the chat template renders a conversation differently once a
    message is added``), calc's tool format is the template's, and the console says so
    in one line."""
    from dataclasses import replace

    from rollart.app.cli import main
    from rollart.buffer import read_samples
    from rollart.runtime.resources import load_resources
    from rollart.testing import save_folder, tiny_qwen2

    tok = bpe_tokenizer(MISTRAL_SPECIALS, MISTRAL_V03, eos="</s>")
    tok.bos_token = "<s>"
    folder = save_folder(tmp_path / "model", tiny_qwen2(tok), tok)
    res = replace(load_resources("laptop"), processes=False, dashboard_address=":0")
    with caplog.at_level(logging.WARNING), res.make_cluster() as cluster:
        code = main(["train", str(REPO / "graphs" / "chat.py"), "--model", folder,
                     "--steps", "2", "--resources", cluster.scheduler_address,
                     "--run-dir", str(tmp_path / "run"), "--eval-seeds", "0",
                     "--no-progress", "--set", "policy.system_prompt=you play"])
    assert code == 0
    last = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert last["task/received/calc"] > 0 and last["task/failed/calc"] == 0
    assert last["traj/failed"] == 0
    said = [r.getMessage() for r in caplog.records
            if "renders a conversation differently" in r.getMessage()]
    assert len(said) == 1 and "(tasks calc)" in said[0], said
    rows = [r for r in read_samples(str(tmp_path / "run")).to_pylist() if r["task"] == "calc"]
    assert rows
    for row in rows[:8]:  # each opens as the template renders calc's first prompt
        text = tok.decode(row["prompt_ids"] + row["response_ids"])
        assert text.startswith("<s>[AVAILABLE_TOOLS]") and "[INST] you play\n\n" in text
