"""The chat toy (``build_tiny_model(chat=True)``), its corpus, and chat-folder loading."""

import json
import os
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from rollart.env.adapters.tool import calc_tool_task
from rollart.corpus import chat_corpus, task_texts
from rollart.env.tasks import Task
from rollart.chat.tools import ToolCall, parse_tool_calls, python_tool
from rollart.model import (
    CHAT_SPECIALS,
    CHAT_TAGS,
    ModelFolderError,
    build_chat_tokenizer,
    build_tiny_model,
    check_model_folder,
    decode,
    default_dtype,
    encode,
    load_model,
    load_tokenizer,
)

TEXTS = ["gridnav : goal 2 right 1 up . act :", "guess : higher . left 6 8 9 7 . act :",
         "line one\nline two\n\n  indented\ttab", "naïve café — 3×4 = 12 ✓ 日本",
         '<tool_call>\n{"name": "python", "arguments": {"code": "7 * 8"}}\n</tool_call>',
         "<|im_start|>user\nhi<|im_end|>\n", ""]


@pytest.fixture(scope="module")
def tasks():
    return ("gridnav", "guess", "boxpush", calc_tool_task(tool_format="hermes"))


@pytest.fixture(scope="module")
def corpus(tasks):
    return chat_corpus(tasks, seeds=range(6))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, corpus):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("chat") / "m", corpus, chat=True,
                            hidden_size=32)


def test_corpus_has_the_tasks_text_without_a_vocabulary(corpus):
    assert any(t.startswith("gridnav : goal") for t in corpus)
    assert any(t.startswith("boxpush") for t in corpus)
    assert json.dumps(python_tool()) in corpus  # the tool declaration
    calls = [t for t in corpus if t.startswith("<tool_call>")]
    assert calls and all(isinstance(parse_tool_calls(c)[0], ToolCall) for c in calls)
    # repeats are kept (BPE counts them): the declaration is in every calc episode
    assert corpus.count(json.dumps(python_tool())) == 6


def test_tool_results_follow_their_calls():
    texts = task_texts(calc_tool_task(tool_format="hermes"), range(8))
    calls = [i for i, t in enumerate(texts) if t.startswith("<tool_call>")]
    assert calls
    for i in calls:  # the sandbox ran the call; its result is the next text
        code = parse_tool_calls(texts[i])[0].arguments["code"]
        assert texts[i + 1] == str(eval(code))
    assert chat_corpus(("gridnav",), seeds=range(6)) == chat_corpus(("gridnav",), seeds=range(6))


def test_corpus_needs_a_warmup_action():
    from rollart.env.builtin.gridnav import GridNavEnv
    from rollart.reward.functions import success_with_invalid_penalty

    task = Task("nowarm", GridNavEnv, success_with_invalid_penalty, max_turns=2)
    with pytest.raises(ValueError, match="no warmup_action"):
        chat_corpus([task])


def test_ids_survive_save_autotokenizer_and_load_tokenizer(chat_dir, corpus):
    built = build_chat_tokenizer(corpus)
    ours, auto = load_tokenizer(chat_dir), AutoTokenizer.from_pretrained(chat_dir)
    for text in TEXTS + corpus[:40]:
        ids = encode(built, text)
        assert encode(ours, text) == ids, text
        assert list(auto.encode(text, add_special_tokens=False)) == ids, text
    assert ours.get_vocab() == built.get_vocab() == auto.get_vocab()
    msgs = [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": "up"}]
    assert (ours.apply_chat_template(msgs, tools=[python_tool()], tokenize=False)
            == auto.apply_chat_template(msgs, tools=[python_tool()], tokenize=False))


def test_layout_specials_and_size(chat_dir):
    tok = load_tokenizer(chat_dir)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == list(CHAT_SPECIALS)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for tag in (*CHAT_SPECIALS, *CHAT_TAGS):
        assert len(encode(tok, tag)) == 1, tag  # one token each
    assert 300 < len(tok) <= 1024 + len(CHAT_TAGS)
    assert len(encode(tok, "right")) == 1  # merges learned from the tasks' text
    # the template's own text is weighed in the merges: the tools system turn is short
    # (~3.5 characters a token: each space before a word is a token of its own)
    system = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                     tools=[python_tool()], tokenize=False)
    assert len(encode(tok, system)) < len(system) / 3


