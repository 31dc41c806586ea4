"""Conversations as token ids (rollart.chat.conversation) with real tokenizers built here:
three chat-template styles, token in / token out, masks, tool messages, cut generations,
parse_action helpers, bad input, the raw toy format byte for byte, and the warm-up."""

import json
import logging
import random
import threading
import warnings

import pytest

from rollart.chat import conversation as conv_mod
from rollart.chat.conversation import ConversationError, ConversationFormat, TokenLog, cap_text
from rollart.env.tasks import BUILTIN_TASKS, Task
from rollart.testing import (ADD_TOOL, CHATML, CHATML_SPECIALS, bpe_tokenizer, save_folder,
                             tiny_qwen2)
from rollart.types import StepResult

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]

TOOLS = [ADD_TOOL]

# Llama-3-like: bos, headers, trimmed content, <|eot_id|> ends a turn, nothing after it
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
    "<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")

# Qwen3-like thinking template: past assistant turns (before the last user message) lose
# their <think> block: not prefix-stable
THINKING = (
    "{% set ns = namespace(last=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in m.content %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1] | trim }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

@pytest.fixture(scope="module")
def chatml():
    return bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")


@pytest.fixture(scope="module")
def llama3():
    return bpe_tokenizer(LLAMA_SPECIALS, LLAMA3, eos="<|end_of_text|>")


@pytest.fixture(scope="module")
def thinking():
    return bpe_tokenizer(CHATML_SPECIALS, THINKING, eos="<|endoftext|>")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def full_render(tok, messages, tools=None):
    kwargs = {"tools": tools} if tools else {}
    return tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)["input_ids"]


def task(**kw):
    from rollart.env.builtin.guess import GuessEnv
    from rollart.reward import success_reward

    return Task(name="t", env_factory=GuessEnv, reward_fn=success_reward, max_turns=3, **kw)


def assert_generated_masked(log, gens) -> list[int]:
    """The generated ids (``gens``: ``[(start, ids)]``) stand verbatim in ``log`` and the
    loss mask covers exactly them; returns the mask over the whole log."""
    mask = [0] * len(log.prompt_ids) + log.loss_mask
    expected = [0] * len(log)
    for start, ids in gens:
        assert log.ids[start:start + len(ids)] == ids  # kept verbatim
        expected[start:start + len(ids)] = [1] * len(ids)
    assert mask == expected
    return mask


def play(fmt, tok, observations, answers, end_id, system_task=None):
    """A conversation: observation, answer (generated as its ids + end id), ... ."""
    log = TokenLog()
    conv = fmt.start(log, system_task or task(), observations[0])
    gens = []
    for answer, obs in zip(answers, observations[1:]):
        ids = enc(tok, answer) + [end_id]
        gens.append((len(log), ids))
        assert conv.add_generation(ids) == answer
        conv.add_user(obs)
    return conv, gens


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,end", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_incremental_ids_equal_the_full_render_where_prefix_stable(request, caplog, name,
                                                                   end):
    tok = request.getfixturevalue(name)
    with caplog.at_level(logging.INFO, logger="rollart.chat.deltas"):
        fmt = ConversationFormat(tok, "auto", system_prompt="you play a game")
    assert fmt.mode == "chat" and fmt.prefix_stable
    assert not [r for r in caplog.records if "differently" in r.getMessage()]
    end_id = tok.convert_tokens_to_ids(end)
    assert fmt.end_id == end_id and fmt.stop_ids[0] == end_id
    obs = ["guess : pick 1 to 9 . act :", "guess : higher . act :", "guess : lower ."]
    # llama3 trims content: the generated ids are kept anyway. (No leading whitespace:
    # byte-level BPE would merge it with the template's "\n" when the text is re-encoded,
    # which token in / token out never does.)
    answers = ["5", "7  "]
    conv, gens = play(fmt, tok, obs, answers, end_id)
    messages = [{"role": "system", "content": "you play a game"}]
    for o, a in zip(obs, answers + [None]):
        messages.append({"role": "user", "content": o})
        if a is not None:
            messages.append({"role": "assistant", "content": a})
    assert conv.messages == messages
    if name == "chatml":  # content rendered verbatim: the whole conversation re-renders
        assert conv.log.ids == full_render(tok, messages)
    else:  # trimmed content: equal once the generated ids are what the template renders
        conv2, _ = play(fmt, tok, obs, [a.strip() for a in answers], end_id)
        messages2 = [dict(m, content=m["content"].strip()) for m in messages]
        assert conv2.log.ids == full_render(tok, messages2)
    # the loss mask covers exactly the generated ids, their end token included
    log = conv.log
    mask = assert_generated_masked(log, gens)
    assert sum(mask) == sum(len(a) for _, a in gens)


