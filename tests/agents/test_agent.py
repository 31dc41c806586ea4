"""The agent endpoint (rollart.agents.agent, rollart.agents.endpoint) driven by the real
``openai`` client over HTTP on 127.0.0.1: a multi-call tool-using agent's trajectory is
the chat template's render of its turns with the loss on generated ids only; a history
the agent rewrote restarts the trajectory (counted); max_turns, bad requests, a wrong
key, a closed trajectory, streaming, async agents, an idle agent and a bad return value.

The policy here is scripted (each call generates the ids of a given text through the
real tokenizer, with log-probs and versions of the test's own), so the tests can say
which text each call produced; the graph-file test in test_agent_graph.py trains a real
model through a real cluster instead."""

import asyncio
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the agent tests use the openai client")

from rollart.agents.agent import AgentTask, agent_session, run_agent  # noqa: E402
from rollart.chat.conversation import ConversationFormat, TokenLog  # noqa: E402
from rollart.agents.endpoint import AgentServer  # noqa: E402
from rollart.env.protocol import EnvOutputError  # noqa: E402
from rollart.testing import ADD_TOOL, CHATML, CHATML_SPECIALS, bpe_tokenizer  # noqa: E402
from rollart.types import Episode, GenResult  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
SYSTEM, QUESTION = "you play a game", "what is 2 plus 3 ?"


def plain_agent(endpoint, seed):  # module level: an AgentTask's agent must pickle
    return 1.0


@pytest.fixture(scope="module")
def fmt():
    tok = bpe_tokenizer(CHATML_SPECIALS, CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    return ConversationFormat(tok, "chat", max_context=512)


@pytest.fixture(scope="module")
def loop():
    """An event loop on a thread of its own, as an env manager's worker has one."""
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(5)


def on(loop, coro, timeout=30):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


@pytest.fixture(scope="module")
def server(loop):
    async def make():
        return AgentServer()

    srv = on(loop, make())
    yield srv
    loop.call_soon_threadsafe(srv.stop)


class Script:
    """The policy of these tests: call k generates the ids of ``texts[k]`` and the
    end-of-turn token, log-prob -0.5 and version 7 each; ``requests`` keeps what came."""

    def __init__(self, fmt, texts):
        self.fmt, self.texts, self.requests = fmt, list(texts), []

    async def __call__(self, req, call):
        self.requests.append(req)
        ids = self.fmt.tokenizer.encode(self.texts[call], add_special_tokens=False)
        ids = list(ids) + [self.fmt.end_id]
        return GenResult(ids, [-0.5] * len(ids), [7] * len(ids), "stop")


def assert_render(fmt, ids, rendered):
    """``ids`` are the render up to the last generated end-of-turn token (the template's
    newline after it is not generated)."""
    full = fmt.tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[-1] == fmt.end_id and ids == full[:len(ids)]
    assert fmt.tokenizer.decode(full[len(ids):]) == "\n"


def task(**kw):
    return AgentTask(name="qa", agent=plain_agent, **{"max_turns": 4, **kw})


def session(fmt, texts, **kw):
    return agent_session(task(**kw), fmt, TokenLog(), Script(fmt, texts))


def client(endpoint, **kw):
    return openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                         max_retries=0, **kw)