def test_a_word_of_an_observation_is_the_token_of_that_action(chat_dir):
    """The chat toy copies an action word from its observation as the same id (as the
    word-level toy does): Qwen2's split made it " right" in the observation and "right"
    as the assistant's action, two unrelated ids for a model with no pretraining."""
    tok = load_tokenizer(chat_dir)
    for obs, action in (("gridnav : goal 2 right 1 up . act :", "up"),
                        ("gridnav : goal 3 left . act :", "left"),
                        ("boxpush : box 2 right . target 4 right . act :", "right"),
                        ("guess : higher . left 6 8 9 7 . act :", "7")):
        ids = encode(tok, action)
        assert len(ids) == 1 and ids[0] in encode(tok, obs), (obs, action)
    # the assistant's text as the template renders it holds the same id
    msgs = [{"role": "user", "content": "gridnav : goal 2 right . act :"},
            {"role": "assistant", "content": "right"}]
    rendered = encode(tok, tok.apply_chat_template(msgs, tokenize=False))
    assert rendered.count(encode(tok, "right")[0]) == 2


def test_decode_round_trip_keeps_tool_tags(chat_dir):
    tok = load_tokenizer(chat_dir)
    for text in TEXTS[:5]:
        assert decode(tok, encode(tok, text)) == text
    call = TEXTS[4]
    # decode skips special tokens (the end of turn) but keeps the tool-call tags
    assert decode(tok, encode(tok, call) + [tok.eos_token_id]) == call


def test_template_renders_system_user_assistant_tool_and_tools(chat_dir):
    tok = load_tokenizer(chat_dir)
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "what is 7 * 8 ?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {
                 "name": "python", "arguments": {"code": "7 * 8"}}}]},
            {"role": "tool", "content": "56"}, {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "answer 56"}]
    text = tok.apply_chat_template(msgs, tools=[python_tool()], tokenize=False)
    head = "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    assert text.startswith(head)
    assert "<tools>\n" + json.dumps(python_tool()) + "\n</tools>" in text
    tail = ("<|im_start|>user\nwhat is 7 * 8 ?<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>\n{"name": "python", "arguments": '
            '{"code": "7 * 8"}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\n56\n</tool_response>\n<tool_response>\nok\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\nanswer 56<|im_end|>\n")
    assert text.endswith("</tool_call><|im_end|>\n" + tail)
    assert text.count("<|im_start|>system") == 1
    # the rendered assistant call is what the parser reads back
    call_turn = tail.split("<|im_start|>assistant\n")[1]
    assert parse_tool_calls(call_turn) == [ToolCall("python", {"code": "7 * 8"})]
    plain = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert plain == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                     "what is 7 * 8 ?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs[1:2], tokenize=False) == (
        "<|im_start|>user\nwhat is 7 * 8 ?<|im_end|>\n")  # no default system prompt


def test_template_is_prefix_stable(chat_dir):
    tok = load_tokenizer(chat_dir)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": TEXTS[4]}, {"role": "tool", "content": "56"},
            {"role": "assistant", "content": "answer 56"}, {"role": "user", "content": "u2"}]
    for tools in (None, [python_tool()]):
        prev: list[int] = []
        for k in range(1, len(msgs) + 1):
            ids = encode(tok, tok.apply_chat_template(msgs[:k], tools=tools, tokenize=False))
            assert len(ids) > len(prev) and ids[:len(prev)] == prev, (tools, k)
            prev = ids


def test_generation_config_and_context(chat_dir):
    tok = load_tokenizer(chat_dir)
    with open(os.path.join(chat_dir, "generation_config.json")) as f:
        gen = json.load(f)
    end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert gen["eos_token_id"] == [end, eot] and gen["pad_token_id"] == eot
    with open(os.path.join(chat_dir, "config.json")) as f:
        config = json.load(f)
    assert config["max_position_embeddings"] == 2048 and config["eos_token_id"] == end
    assert config["vocab_size"] == len(tok)


