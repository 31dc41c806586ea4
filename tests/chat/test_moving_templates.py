"""Chat templates whose rendering moves as a conversation grows (``rollart.chat.deltas``):
under a Mistral-v0.3-style template (tools before the last user turn, the system prompt
folded into the first user turn, strict user/assistant alternation) a tool conversation
is played in delta mode: every prompt is a prefix of the final ids and the generated
ids stand verbatim at the masked positions. The start check says so once (with a
system prompt set too), names the fix where a delta cannot be rendered, and
``graphs/chat.py``'s calc takes the template's own tool format (a differing explicit one
warns once, naming both). Real byte-level BPE tokenizers with the templates built here."""

import logging
from pathlib import Path

import pytest

from rollart.chat import deltas
from rollart.chat.conversation import ConversationError, ConversationFormat, TokenLog
from rollart.chat.tool_formats import detect_tool_format, get_tool_format, tool_format_of
from rollart.config.templates import check_templates
from rollart.env.tasks import Task
from rollart.testing import ADD_TOOL, bpe_tokenizer, save_folder, tiny_qwen2
from test_conversation import AddEnv, assert_generated_masked  # tests/chat/
from tool_families import MISTRAL_SPECIALS, MISTRAL_V03  # tests/

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "you add numbers"
Q_ADD = AddEnv.question
TOOLS_BLOCK = "[AVAILABLE_TOOLS] [{\"type\": \"function\""
# the real template's tool branch: a tool message without a 9-character tool_call_id raises
NEEDS_CALL_ID = MISTRAL_V03.replace(
    "{% elif m.role == 'tool' %}",
    "{% elif m.role == 'tool' %}{% if m.tool_call_id is not defined %}{{ raise_exception("
    "'Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}")


def _tokenizer(template=MISTRAL_V03):
    tok = bpe_tokenizer(MISTRAL_SPECIALS, template, eos="</s>")
    tok.bos_token = "<s>"
    return tok


@pytest.fixture(scope="module")
def mistral():
    return _tokenizer()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def add_task(**kw):
    return Task(name="add", env_factory=AddEnv, reward_fn=_reward, max_turns=3,
                max_new_tokens=60, **kw)


def _reward(episode):
    return 0.0


def _folder(tmp_path, tok):
    return save_folder(tmp_path / "model", tiny_qwen2(tok), tok)


def _graph(tasks, **policy):
    from rollart import Graph, Policy

    return Graph(name="moving", tasks=tuple(tasks), policy=Policy(**policy))


def _generate(conv, tok, text, prompts, gens):
    """The policy's turn: ``text`` and the end-of-turn token; the prompt it saw kept."""
    prompts.append(list(conv.log.ids))
    ids = enc(tok, text) + [conv.fmt.end_id]
    gens.append((len(conv.log), ids))
    return conv.add_generation(ids)


@pytest.mark.parametrize("cache", [True, False])
def test_a_tool_conversation_keeps_the_ids_the_policy_saw(mistral, cache):
    fmt = ConversationFormat(mistral, "chat", system_prompt=SYSTEM, cache=cache)
    assert fmt.tool_format == "mistral" and fmt.end_id == mistral.eos_token_id
    call = get_tool_format("mistral").format("add", {"a": 2, "b": 3})
    conv = fmt.start(TokenLog(), add_task(), Q_ADD, [ADD_TOOL])
    assert conv.detached  # the tools block moves: found at start, not at the first error
    prompts, gens = [], []
    _generate(conv, mistral, call, prompts, gens)
    conv.add_tool_results(["5"])
    _generate(conv, mistral, "4", prompts, gens)
    conv.add_user("try again .")  # a new user turn: the template moves its tools block
    _generate(conv, mistral, "5", prompts, gens)
    ids = conv.log.ids
    for prompt in prompts:  # each prompt the policy saw is a prefix of the record
        assert ids[:len(prompt)] == prompt
    mask = assert_generated_masked(conv.log, gens)
    assert sum(mask) == sum(len(g) for _, g in gens)
    tools = mistral.apply_chat_template([{"role": "user", "content": "x"}], tools=[ADD_TOOL],
                                        tokenize=False).split("[INST]")[0][len("<s>"):]
    assert mistral.decode(ids) == (
        f"<s>{tools}[INST] {SYSTEM}\n\n{Q_ADD}[/INST]{call}</s>"
        '[TOOL_RESULTS] {"content": "5"}[/TOOL_RESULTS]4</s>'
        f"{tools}[INST] try again .[/INST]5</s>")
    # the whole conversation does not render at all (the call kept as text breaks the
    # alternation), let alone as these ids
    with pytest.raises(Exception, match="must alternate"):
        mistral.apply_chat_template(conv.messages, tools=[ADD_TOOL])