def test_a_tool_using_agent_decodes_to_its_turns_with_loss_on_generated_ids(fmt, server):
    s = session(fmt, [CALL, "the number is 5"])
    ep = server.open(s, seed=3)
    c = client(ep)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = c.chat.completions.create(model=ep.model, messages=messages, tools=[ADD_TOOL])
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {
        "a": 2, "b": 3}
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = c.chat.completions.create(model=ep.model, messages=messages, tools=[ADD_TOOL])
    assert second.choices[0].message.content == "the number is 5"
    assert second.choices[0].finish_reason == "stop"
    assert second.usage.completion_tokens == len(
        fmt.tokenizer.encode("the number is 5", add_special_tokens=False)) + 1
    server.close(ep)
    # the trajectory is the template's render of the whole conversation (ChatML here is
    # prefix-stable), the policy's turns with their raw text
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
             {"role": "assistant", "content": CALL},
             {"role": "tool", "content": "5"},
             {"role": "assistant", "content": "the number is 5"}]
    rendered = fmt.tokenizer.apply_chat_template(turns, tools=[ADD_TOOL], tokenize=False)
    assert_render(fmt, s.log.ids, rendered)
    # loss mask 1 exactly on the two generations (with their end-of-turn ids)
    gen = [fmt.tokenizer.encode(t, add_special_tokens=False) + [fmt.end_id]
           for t in (CALL, "the number is 5")]
    picked = [i for i, m in zip(s.log.response_ids, s.log.loss_mask) if m]
    assert picked == gen[0] + gen[1]
    assert [lp for lp, m in zip(s.log.logprobs, s.log.loss_mask) if m] == [-0.5] * len(picked)
    assert [v for v, m in zip(s.log.versions, s.log.loss_mask) if m] == [7] * len(picked)
    assert set(v for v, m in zip(s.log.versions, s.log.loss_mask) if not m) == {-1}
    # each request continued the ids of the one before it
    r1, r2 = s.generate.requests
    assert r2.prompt_ids[:len(r1.prompt_ids)] == r1.prompt_ids
    done = s.episode("qa", 3, 1.0)
    assert done.env_rewards == [1.0] and done.info["success"] is True
    assert done.info["tool_calls"] == 1 and done.info["agent_calls"] == 2
    assert done.actions == [CALL, "the number is 5"] and not done.truncated


def test_a_rewritten_history_is_a_new_prompt_and_is_counted(fmt, server):
    s = session(fmt, ["up", "left"])
    ep = server.open(s, seed=0)
    c = client(ep)
    first = [{"role": "user", "content": "go"}]
    c.chat.completions.create(model=ep.model, messages=first)
    # the agent summarised its history instead of resending it
    edited = [{"role": "user", "content": "you went up . go again"}]
    out = c.chat.completions.create(model=ep.model, messages=edited)
    assert out.choices[0].message.content == "left"
    server.close(ep)
    assert s.counts.rewrites == 1
    assert s.counts.dropped_tokens == len(fmt.tokenizer.encode("up")) + 1
    turns = edited + [{"role": "assistant", "content": "left"}]
    rendered = fmt.tokenizer.apply_chat_template(turns, tokenize=False)
    assert_render(fmt, s.log.ids, rendered)
    assert sum(s.log.loss_mask) == len(fmt.tokenizer.encode("left")) + 1


def test_an_assistant_turn_resent_without_its_tool_call_is_a_rewrite(fmt, server):
    s = session(fmt, [CALL, "5"])
    ep = server.open(s, seed=0)
    c = client(ep)
    msgs = [{"role": "user", "content": QUESTION}]
    c.chat.completions.create(model=ep.model, messages=msgs, tools=[ADD_TOOL])
    msgs += [{"role": "assistant", "content": "I will add"}, {"role": "user", "content": "?"}]
    c.chat.completions.create(model=ep.model, messages=msgs, tools=[ADD_TOOL])
    server.close(ep)
    assert s.counts.rewrites == 1


def test_max_turns_bounds_the_calls_and_truncates(fmt, server):
    s = session(fmt, ["a", "b", "c"], max_turns=2)
    ep = server.open(s, seed=0)
    c = client(ep)
    msgs = [{"role": "user", "content": "go"}]
    for _ in range(2):
        out = c.chat.completions.create(model=ep.model, messages=msgs)
        msgs += [out.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "more"}]
    with pytest.raises(openai.BadRequestError, match="max_turns=2"):
        c.chat.completions.create(model=ep.model, messages=msgs)
    server.close(ep)
    assert s.episode("qa", 0, 0.0).truncated


def test_bad_requests_keys_and_closed_routes_get_clear_errors(fmt, server):
    s = session(fmt, ["a"])
    ep = server.open(s, seed=0)
    c = client(ep)
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model=ep.model, messages=[{"content": "no role"}])
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.chat.completions.create(model=ep.model, n=2,
                                  messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="text content"):
        c.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}])
    wrong = openai.OpenAI(base_url=ep.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=ep.model, messages=[{"role": "user",
                                                                 "content": "x"}])
    assert c.models.list().data[0].id == ep.model
    server.close(ep)
    with pytest.raises(openai.APIStatusError, match="over") as e:
        c.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 410
    assert s.counts.calls == 0  # refused requests are no turns


