"""Chat templates that cannot do what a run asks (``rollart.chat.template_support``): a
template without a system role gets the system prompt folded into the first user turn,
token in / token out and loss mask exact (or a clear error when strict); a template that
ignores ``tools=`` is an error at start unless ``Task.tools_in_prompt`` writes the tools
into the prompt. Real byte-level BPE tokenizers with the templates built here."""

import dataclasses
import json
import logging
import random

import pytest

from rollart.chat import template_support as support
from rollart.chat.conversation import ConversationFormat, TokenLog
from rollart.env.tasks import Task
from rollart.chat.template_support import TOOLS_HEADER, ChatTemplateError
from rollart.config.templates import check_templates
from rollart.testing import (ADD_TOOL, CHATML, CHATML_SPECIALS, bpe_tokenizer, save_folder,
                             tiny_qwen2)
from test_conversation import AddEnv, assert_generated_masked  # tests/chat/

GEMMA_SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]

# Gemma-like (as Gemma 2's own): no system role, roles user/model, trimmed content
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/"
    "assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# a template with a system role that ignores tools= (as many base models' do)
NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SYSTEM = "you play a game"
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
Q_ADD = "what is 2 plus 3 ?"


def _gemma_tokenizer():
    tok = bpe_tokenizer(GEMMA_SPECIALS, GEMMA, eos="<eos>", pad="<pad>")
    tok.bos_token = "<bos>"
    return tok


@pytest.fixture(scope="module")
def gemma():
    return _gemma_tokenizer()


@pytest.fixture(scope="module")
def no_tools():
    return bpe_tokenizer(CHATML_SPECIALS, NO_TOOLS, eos="<|im_end|>", pad="<|endoftext|>")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def full_render(tok, messages, tools=None):
    kwargs = {"tools": tools} if tools else {}
    return tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)["input_ids"]


def tool_reward(episode):
    return 0.0


def add_action(rng, observation):
    return CALL_ADD if observation == Q_ADD else observation


def guess_task(**kw):
    from rollart.env.builtin.guess import GuessEnv
    from rollart.reward import success_reward

    return Task(name="guess", env_factory=GuessEnv, reward_fn=success_reward, max_turns=3,
                **kw)


def add_task(**kw):
    return Task(name="add", env_factory=AddEnv, reward_fn=tool_reward, max_turns=3,
                max_new_tokens=40, warmup_action=add_action, **kw)


def _graph(tasks, **policy):
    from rollart import Graph, Policy

    return Graph(name="templates", tasks=tuple(tasks), policy=Policy(**policy))


def _folder(tmp_path, tok):
    return save_folder(tmp_path / "model", tiny_qwen2(tok), tok)


# -- no system role ---------------------------------------------------------------------
@pytest.mark.parametrize("where", ["policy", "task"])
@pytest.mark.parametrize("cache", [True, False])
def test_a_template_without_a_system_role_gets_the_prompt_folded_exactly(gemma, caplog,
                                                                         where, cache):
    support._NOTED.clear()
    fmt_prompt, task_prompt = (SYSTEM, None) if where == "policy" else (None, SYSTEM)
    with caplog.at_level(logging.INFO, logger=support.__name__):
        fmt = ConversationFormat(gemma, "auto", system_prompt=fmt_prompt, cache=cache)
        assert fmt.mode == "chat" and not fmt.system_role and fmt.prefix_stable
        end_id = gemma.convert_tokens_to_ids("<end_of_turn>")
        assert fmt.end_id == end_id and fmt.stop_ids[0] == end_id
        obs = ["guess : pick 1 to 9 . act :", "guess : higher . act :", "guess : lower ."]
        answers = ["5", "7", "8"]
        for _ in range(2):  # two conversations: still one log line
            log = TokenLog()
            conv = fmt.start(log, guess_task(system_prompt=task_prompt), obs[0])
            gens = []
            for answer, o in zip(answers, obs[1:] + ["right ."]):
                ids = enc(gemma, answer) + [end_id]
                gens.append((len(log), ids))
                assert conv.add_generation(ids) == answer
                conv.add_user(o)
    folds = [r for r in caplog.records if "no system role" in r.getMessage()]
    assert len(folds) == 1 and "blank line" in folds[0].getMessage()
    messages = [{"role": "user", "content": f"{SYSTEM}\n\n{obs[0]}"}]
    for a, o in zip(answers, obs[1:] + ["right ."]):
        messages += [{"role": "assistant", "content": a}, {"role": "user", "content": o}]
    assert conv.messages == messages
    assert log.ids == full_render(gemma, messages)  # the whole conversation re-renders
    assert gemma.decode(log.prompt_ids) == (f"<bos><start_of_turn>user\n{SYSTEM}\n\n"
                                            f"{obs[0]}<end_of_turn>\n<start_of_turn>model\n")
    assert_generated_masked(log, gens)