@pytest.mark.parametrize("cache", [True, False])
def test_a_new_user_turn_under_a_moving_tools_block_appends_it(mistral, cache):
    """The old failure: ``ConversationError: the chat template renders a conversation
    differently once a message is added`` at the first user turn after a reply."""
    fmt = ConversationFormat(mistral, "chat", cache=cache)
    conv = fmt.start(TokenLog(), add_task(), Q_ADD, [ADD_TOOL])
    prompts, gens = [], []
    _generate(conv, mistral, "hello", prompts, gens)
    conv.add_user("what is 2 plus 3 ? use add")
    start = len(conv.log)
    _generate(conv, mistral, "5", prompts, gens)
    text = mistral.decode(conv.log.ids)
    assert text.count(TOOLS_BLOCK) == 2 and text.endswith(
        "[/AVAILABLE_TOOLS][INST] what is 2 plus 3 ? use add[/INST]5</s>")
    assert conv.log.ids[:start] == prompts[-1]
    assert_generated_masked(conv.log, gens)


def test_templates_without_a_moving_part_keep_the_full_render(mistral):
    """Without tools the same template is prefix-stable: the ids are the full render's."""
    fmt = ConversationFormat(mistral, "chat", system_prompt=SYSTEM)
    assert fmt.prefix_stable
    conv = fmt.start(TokenLog(), add_task(), Q_ADD)
    assert not conv.detached
    conv.add_generation(enc(mistral, " 4") + [fmt.end_id])  # its turns: " text</s>"
    conv.add_user("try again .")
    assert conv.log.ids == mistral.apply_chat_template(conv.messages)["input_ids"]


def test_the_start_check_says_once_that_the_chat_graph_appends(mistral, tmp_path, caplog):
    from rollart.config.graph import load_graph
    from rollart.model import CHAT_TEMPLATE

    graph, _ = load_graph(str(REPO / "graphs" / "chat.py"))
    calc = next(t for t in graph.tasks if t.name == "calc")
    assert calc.tool_format is None  # the model's own family, never overridden
    assert detect_tool_format(CHAT_TEMPLATE) == "hermes"  # the chat toy: as before
    folder = _folder(tmp_path, mistral)
    fmt = ConversationFormat(mistral, "chat", system_prompt=SYSTEM)
    assert tool_format_of(fmt, calc) == "mistral"
    deltas._NOTED.clear()
    graph = _graph(graph.tasks, model=folder, conversation="chat", system_prompt=SYSTEM)
    with caplog.at_level(logging.INFO, logger="rollart"):
        check_templates(graph, folder)
        check_templates(graph, folder)  # e.g. `rollart eval` after the run: once a process
        ConversationFormat(mistral, "chat", system_prompt=SYSTEM)  # as the runners do
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert "(tasks calc)" in warned[0] and "appends each new message" in warned[0]


def test_a_task_format_other_than_the_templates_warns_once_naming_both(mistral, tmp_path,
                                                                       caplog):
    from rollart.env.adapters.tool import calc_tool_task

    folder = _folder(tmp_path, mistral)
    graph = _graph([calc_tool_task(tool_format="hermes")], conversation="chat")
    with caplog.at_level(logging.WARNING, logger="rollart.config.templates"):
        check_templates(graph, folder)
        check_templates(graph, folder)
    warned = [r.getMessage() for r in caplog.records if "tool_format" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "tool_format='hermes'" in warned[0] and "writes 'mistral'" in warned[0]


def test_a_template_that_insists_on_tool_call_ids_gets_them(tmp_path):
    """Mistral v0.3's real template raises on a tool message without a nine-character
    alphanumeric ``tool_call_id``: rollart gives each tool result one (by its place in
    the conversation) where the template reads them, so the tool task trains."""
    from rollart.env.adapters.tool import calc_tool_task

    tok = _tokenizer(NEEDS_CALL_ID)
    folder = _folder(tmp_path, tok)
    graph = _graph([calc_tool_task(tool_format=None)], conversation="chat")
    check_templates(graph, folder)  # renders every delta a rollout needs
    fmt = ConversationFormat(tok, "chat")
    assert fmt.call_ids and not ConversationFormat(_tokenizer(), "chat").call_ids
    conv = fmt.start(TokenLog(), add_task(), Q_ADD, [ADD_TOOL])
    conv.add_generation(enc(tok, "hello") + [fmt.end_id])
    conv.add_tool_results(["5"])
    conv.add_generation(enc(tok, "again") + [fmt.end_id])
    conv.add_tool_results(["6", "7"])
    ids = [m.get("tool_call_id") for m in conv.messages if m["role"] == "tool"]
    assert ids == ["call00000", "call00001", "call00002"]
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert "[TOOL_RESULTS]" in tok.decode(conv.log.ids)




def test_the_warm_up_demonstrates_calls_in_the_models_family(mistral):
    """calc's demonstrations write hermes calls; on a Mistral-style model the warm-up
    writes them as that family's ``[TOOL_CALLS]``, and the tool's result comes back."""
    import random

    from rollart.env.adapters.tool import calc_tool_task
    from rollart.trainer.warmup import play_random

    fmt = ConversationFormat(mistral, "chat")
    log = play_random(calc_tool_task(tool_format=None), mistral, seed=3,
                      rng=random.Random(0), fmt=fmt)
    text = mistral.decode(log.ids)
    assert "[TOOL_CALLS]" in text and "<tool_call>" not in text, text
    assert "[TOOL_RESULTS]" in text, text