def test_streaming_and_max_tokens(fmt, server):
    s = session(fmt, ["the number is 5"])
    ep = server.open(s, seed=0)
    stream = client(ep).chat.completions.create(
        model=ep.model, messages=[{"role": "user", "content": "x"}], stream=True,
        max_tokens=3)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "the number is 5"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert s.generate.requests[0].max_new_tokens == 3  # can only lower the task's
    server.close(ep)


async def _async_agent(endpoint, seed):
    c = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                           max_retries=0)
    out = await c.chat.completions.create(model=endpoint.model, messages=[
        {"role": "user", "content": f"seed {seed}"}])
    return 1.0 if out.choices[0].message.content == "up" else 0.0


def _sync_agent(endpoint, seed):
    out = client(endpoint).chat.completions.create(model=endpoint.model, messages=[
        {"role": "user", "content": "go"}])
    return Episode("ignored", 0, [], [out.choices[0].message.content], [0.25],
                   {"success": False})


def _idle_agent(endpoint, seed):
    time.sleep(3)
    return 1.0


@pytest.mark.parametrize("agent", [_async_agent, _sync_agent])
def test_plain_and_async_agents_run_on_the_loop_of_their_endpoint(fmt, server, loop,
                                                                   agent):
    from concurrent.futures import ThreadPoolExecutor

    s = session(fmt, ["up"])
    ep = server.open(s, seed=5)
    with ThreadPoolExecutor(2) as pool:
        returned = on(loop, run_agent(agent, ep, s, 10.0, pool))
    done = s.episode("qa", 5, returned)
    if agent is _async_agent:
        assert returned == 1.0 and done.info["success"] is True
    else:
        assert done.env_rewards == [0.25] and done.actions == ["up"]
        assert done.task == "qa" and done.info["success"] is False
    assert s.closed and server.sessions.get(ep.api_key) is s  # the runner closes the route


def test_an_idle_agent_times_out_and_a_bad_return_is_named(fmt, server, loop):
    from concurrent.futures import ThreadPoolExecutor

    s = session(fmt, ["up"])
    ep = server.open(s, seed=0)
    with ThreadPoolExecutor(1) as pool, pytest.raises(TimeoutError, match="no call"):
        on(loop, run_agent(_idle_agent, ep, s, 0.5, pool))
    server.close(ep)
    with pytest.raises(EnvOutputError, match="returned str"):
        s.episode("qa", 0, "1.0")


def test_agent_task_checks_its_agent_and_pickles():
    import pickle

    with pytest.raises(TypeError, match="agent must be a function"):
        AgentTask(name="qa")
    t = task()
    assert pickle.loads(pickle.dumps(t)).agent is plain_agent
    with pytest.raises(TypeError, match="no env"):
        t.env_factory()


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3_coder"])
def test_tool_calls_come_back_in_openai_form_from_each_familys_syntax(server, family):
    from tool_families import FAMILIES  # tests/

    from rollart.chat.tool_formats import get_tool_format

    template, specials, eos = FAMILIES[family]
    tok = bpe_tokenizer(specials, template, eos=eos)
    if "<s>" in specials:
        tok.bos_token = "<s>"
    f = ConversationFormat(tok, "chat", max_context=1024)
    assert f.tool_format == family
    written = get_tool_format(family).format("add", {"a": 2, "b": 3})
    s = session(f, ["I add.\n" + written])
    ep = server.open(s, seed=0)
    out = client(ep).chat.completions.create(
        model=ep.model, messages=[{"role": "user", "content": QUESTION}], tools=[ADD_TOOL])
    server.close(ep)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {
        "a": 2, "b": 3}  # qwen3_coder's text values typed by the tool's schema
    assert out.choices[0].message.content == "I add."