def test_thinking_template_keeps_what_the_policy_saw_and_notes_once(thinking, caplog):
    conv_mod._WARNED.clear()
    with caplog.at_level(logging.INFO, logger="rollart.chat.deltas"):
        fmt = ConversationFormat(thinking, "chat")
        ConversationFormat(thinking, "chat")  # a second format: no second note
    # INFO: the console line is the start check's (tests/chat/test_moving_templates.py)
    notes = [r for r in caplog.records if "renders a conversation differently" in
             r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and not fmt.prefix_stable
    end_id = thinking.convert_tokens_to_ids("<|im_end|>")
    assert fmt.stop_ids == (end_id, thinking.eos_token_id)
    obs = ["guess : pick 1 to 9 .", "guess : higher .", "guess : lower ."]
    answers = ["<think>the middle</think>5", "<think>go up</think>7"]
    conv, gens = play(fmt, thinking, obs, answers, end_id)
    expected = enc(thinking, f"<|im_start|>user\n{obs[0]}<|im_end|>\n<|im_start|>assistant\n")
    for answer, o in zip(answers, obs[1:]):
        expected += enc(thinking, answer) + [end_id]
        expected += enc(thinking, f"\n<|im_start|>user\n{o}<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert conv.log.ids == expected  # the think blocks the policy generated stay
    assert conv.log.ids != full_render(thinking, conv.messages)  # the template drops them
    assert sum(conv.log.loss_mask) == sum(len(ids) for _, ids in gens)


# -- tools ----------------------------------------------------------------------------------
def test_tools_are_rendered_and_tool_results_masked(chatml):
    fmt = ConversationFormat(chatml, "chat")
    end_id = fmt.end_id
    log = TokenLog()
    conv = fmt.start(log, task(system_prompt="you play a game"), "what is 1 plus 2 ?", TOOLS)
    assert '"name": "add"' in chatml.decode(log.prompt_ids)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    gen = enc(chatml, call) + [end_id]
    conv.add_generation(gen)
    n = len(log)
    conv.add_tool_results(["3"])
    added = log.ids[n:]
    assert "<tool_response>\n3\n</tool_response>" in chatml.decode(added)
    assert log.loss_mask[-len(added):] == [0] * len(added)
    conv.add_generation(enc(chatml, "3") + [end_id])
    conv.add_user("right .")
    messages = [{"role": "system", "content": "you play a game"},
                {"role": "user", "content": "what is 1 plus 2 ?"},
                {"role": "assistant", "content": call}, {"role": "tool", "content": "3"},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "right ."}]
    assert conv.messages == messages
    assert log.ids == full_render(chatml, messages, TOOLS)
    assert sum(log.loss_mask) == len(gen) + len(enc(chatml, "3")) + 1


# -- cached template pieces ------------------------------------------------------------------
# Qwen2.5's own grouping of consecutive tool messages into one user turn (the chat toy's)
UPPER = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tool_conversation(fmt, tok, system_task):
    """system + tools, a tool call, two tool results, a cut generation, a user turn, an
    answer ended by another eos, a user turn, a two-line answer: (log, messages)."""
    end = fmt.end_id
    other = next((t for t in fmt.stop_ids if t != end), end)
    log = TokenLog()
    conv = fmt.start(log, system_task, "what is 1 plus 2 ?", TOOLS)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    conv.add_generation(enc(tok, call) + [end])
    conv.add_tool_results(["3", " error : no\nsuch tool "])
    conv.add_generation(enc(tok, "the number is"), finish_reason="length")
    conv.add_user("  go on .\n")
    conv.add_generation(enc(tok, "3") + [other])
    conv.add_user("right .")
    conv.add_generation(enc(tok, "pick\n3") + [end])
    conv.add_user("done .")
    return log, conv.messages


@pytest.mark.parametrize("name", ["chatml", "llama3", "thinking", "qwen_tools", "upper"])
@pytest.mark.parametrize("system", [None, "you play a game"])
def test_cached_template_pieces_give_the_ids_of_the_uncached_render(request, name, system):
    from rollart.model import CHAT_TEMPLATE

    if name == "qwen_tools":
        tok = bpe_tokenizer(CHATML_SPECIALS, CHAT_TEMPLATE, eos="<|im_end|>",
                             pad="<|endoftext|>")
    elif name == "upper":
        tok = bpe_tokenizer(CHATML_SPECIALS, UPPER, eos="<|im_end|>", pad="<|endoftext|>")
    else:
        tok = request.getfixturevalue(name)
    cached = ConversationFormat(tok, "chat")
    plain = ConversationFormat(tok, "chat", cache=False)
    assert cached.cache is not None and plain.cache is None
    log, messages = _tool_conversation(cached, tok, task(system_prompt=system))
    ref, ref_messages = _tool_conversation(plain, tok, task(system_prompt=system))
    assert messages == ref_messages
    assert (log.prompt_ids, log.response_ids, log.loss_mask) == (
        ref.prompt_ids, ref.response_ids, ref.loss_mask)
    hits = [k[:2] for k, v in cached.cache._pieces.items() if v is not None]
    if name == "upper":  # content not put in verbatim: nothing cached, full renders
        assert hits == [] and cached.cache._pieces
        return
    # every render of this conversation came from the cache: the opening prompt, the two
    # tool results as one delta, user turns, the end of an assistant turn
    assert {("prompt", system), ("delta", ("tool", "tool")), ("delta", ("user",))} <= set(
        hits) and any(k[0] == "tail" for k in hits)
    if cached.prefix_stable and name != "llama3":  # llama3 trims: see the test above
        assert log.ids == full_render(tok, messages, TOOLS)


# -- cut generations, stops -----------------------------------------------------------------
def test_a_cut_generation_is_closed_by_the_template_and_counted(chatml):
    fmt = ConversationFormat(chatml, "chat")
    log = TokenLog()
    conv = fmt.start(log, task(), "guess : pick .")
    cut = enc(chatml, "left left left")  # max_new_tokens ran out: no end token
    assert conv.add_generation(cut, finish_reason="length") == "left left left"
    assert conv.cut == 1
    n = len(log)
    conv.add_user("guess : higher .")
    assert log.ids[n] == fmt.end_id and log.loss_mask[n - len(log.prompt_ids)] == 0
    messages = [{"role": "user", "content": "guess : pick ."},
                {"role": "assistant", "content": "left left left"},
                {"role": "user", "content": "guess : higher ."}]
    assert log.ids == full_render(chatml, messages)
    assert sum(log.loss_mask) == len(cut)


def test_a_generation_ended_by_another_eos_gets_the_end_of_turn_token(thinking):
    fmt = ConversationFormat(thinking, "chat")
    eos, end = thinking.eos_token_id, fmt.end_id
    assert eos != end and eos in fmt.stop_ids
    log = TokenLog()
    conv = fmt.start(log, task(), "guess :")
    ids = enc(thinking, "5") + [eos]
    assert conv.add_generation(ids) == "5"
    n = len(log)
    conv.add_user("higher")
    assert log.ids[n:n + 2] == [end] + enc(thinking, "\n")  # closed as the template does
    assert conv.cut == 0 and sum(log.loss_mask) == len(ids)


def test_a_stop_string_ends_the_turn_without_counting_a_cut(llama3):
    fmt = ConversationFormat(llama3, "chat")
    log = TokenLog()
    conv = fmt.start(log, task(stop=("</answer>",)), "guess :")
    ids = enc(llama3, "<answer>5</answer>")
    assert conv.add_generation(ids, finish_reason="stop") == "<answer>5</answer>"
    conv.add_user("higher")
    assert conv.cut == 0
    assert log.ids[len(log.prompt_ids) + len(ids)] == fmt.end_id  # closed by rollart


def test_generation_config_eos_ids_are_stops(llama3, tmp_path):
    eot = llama3.convert_tokens_to_ids("<|eot_id|>")
    end = llama3.convert_tokens_to_ids("<|end_of_text|>")
    bos = llama3.convert_tokens_to_ids("<|begin_of_text|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [bos, eot]}))
    fmt = ConversationFormat(llama3, "chat", model_path=str(tmp_path))
    assert fmt.stop_ids == (eot, end, bos)


# -- lengths ---------------------------------------------------------------------------------
def test_a_huge_observation_is_capped_before_encoding_and_truncated(chatml):
    fmt = ConversationFormat(chatml, "chat", max_context=64)
    huge = "left " * 2_000_000  # 10 MB of text
    log = TokenLog()
    conv = fmt.start(log, task(), huge)
    assert conv.truncated and len(log) == 64 and not conv.room(1)
    assert len(cap_text(huge, 64)) == 64 * conv_mod.CHARS_PER_TOKEN
    raw = ConversationFormat(chatml, "raw", max_context=100)
    conv = raw.start(TokenLog(), task(), "go")
    conv.add_generation(enc(chatml, "left") + [raw.stop_ids[0]])
    conv.add_user(huge)
    assert conv.truncated and len(conv.log) == 100


def test_task_text_fields_are_checked():
    with pytest.raises(TypeError, match="stop must be a tuple"):
        task(stop="</answer>")
    with pytest.raises(TypeError, match="parse_action must be callable"):
        task(parse_action="last line")
    with pytest.raises(ValueError, match="invalid_penalty"):
        task(invalid_penalty=-1)


# -- bad input ------------------------------------------------------------------------------
def test_chat_without_a_template_names_the_fix(chatml):
    bare = bpe_tokenizer(CHATML_SPECIALS, None, eos="<|im_end|>")
    with pytest.raises(ConversationError, match=r"Policy.conversation='raw'.*chat template"):
        ConversationFormat(bare, "chat")
    assert ConversationFormat(bare, "auto").mode == "raw"
    with pytest.raises(ValueError, match="conversation must be one of"):
        ConversationFormat(chatml, "chatml")


def test_a_tokenizer_without_eos_or_end_of_turn_is_a_clear_error():
    no_end = bpe_tokenizer(["<pad>"], "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                                       "{% endfor %}")
    with pytest.raises(ConversationError, match="no eos or end-of-turn token"):
        ConversationFormat(no_end, "chat")
    with pytest.raises(ConversationError, match="no eos or end-of-turn token"):
        ConversationFormat(no_end, "raw")


def test_policy_checks_its_conversation_settings():
    from rollart.config.graph import GraphError, Policy

    assert Policy().conversation == "auto"
    with pytest.raises(GraphError, match="Policy.conversation must be one of"):
        Policy(conversation="template")
    with pytest.raises(GraphError, match="Policy.max_context"):
        Policy(max_context=1)


# -- the raw format is today's, byte for byte -----------------------------------------------
def test_raw_format_is_plain_concatenation(tiny_model):
    from rollart.model import load_tokenizer
    from rollart.trainer.warmup import play_random

    tok = load_tokenizer(tiny_model)
    for t in BUILTIN_TASKS.values():
        log = play_random(t, tok, 7, random.Random(3))
        # today's definition, written out: obs ids, action ids + eos, obs ids, ...
        env, rng = t.env_factory(), random.Random(3)
        obs = env.reset(7)
        ids, mask = enc(tok, obs), []
        for _ in range(t.max_turns):
            action = t.warmup_action(rng, obs)
            gen = enc(tok, action) + [tok.eos_token_id]
            ids, mask = ids + gen, mask + [1] * len(gen)
            step = env.step(action)
            if step.done:
                break
            obs = step.observation
            ids, mask = ids + enc(tok, obs), mask + [0] * len(enc(tok, obs))
        assert log.ids == ids and log.loss_mask == mask, t.name


# -- warm-up containment --------------------------------------------------------------------
class _Env:
    def __init__(self):
        self.n = 0

    def reset(self, seed):
        return "guess : pick ."

    def step(self, action):
        self.n += 1
        return StepResult("guess : higher .", 0.0, self.n >= 3, {})

    def close(self):
        pass


class NoneStepEnv(_Env):
    def step(self, action):
        return None


class RaisingResetEnv(_Env):
    def reset(self, seed):
        raise OSError("simulator not found")


class HugeObsEnv(_Env):
    def step(self, action):
        return StepResult("left " * 1_000_000, 0.0, False, {})


class NonStringObsEnv(_Env):
    def reset(self, seed):
        return {"board": [1, 2]}


def _warm_task(env):
    from rollart.reward import success_reward

    return Task(name="warm", env_factory=env, reward_fn=success_reward, max_turns=4,
                warmup_action=_random_digit)


def _random_digit(rng, obs):
    return str(rng.randint(1, 9))


@pytest.mark.parametrize("env,method", [(NoneStepEnv, "step"), (RaisingResetEnv, "reset"),
                                        (NonStringObsEnv, "reset")])
def test_warmup_names_the_task_and_method_of_a_broken_env(chatml, env, method):
    from rollart.trainer.warmup import WarmupEnvError, play_random

    with pytest.raises(WarmupEnvError, match=rf"task 'warm'.*{method}.*warmup_steps=0"):
        play_random(_warm_task(env), chatml, 1, random.Random(0),
                    ConversationFormat(chatml, "chat"))


def test_warmup_truncates_a_huge_observation_with_bounded_memory(chatml):
    from rollart.trainer.warmup import warmup_batch

    fmt = ConversationFormat(chatml, "chat", max_context=128)
    counts = {}
    ids, attn, mask = warmup_batch([_warm_task(HugeObsEnv)], chatml, 3, random.Random(0),
                                   fmt, counts)
    assert ids.shape == (3, 128) and counts["truncated"] == 3
    assert int(mask.sum()) == 3 * 2  # one answer digit + its end token per episode


class _PairedEnv(_Env):
    """Resets only when another episode resets at the same time (else times out)."""

    meet = threading.Barrier(2, timeout=10)

    def reset(self, seed):
        self.meet.wait()
        return super().reset(seed)


def test_warmup_plays_a_batch_on_threads_and_the_batch_does_not_depend_on_them(chatml):
    from concurrent.futures import ThreadPoolExecutor

    from rollart.trainer.warmup import warmup_batch

    fmt = ConversationFormat(chatml, "chat")
    with ThreadPoolExecutor(1) as one:
        alone = warmup_batch([_warm_task(_Env)], chatml, 6, random.Random(3), fmt, pool=one)
    with ThreadPoolExecutor(4) as pool:
        threaded = warmup_batch([_warm_task(_Env)], chatml, 6, random.Random(3), fmt,
                                pool=pool)
        # two episodes in flight at once, or _PairedEnv's reset times out
        warmup_batch([_warm_task(_PairedEnv)], chatml, 4, random.Random(0), fmt, pool=pool)
    for a, b in zip(alone, threaded):
        assert a.equal(b)
    assert len({tuple(row.tolist()) for row in alone[0]}) > 1  # random actions differ


def test_run_warmup_is_the_same_on_one_episode_thread_or_four(chat_folder):
    from rollart.model import load_model, load_tokenizer
    from rollart.trainer.warmup import WarmupEnvError, run_warmup

    tok = load_tokenizer(chat_folder)
    runs = []
    for threads in (1, 4):
        model = load_model(chat_folder)
        losses = run_warmup(model, tok, [_warm_task(_Env), _add_task()], steps=3,
                            batch_size=4, lr=1e-2, seed=5, conversation="chat",
                            bare_tool_steps=2, episode_threads=threads)
        runs.append((losses, model.state_dict()))
    (losses1, state1), (losses4, state4) = runs
    assert losses1 == losses4 and len(losses1) == 5
    assert all(state1[k].equal(state4[k]) for k in state1)
    # an env that fails on an episode thread stops the warm-up, named
    with pytest.raises(WarmupEnvError, match=r"task 'warm'.*reset"):
        run_warmup(load_model(chat_folder), tok, [_warm_task(RaisingResetEnv)], steps=2,
                   batch_size=4, lr=1e-2, conversation="chat")


def test_warmup_in_chat_form_trains_the_template_tokens_the_policy_emits(chatml):
    from rollart.trainer.warmup import play_random

    fmt = ConversationFormat(chatml, "chat", system_prompt="you play a game")
    log = play_random(_warm_task(_Env), chatml, 1, random.Random(0), fmt)
    text = chatml.decode(log.ids)
    assert text.startswith("<|im_start|>system\nyou play a game<|im_end|>\n<|im_start|>user")
    assert text.count("<|im_start|>assistant\n") == 3
    generated = [t for t, m in zip(log.response_ids, log.loss_mask) if m]
    assert chatml.decode(generated).count("<|im_end|>") == 3


# -- a chat rollout on a real in-process cluster ---------------------------------------------
# A model folder not built by rollart: the test's own BPE tokenizer and ChatML template with
# tools, a tiny Qwen2 fitted (a few hundred steps) on two tool-calling conversations, so its
# near-greedy generations are known: a valid call (add) and an unknown tool (sub).
Q_ADD, Q_SUB = "what is 2 plus 3 ?", "what is 2 minus 3 ?"
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CALL_SUB = '<tool_call>\n{"name": "sub", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
SUB_ERROR = "error : unknown tool 'sub'; available: add"


def _fit_conversations(fmt):
    logs = []
    for question, call, result, answer in [(Q_ADD, CALL_ADD, "5", "5"),
                                           (Q_SUB, CALL_SUB, SUB_ERROR, "1")]:
        log = TokenLog()
        conv = fmt.start(log, task(), question, TOOLS)
        conv.add_text_generation(call)
        conv.add_tool_results([result])
        conv.add_text_generation(answer)
        logs.append(log)
    return logs


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    import torch

    from rollart.trainer.warmup import pad_logs

    tok = bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    fmt = ConversationFormat(tok, "chat", max_context=256, system_prompt="you add numbers")
    model = tiny_qwen2(tok, hidden_size=48, eos_token_id=fmt.end_id)
    ids, attn, mask = pad_logs(_fit_conversations(fmt), tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(300):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll.view(ids.size(0), -1) * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    return save_folder(tmp_path_factory.mktemp("chat") / "folder", model, tok)


class AddEnv:
    """Asks a sum; offers an ``add`` tool; the final answer goes to ``step``."""

    question = Q_ADD
    tools = TOOLS

    def reset(self, seed):
        return self.question

    def call_tool(self, name, arguments):
        return str(arguments["a"] + arguments["b"])

    def step(self, action):
        return StepResult("done .", 0.0, True, {"success": action == "5"})

    def close(self):
        pass


class SubEnv(AddEnv):
    question = Q_SUB


class TwoStepEnv(AddEnv):
    """Done at the second step only (so a first answer is followed by a user turn)."""

    def __init__(self):
        self.n = 0

    def step(self, action):
        self.n += 1
        return StepResult("try again .", 0.0, self.n >= 2, {})


class HugeChatObsEnv(TwoStepEnv):
    """Its second observation is 10 MB of text."""

    def step(self, action):
        self.n += 1
        return StepResult("left " * 2_000_000, 0.0, False, {})


class DictObsEnv(AddEnv):
    def reset(self, seed):
        return {"question": Q_ADD}


def tool_reward(ep):
    """10 for success plus the number of invalid tool calls (what the runner recorded)."""
    return 10.0 * bool(ep.info.get("success")) + ep.info.get("invalid_tool_calls", 0)


def _chat_task(name, env, max_new_tokens=40, max_turns=3):
    return Task(name=name, env_factory=env, reward_fn=tool_reward, max_turns=max_turns,
                max_new_tokens=max_new_tokens)


@pytest.fixture(scope="module")
def chat_rollout(local_cluster, chat_folder, tmp_path_factory, rollout_actors):
    mgr, buf, _ = rollout_actors(local_cluster, chat_folder,
                                 tmp_path_factory.mktemp("w") / "weights", "chat",
                                 temperature=1e-3, conversation="chat",
                                 system_prompt="you add numbers")
    return mgr, buf


def test_chat_rollout_runs_tool_turns_and_decodes_to_the_template(chat_rollout, chat_folder):
    from rollart.model import load_tokenizer

    mgr, buf = chat_rollout
    tok = load_tokenizer(chat_folder)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    summary = mgr.run_group(_chat_task("add", AddEnv), 1, "chat-add", 2).result()
    assert summary["rewards"] == [10.0, 10.0], summary  # the call ran, "5" answered
    trajs = buf.get_batch(1, min_version=-1, timeout=10).result()
    messages = [{"role": "system", "content": "you add numbers"},
                {"role": "user", "content": Q_ADD}, {"role": "assistant", "content": CALL_ADD},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]
    whole = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    for t in trajs:
        ids = t.prompt_ids + t.response_ids
        # the row decodes to the conversation the template renders (up to its last "\n")
        assert tok.decode(ids) == whole[:-1]
        generated = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
        assert generated == enc(tok, CALL_ADD) + [end] + enc(tok, "5") + [end]
        assert t.num_turns == 1 and t.outcome == "success"
        assert (t.tool_calls, t.invalid_tool_calls) == (1, 0)  # on the record
    summary = mgr.run_group(_chat_task("sub", SubEnv), 1, "chat-sub", 2).result()
    assert [r % 10 for r in summary["rewards"]] == [1.0, 1.0], summary  # one invalid call
    for t in buf.get_batch(1, min_version=-1, timeout=10).result():
        text = tok.decode(t.prompt_ids + t.response_ids)
        assert f"<tool_response>\n{SUB_ERROR}\n</tool_response>" in text
        tool_part = [i for i, m in zip(t.response_ids, t.loss_mask) if not m]
        assert SUB_ERROR in tok.decode(tool_part)  # the error message is masked out
        assert t.tool_calls >= 1 and t.invalid_tool_calls == 1
    per_task = buf.stats().result()["tasks"]  # the step rows' traj/…/<task> counts
    assert per_task["add"]["tool_calls"] == 2 and per_task["add"]["invalid_tool_calls"] == 0
    assert per_task["sub"]["invalid_tool_calls"] == 2 and per_task["sub"]["tools_offered"] == 2
    stats = mgr.stats().result()
    assert stats["rollout/tool_turns"] >= 4 and stats["rollout/invalid_tool_calls"] >= 2


def test_chat_rollout_closes_cut_generations_and_fails_bad_observations(chat_rollout,
                                                                      chat_folder):
    from rollart.model import load_tokenizer

    mgr, buf = chat_rollout
    tok = load_tokenizer(chat_folder)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    before = mgr.stats().result()
    mgr.run_group(_chat_task("cut", TwoStepEnv, max_new_tokens=3, max_turns=2), 1, "chat-cut",
                  1).result()
    (t,) = buf.get_batch(1, min_version=-1, timeout=10).result()
    assert t.loss_mask[:4] == [1, 1, 1, 0] and t.response_ids[3] == end  # closed by rollart
    assert tok.decode(t.response_ids[:3]) == tok.decode(enc(tok, CALL_ADD)[:3])
    after = mgr.stats().result()
    assert after["rollout/cut_generations"] - before["rollout/cut_generations"] == 2
    summary = mgr.run_group(_chat_task("dictobs", DictObsEnv), 1, "chat-dict", 1).result()
    assert summary["outcomes"] == ["failed"]
    stats = mgr.stats().result()
    assert stats["rollout/bad_env_outputs"] - after["rollout/bad_env_outputs"] == 2  # + replacement


def test_chat_rollout_truncates_a_huge_observation_within_the_context(chat_rollout):
    import tracemalloc

    mgr, buf = chat_rollout
    before = mgr.stats().result()["rollout/truncated"]
    tracemalloc.start()  # this in-process cluster's workers run in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = mgr.run_group(_chat_task("huge", HugeChatObsEnv, max_new_tokens=4), 1,
                                "chat-huge", 1).result()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert summary["outcomes"] == ["truncated"]
    (t,) = buf.get_batch(1, min_version=-1, timeout=10).result()
    assert len(t.prompt_ids) + len(t.response_ids) == 512  # the model's context, full
    assert mgr.stats().result()["rollout/truncated"] - before == 1
    assert peak < 200e6  # the 10 MB observation is capped, never encoded whole
    # nor sent whole to the reward (a graph of ~10 MB warned "Sending large graph")
    assert not [w for w in caught if "large graph" in str(w.message)]


def test_evaluation_plays_the_same_chat_conversation_with_tool_turns(chat_folder):
    from rollart.observe.evaluate import evaluate

    add = _chat_task("add", AddEnv)
    out = evaluate(chat_folder, [add], seeds=range(3), temperature=1e-3,
                   conversation="chat", system_prompt="you add numbers")
    assert out == {"add": 1.0}  # called the tool, read its result, answered 5
    with pytest.raises(ValueError, match="conversation must be one of"):
        evaluate(chat_folder, [add], seeds=[0], conversation="template")


def test_run_warmup_trains_in_the_chat_format_within_the_model_context(chat_folder):
    import torch

    from rollart.model import load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup

    torch.manual_seed(0)
    model, tok = load_model(chat_folder), load_tokenizer(chat_folder)
    losses = run_warmup(model, tok, [_warm_task(HugeObsEnv)], steps=2, batch_size=2,
                        lr=1e-3, conversation="chat", system_prompt="you play a game")
    assert len(losses) == 2 and all(l == l and l > 0 for l in losses)  # finite, trained


def _add_task():
    """AddEnv with a warm-up policy that calls the tool, then answers with its result."""
    return Task(name="add", env_factory=AddEnv, reward_fn=tool_reward, max_turns=3,
                max_new_tokens=40,
                warmup_action=lambda rng, obs: CALL_ADD if obs == Q_ADD else obs)


def test_warmup_with_tools_undeclared_renders_no_tool_list_and_still_runs_the_calls(chatml):
    from rollart.trainer.warmup import play_random

    fmt = ConversationFormat(chatml, "chat")
    declared = chatml.decode(play_random(_add_task(), chatml, 1, random.Random(0), fmt).ids)
    log = play_random(_add_task(), chatml, 1, random.Random(0), fmt, declare_tools=False)
    bare = chatml.decode(log.ids)
    assert declared.startswith("<|im_start|>system\n# Tools\n<tools>")
    assert bare.startswith(f"<|im_start|>user\n{Q_ADD}<|im_end|>\n<|im_start|>assistant\n"
                           f"{CALL_ADD}<|im_end|>")  # the question right before the call
    # the call still ran: its result came back as a tool message and was answered
    assert "<tool_response>\n5\n</tool_response>" in bare
    assert bare.endswith("<|im_start|>assistant\n5<|im_end|>")
    assert declared.endswith(bare[len("<|im_start|>"):])  # the same episode after the tools
    generated = chatml.decode([t for t, m in zip(log.response_ids, log.loss_mask) if m])
    assert generated == f"{CALL_ADD}<|im_end|>5<|im_end|>"


def test_run_warmup_trains_the_tool_tasks_bare_first_on_their_turns_only(chat_folder):
    import torch

    from rollart.model import load_model, load_tokenizer
    from rollart.trainer import warmup

    model, tok = load_model(chat_folder), load_tokenizer(chat_folder)
    game, add = _warm_task(_Env), _add_task()
    seen = []
    real = warmup.warmup_batch

    def spy(tasks, *args, **kwargs):
        seen.append(([t.name for t in tasks], args[-1]))  # the stage's tasks, declare_tools
        return real(tasks, *args, **kwargs)

    steps = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warmup, "warmup_batch", spy)
        # lr 0: the weights stay as they are, so each loss can be recomputed below
        losses = warmup.run_warmup(model, tok, [game, add], steps=1, batch_size=4, lr=0.0,
                                   seed=7, conversation="chat", bare_tool_steps=2,
                                   on_step=steps.append)
    assert steps == [1, 2, 3] and len(losses) == 3
    assert seen == [(["add"], False)] * 2 + [(["warm", "add"], True)]

    fmt = ConversationFormat(tok, "chat", max_context=512)
    ids, attn, mask = real([add], tok, 4, random.Random(8), fmt, {}, False)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                            ids[:, 1:].reshape(-1), reduction="none")
    nll = nll.view(ids.size(0), -1)
    turns = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()  # the model's turns only
    everything = (nll * attn[:, 1:]).sum() / attn[:, 1:].sum()
    assert losses[0] == pytest.approx(turns.item(), rel=1e-4)
    assert abs(turns.item() - everything.item()) > 0.1  # the weighting is what differs


def test_bare_tool_warmup_names_what_to_fix(chat_folder):
    from rollart.model import load_model, load_tokenizer
    from rollart.trainer.warmup import run_warmup

    model, tok = load_model(chat_folder), load_tokenizer(chat_folder)
    with pytest.raises(ValueError, match=r"no task's env declares tools \(warm\): set it to 0"):
        run_warmup(model, tok, [_warm_task(_Env)], steps=1, batch_size=2, lr=1e-3,
                   conversation="chat", bare_tool_steps=3)
    with pytest.raises(ValueError, match="needs the chat format.*'raw': set it to 0"):
        run_warmup(model, tok, [_add_task()], steps=1, batch_size=2, lr=1e-3,
                   conversation="raw", bare_tool_steps=3)


# -- the rendering benchmark ---------------------------------------------------------------
@pytest.mark.bench
def test_chat_render_benchmark_tiny():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "chat_render.py"),
                          "--quick"], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = dict(kv.split("=") for kv in line.split()[1:])
    assert set(result) == {"games_cached", "games_full", "games_speedup", "all_cached",
                           "all_full", "all_speedup", "batches"}
    assert float(result["games_speedup"]) > 1.2, result  # measured 4.7x (20 batches)