def test_a_cut_generation_under_a_folded_prompt_is_closed_by_the_template(gemma):
    fmt = ConversationFormat(gemma, "chat", system_prompt=SYSTEM)
    log = TokenLog()
    conv = fmt.start(log, guess_task(), "guess : pick 1 to 9 .")
    conv.add_generation(enc(gemma, "the number is"), finish_reason="length")
    conv.add_user("go on .")
    assert conv.cut == 1
    assert log.ids == full_render(gemma, conv.messages)
    assert sum(log.loss_mask) == len(enc(gemma, "the number is"))


def test_strict_template_makes_a_missing_system_role_an_error(gemma, tmp_path):
    from rollart.config.graph import GraphError, Policy
    from rollart.config.overrides import apply_overrides

    with pytest.raises(ChatTemplateError, match="no system role.*strict_template=False"):
        ConversationFormat(gemma, "chat", system_prompt=SYSTEM, strict=True)
    fmt = ConversationFormat(gemma, "chat", strict=True)  # no prompt: nothing to fold
    with pytest.raises(ChatTemplateError, match="no system role"):
        fmt.start(TokenLog(), guess_task(system_prompt=SYSTEM), "guess .")
    fmt.start(TokenLog(), guess_task(), "guess .")
    folder = _folder(tmp_path, gemma)
    strict = apply_overrides(_graph([guess_task(system_prompt=SYSTEM)]),
                             ["policy.strict_template=true"])
    assert strict.policy.strict_template is True
    with pytest.raises(ChatTemplateError, match=f"{folder}.*no system role.*task 'guess'"):
        check_templates(strict, folder)
    check_templates(_graph([guess_task()], strict_template=True), folder)
    with pytest.raises(GraphError, match="strict_template must be True or False"):
        Policy(strict_template="yes")


def test_the_start_check_warns_once_where_it_folds(gemma, tmp_path, caplog):
    folder = _folder(tmp_path, gemma)
    with caplog.at_level(logging.WARNING, logger=support.__name__):
        check_templates(_graph([guess_task(system_prompt=SYSTEM)]), folder)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "tasks guess" in warned[0].getMessage()


def test_templates_that_work_are_found_to_work():
    from rollart.model import CHAT_TEMPLATE

    chatml = bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    toy = bpe_tokenizer(CHATML_SPECIALS, CHAT_TEMPLATE, eos="<|im_end|>",
                        pad="<|endoftext|>")
    for tok in (chatml, toy):
        fmt = ConversationFormat(tok, "chat", system_prompt=SYSTEM, strict=True)
        assert fmt.system_role and fmt.tools_rendered
        assert not support.check_task(fmt, add_task(), [ADD_TOOL])


# -- tools the template ignores ----------------------------------------------------------
def test_a_template_that_ignores_tools_is_an_error_at_start(no_tools, tmp_path):
    from rollart.env.adapters.tool import calc_tool_task

    folder = _folder(tmp_path, no_tools)
    fmt = ConversationFormat(no_tools, "chat")
    assert fmt.system_role and not fmt.tools_rendered
    calc = calc_tool_task(tool_format="hermes")
    with pytest.raises(ChatTemplateError, match="task 'calc' declares tools \\(python\\).*"
                       "ignores tools=.*tools_in_prompt=True"):
        check_templates(_graph([guess_task(), calc], conversation="chat"), folder)
    check_templates(_graph([guess_task(), dataclasses.replace(calc, tools_in_prompt=True)],
                           conversation="chat"), folder)
    check_templates(_graph([calc], conversation="raw"), folder)  # raw: no template


def test_tools_in_prompt_writes_the_schemas_into_the_system_prompt(no_tools):
    from rollart.trainer.warmup import play_random

    with pytest.raises(TypeError, match="tools_in_prompt must be True or False"):
        add_task(tools_in_prompt="yes")
    fmt = ConversationFormat(no_tools, "chat")
    log = play_random(add_task(tools_in_prompt=True, system_prompt=SYSTEM), no_tools, 1,
                      random.Random(0), fmt)
    text = no_tools.decode(log.ids)
    system = f"{SYSTEM}\n\n{TOOLS_HEADER}\n{json.dumps(ADD_TOOL)}"
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
                           f"{Q_ADD}<|im_end|>\n<|im_start|>assistant\n{CALL_ADD}<|im_end|>")
    assert "<|im_start|>tool\n5<|im_end|>" in text  # the call ran, its result came back
    assert text.endswith("<|im_start|>assistant\n5<|im_end|>")
    generated = no_tools.decode([t for t, m in zip(log.response_ids, log.loss_mask) if m])
    assert generated == f"{CALL_ADD}<|im_end|>5<|im_end|>"


def test_tools_in_prompt_is_folded_where_there_is_no_system_role(gemma):
    fmt = ConversationFormat(gemma, "chat")
    log = TokenLog()
    conv = fmt.start(log, add_task(tools_in_prompt=True), Q_ADD, [ADD_TOOL])
    assert conv.tools is None
    assert gemma.decode(log.prompt_ids) == (
        f"<bos><start_of_turn>user\n{TOOLS_HEADER}\n{json.dumps(ADD_TOOL)}\n\n{Q_ADD}"
        "<end_of_turn>\n<start_of_turn>model\n")