def test_agent_tasks_without_a_chat_template_are_refused_at_start(tmp_path):
    from rollart import Graph, Policy
    from rollart.chat.template_support import ChatTemplateError
    from rollart.config.templates import check_templates
    from rollart.testing import save_folder, tiny_qwen2

    tok = bpe_tokenizer(CHATML_SPECIALS, None, eos="<|im_end|>", pad="<|endoftext|>")
    folder = save_folder(tmp_path / "m", tiny_qwen2(tok), tok)
    for policy in (Policy(model=folder, conversation="raw", warmup_steps=0),
                   Policy(model=folder, warmup_steps=0)):
        with pytest.raises(ChatTemplateError, match=r"agent tasks \(qa\) send chat"):
            check_templates(Graph(name="g", tasks=(task(),), policy=policy), folder)


# -- templates that ignore tools or refuse a role (issue 54) ------------------------------
#: ChatML that never shows ``tools=`` (as many small models' templates)
NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: the same, refusing a ``tool`` message (a template without a tool role)
NO_TOOL_ROLE = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception("
                "'tool messages are not supported') }}{% endif %}<|im_start|>{{ m.role }}\n"
                "{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_format(template):
    tok = bpe_tokenizer(CHATML_SPECIALS, template, eos="<|im_end|>", pad="<|endoftext|>")
    return ConversationFormat(tok, "chat", max_context=512)


@pytest.fixture(scope="module")
def no_tools():
    f = chatml_format(NO_TOOLS)
    assert not f.tools_rendered
    return f


def test_tools_in_prompt_writes_the_schemas_into_the_agents_system_prompt(no_tools,
                                                                          server):
    from rollart.chat.template_support import tools_prompt

    s = session(no_tools, [CALL], tools_in_prompt=True)
    ep = server.open(s, seed=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    out = client(ep).chat.completions.create(model=ep.model, messages=messages,
                                             tools=[ADD_TOOL])
    server.close(ep)
    assert out.choices[0].finish_reason == "tool_calls"
    # the prompt is the env path's: the tool schemas after the system text, then the user
    shown = [{"role": "system", "content": tools_prompt([ADD_TOOL], SYSTEM)},
             {"role": "user", "content": QUESTION}]
    assert s.log.prompt_ids == no_tools.render(shown, True)
    assert json.dumps(ADD_TOOL) in no_tools.tokenizer.decode(s.log.prompt_ids)
    assert s.fatal is None


def test_tools_the_template_ignores_are_refused_and_stop_the_run(no_tools, server):
    from rollart.chat.template_support import ChatTemplateError

    s = session(no_tools, [CALL])
    ep = server.open(s, seed=0)
    with pytest.raises(openai.BadRequestError, match=r"AgentTask\(tools_in_prompt=True\)"):
        client(ep).chat.completions.create(
            model=ep.model, messages=[{"role": "user", "content": QUESTION}],
            tools=[ADD_TOOL])
    server.close(ep)
    assert isinstance(s.fatal, ChatTemplateError) and "ignores tools=" in str(s.fatal)
    assert not s.generate.requests  # nothing was generated for it


def test_a_role_the_template_refuses_stops_the_run(server):
    from rollart.chat.template_support import ChatTemplateError

    s = session(chatml_format(NO_TOOL_ROLE), ["up", "left"])
    ep = server.open(s, seed=0)
    c = client(ep)
    msgs = [{"role": "user", "content": "go"}]
    out = c.chat.completions.create(model=ep.model, messages=msgs)
    msgs += [out.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": "x", "content": "5"}]
    with pytest.raises(openai.BadRequestError, match="roles: user assistant tool"):
        c.chat.completions.create(model=ep.model, messages=msgs)
    server.close(ep)
    assert isinstance(s.fatal, ChatTemplateError)
    assert "tool messages are not supported" in str(s.fatal)


def test_agent_task_tools_are_checked_at_start(tmp_path):
    from rollart import Graph, Policy
    from rollart.chat.template_support import ChatTemplateError
    from rollart.config.templates import check_templates
    from rollart.testing import save_folder, tiny_qwen2

    tok = bpe_tokenizer(CHATML_SPECIALS, NO_TOOLS, eos="<|im_end|>", pad="<|endoftext|>")
    folder = save_folder(tmp_path / "m", tiny_qwen2(tok), tok)
    policy = Policy(model=folder, warmup_steps=0)
    with pytest.raises(ChatTemplateError, match=r"AgentTask\(tools_in_prompt=True\)"):
        check_templates(Graph(name="g", tasks=(task(tools=[ADD_TOOL]),), policy=policy),
                        folder)
    for ok in (task(tools=[ADD_TOOL], tools_in_prompt=True), task()):
        check_templates(Graph(name="g", tasks=(ok,), policy=policy), folder)
    with pytest.raises(TypeError, match="tools must be a list of OpenAI tool schemas"):
        task(tools=["add"])


# -- replayed assistant messages -----------------------------------------------------------
def _first_turn_trained(fmt, s, text=CALL):
    """The loss mask still covers the ids generated at the first call."""
    gen = list(fmt.tokenizer.encode(text, add_special_tokens=False)) + [fmt.end_id]
    picked = [i for i, m in zip(s.log.response_ids, s.log.loss_mask) if m]
    return picked[:len(gen)] == gen


@pytest.mark.parametrize("replay", ["raw_text", "calls_alone", "reordered_arguments"])
def test_a_generated_tool_call_replayed_by_the_agent_keeps_its_tokens_trained(
        fmt, server, replay):
    """Agents rebuild the assistant turn of a tool-call exchange from their own record:
    the model's raw text, the calls alone, arguments re-serialised. It is still the turn
    the policy generated: no new prompt, the first generation stays trained."""
    s = session(fmt, [CALL, "the number is 5"])
    ep = server.open(s, seed=0)
    c = client(ep)
    msgs = [{"role": "user", "content": QUESTION}]
    out = c.chat.completions.create(model=ep.model, messages=msgs, tools=[ADD_TOOL])
    (call,) = out.choices[0].message.tool_calls
    args = {"b": 3, "a": 2} if replay == "reordered_arguments" else {"a": 2, "b": 3}
    turn = {"role": "assistant", "content": CALL if replay == "raw_text" else None,
            "tool_calls": [{"id": call.id, "type": "function", "function": {
                "name": "add", "arguments": json.dumps(args, separators=(",", ":"))}}]}
    msgs += [turn, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    c.chat.completions.create(model=ep.model, messages=msgs, tools=[ADD_TOOL])
    server.close(ep)
    assert s.counts.rewrites == 0 and s.counts.dropped_tokens == 0
    assert _first_turn_trained(fmt, s)
    gen = sum(len(fmt.tokenizer.encode(t, add_special_tokens=False)) + 1
              for t in (CALL, "the number is 5"))
    assert sum(s.log.loss_mask) == gen


def test_an_assistant_exchange_the_agent_adds_is_context_and_keeps_earlier_tokens(
        fmt, server):
    """An agent that replays a tool-call exchange after the reply (the same call again,
    and its result) adds context the policy reads, not a new prompt: what the policy
    generated stays trained, the added assistant turn is not (loss mask 0)."""
    s = session(fmt, [CALL, "the number is 5"], max_new_tokens=32)
    ep = server.open(s, seed=0)
    c = client(ep)
    msgs = [{"role": "user", "content": QUESTION}]
    out = c.chat.completions.create(model=ep.model, messages=msgs, tools=[ADD_TOOL])
    msg = out.choices[0].message.model_dump(exclude_none=True)
    replayed = {**msg, "content": CALL,  # this template shows content, not tool_calls
                "tool_calls": [{**msg["tool_calls"][0], "id": "call_replay"}]}
    msgs += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                   "content": "5"},
             replayed, {"role": "tool", "tool_call_id": "call_replay", "content": "5"}]
    c.chat.completions.create(model=ep.model, messages=msgs, tools=[ADD_TOOL])
    server.close(ep)
    assert s.counts.rewrites == 0 and _first_turn_trained(fmt, s)
    gen = sum(len(fmt.tokenizer.encode(t, add_special_tokens=False)) + 1
              for t in (CALL, "the number is 5"))
    assert sum(s.log.loss_mask) == gen  # the replayed turn is read, not trained
    text = fmt.tokenizer.decode(s.log.ids)
    assert text.count("<tool_response>\n5\n</tool_response>") == 2
    assert text.count(CALL) == 2 and not s.counts.truncated