def test_forward_and_dtype(chat_dir):
    tok = load_tokenizer(chat_dir)
    model = load_model(chat_dir, dtype=None)
    assert default_dtype("cpu") == torch.float32 and model.dtype == torch.float32
    text = tok.apply_chat_template([{"role": "user", "content": TEXTS[0]}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([encode(tok, text)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_build_is_deterministic(chat_dir, corpus, tmp_path):
    again = build_tiny_model(tmp_path / "again", corpus, chat=True, hidden_size=32)
    a, b = load_tokenizer(chat_dir), load_tokenizer(again)
    assert a.get_vocab() == b.get_vocab()
    ids = torch.tensor([encode(a, TEXTS[1])])
    with torch.no_grad():
        assert torch.equal(load_model(again)(ids).logits, load_model(chat_dir)(ids).logits)
    with pytest.raises(ValueError, match="vocab_size"):
        build_chat_tokenizer(corpus, vocab_size=100)


def _strip_eos(folder, keep_generation_config=False):
    for name in ("tokenizer_config.json", "special_tokens_map.json", "config.json",
                 "generation_config.json"):
        path = os.path.join(folder, name)
        if not os.path.exists(path) or (keep_generation_config
                                        and name == "generation_config.json"):
            continue
        with open(path) as f:
            data = json.load(f)
        data.pop("eos_token", None)
        data.pop("eos_token_id", None)
        with open(path, "w") as f:
            json.dump(data, f)


def test_folder_without_eos_is_a_clear_error(chat_dir, tmp_path):
    broken = tmp_path / "noeos"
    shutil.copytree(chat_dir, broken)
    _strip_eos(broken)
    with pytest.raises(ModelFolderError, match="no eos / end-of-turn token"):
        check_model_folder(broken)
    with pytest.raises(ModelFolderError, match="eos_token"):
        load_tokenizer(broken)


def test_eos_only_in_generation_config_is_used(chat_dir, tmp_path):
    folder = tmp_path / "geneos"
    shutil.copytree(chat_dir, folder)
    _strip_eos(folder, keep_generation_config=True)
    check_model_folder(folder)
    assert load_tokenizer(folder).eos_token == "<|im_end|>"


# -- graphs/chat.py ---------------------------------------------------------------------
def test_chat_graph_actions_fit_their_token_budget(tmp_path):
    """Every warm-up action of graphs/chat.py, encoded by the chat toy built from that
    graph's corpus, fits the task's max_new_tokens with its end-of-turn token, and a
    whole warm-up episode fits the toy's context."""
    import random

    from rollart.chat.tools import python_tool
    from rollart.config.graph import load_graph

    graph, src = load_graph("chat")
    assert src.endswith("graphs/chat.py") and graph.policy.conversation == "chat"
    assert [t.name for t in graph.tasks] == ["gridnav", "guess", "boxpush", "calc"]
    path = build_tiny_model(tmp_path / "m", chat_corpus(graph.tasks, seeds=range(8)),
                            chat=True, hidden_size=32)
    tok = load_tokenizer(path)
    rng = random.Random(0)
    for task in graph.tasks:
        env = task.env_factory()
        for seed in range(8):
            obs = env.reset(seed)
            msgs = [{"role": "user", "content": obs}]
            for _ in range(task.max_turns):
                action = task.warmup_action(rng, obs)
                assert len(encode(tok, action)) + 1 <= task.max_new_tokens, (task.name, action)
                msgs.append({"role": "assistant", "content": action})
                step = env.step(action)
                if step.done:
                    break
                obs = step.observation
                msgs.append({"role": "user", "content": obs})
            tools = [python_tool()] if task.name == "calc" else None
            text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
            assert len(encode(tok, text)) < 2048 // 2, task.name


def test_a_tool_calling_conversation_on_the_chat_toy(chat_dir):
    """A calc episode through rollart's conversation format on the chat toy: the ids
    grown turn by turn equal the template's render of the whole conversation (tools
    included), the loss mask is exactly the generated ids with their end token, and the
    tool's result (run by the env) is masked out."""
    import random

    from rollart.chat.conversation import ConversationFormat, TokenLog
    from rollart.env.protocol import env_tools
    from rollart.chat.tools import check_call

    tok = load_tokenizer(chat_dir)
    fmt = ConversationFormat(tok, "chat", max_context=2048, model_path=chat_dir)
    assert fmt.mode == "chat" and fmt.prefix_stable
    assert fmt.stop_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    task = calc_tool_task(tool_format="hermes")
    env = task.env_factory()
    obs = env.reset(4)
    tools = env_tools(env)
    log = TokenLog()
    conv = fmt.start(log, task, obs, tools)
    call_text = task.warmup_action(random.Random(1), obs)  # a tool call for this rng
    generated = [encode(tok, call_text) + [fmt.stop_ids[0]]]
    text = conv.add_generation(generated[0])
    (call,) = parse_tool_calls(text)
    checked = check_call(call, tools)
    result = env.call_tool(checked.name, checked.arguments)
    question = obs.split("what is ")[1].split(" ?")[0]
    assert result == str(eval(question))
    conv.add_tool_results([result])
    generated.append(encode(tok, f"answer {result}") + [fmt.stop_ids[0]])
    answer = conv.add_generation(generated[1])
    assert env.step(task.parse_action(answer)).info["success"]
    full = tok.apply_chat_template(conv.messages, tools=tools, tokenize=False)
    # the template's "\n" after the last <|im_end|> comes with the next message
    assert encode(tok, full) == log.ids + encode(tok, "\n")
    gen_ids = [t for t, m in zip(log.response_ids, log.loss_mask) if m]
    assert gen_ids == generated[0] + generated[1]
    masked = decode(tok, [t for t, m in zip(log.response_ids, log.loss_mask) if not m])
    assert f"<tool_response>\n{result}\n</tool_response>" in masked
