"""How a trajectory becomes token ids: the one definition, for rollout, warm-up and eval.

Consumes a tokenizer (and, where there is one, its model folder's
``generation_config.json``), a ``Task`` and the env's text; produces a ``TokenLog``:
prompt ids, then response ids with a loss mask, behaviour log-probs and versions.
``TrajectoryRunner`` (rollout), ``rollart.trainer.warmup.play_random`` and
``rollart.observe.evaluate`` all build their ids here, so a model is trained, warmed up and
evaluated on exactly one format.

Two formats (``Policy.conversation``; ``"auto"`` picks ``chat`` when the tokenizer has
a chat template, else ``raw``):

* ``raw``: observation ids, generated ids (ending with the stop token), next
  observation ids, … — plain concatenation, for the built-in word-level toy.
* ``chat``: messages rendered by the tokenizer's own chat template: an optional system
  prompt (``Task.system_prompt``, else ``Policy.system_prompt``), each observation a
  ``user`` message (a tool's result a ``tool`` message), each generation the
  ``assistant`` message; an env with ``tools`` has them rendered through ``tools=``.
  A template without a system role gets the system prompt folded into the first user
  turn; ``Task.tools_in_prompt`` writes the tools into the system prompt instead of
  ``tools=`` (``rollart.chat.template_support``, which also checks at start that the
  template shows a task's tools). The template also tells how the model writes tool
  calls: ``ConversationFormat.tool_format`` (``rollart.chat.tool_formats``; hermes in raw
  mode), unless ``Task.tool_format`` says otherwise.

Token in, token out: the ids the policy generated are kept verbatim (never decoded and
re-encoded). Each new message adds only the template's delta: the end of the assistant
turn the policy did not generate itself (a generation cut by ``max_new_tokens`` gets its
end-of-turn token here), the new user/tool turn and the generation prompt — found by
rendering the conversation with and without the new message and keeping the suffix.
Where the template renders prefix-stably the ids equal
``apply_chat_template(messages, add_generation_prompt=True)`` of the whole conversation.
A template that re-renders history differently as a conversation grows (one that drops
past ``<think>`` blocks, moves its tool list before the newest user turn, or insists on
alternating user and assistant turns) is not prefix-stable: such a conversation is kept
in delta mode (``rollart.chat.deltas``): each new message appends the ids the template
writes after an assistant turn, measured on a probe conversation, so training sees the
very tokens generation saw.

Loss mask: 1 on every generated token, the end-of-turn token the policy generated
included; 0 on everything rollart adds. Stops: the template's end-of-turn token, the
``eos`` ids of the tokenizer and of ``generation_config.json``, plus ``Task.stop``
strings (the engines stop on them). Memory is bounded: text is capped before it is
encoded (``cap_text``), and ids never grow past ``max_context``.

How a task reads its action out of the assistant's text (``Task.parse_action``) is
``rollart.chat.actions``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rollart.chat import deltas
from rollart.chat import template_support as support
from rollart.chat.deltas import ConversationError
from rollart.chat.template_cache import TemplateCache
from rollart.chat.tool_formats import detect_tool_format

#: values of ``Policy.conversation``
CONVERSATIONS = ("auto", "chat", "raw")
#: at most this many characters of text are encoded per token of room left (a cap far
#: above any tokenizer's characters per token, so only text that cannot fit is cut)
CHARS_PER_TOKEN = 64
_WARNED = deltas._NOTED  # templates already noted as not prefix-stable (once per process)

# -- the token log -----------------------------------------------------------------------
@dataclass
class TokenLog:
    """A trajectory's token ids as they grow, with per-token generation metadata."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_observation(self, ids: list[int]) -> None:
        """Ids rollart adds (env text, template tokens): loss mask 0."""
        if not self.prompt_ids and not self.response_ids:
            self.prompt_ids = list(ids)
            return
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generation(self, token_ids, logprobs=None, versions=None) -> None:
        """Ids the policy generated: loss mask 1."""
        n = len(token_ids)
        self.response_ids += list(token_ids)
        self.loss_mask += [1] * n
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * n
        self.versions += list(versions) if versions is not None else [0] * n


def cap_text(text: str, max_tokens: int) -> str:
    """``text`` cut to what ``max_tokens`` tokens could possibly hold (bounded memory:
    a huge observation is never encoded whole)."""
    limit = max(int(max_tokens), 1) * CHARS_PER_TOKEN
    return text if len(text) <= limit else text[:limit]


def context_budget(model_path, override: int | None = None, default: int = 2048) -> int:
    """The context budget (prompt + generation) in tokens: ``override`` when given,
    else the model config's ``max_position_embeddings``."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 2:
            raise ValueError(f"max_context must be an int >= 2 or None, got {override!r}")
        return override
    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return default
    return int(config.get("max_position_embeddings") or default)


# -- the format (one per tokenizer) ------------------------------------------------------
class ConversationFormat:
    """How conversations are rendered with one tokenizer; ``start`` makes one.

    >>> # fmt = ConversationFormat(tokenizer, "auto", max_context=4096)
    >>> # conv = fmt.start(TokenLog(), task, first_observation)
    """

    def __init__(self, tokenizer, conversation: str = "auto", *,
                 system_prompt: str | None = None, max_context: int = 2048,
                 model_path: str | None = None, cache: bool = True, strict: bool = False):
        if conversation not in CONVERSATIONS:
            raise ValueError(f"conversation must be one of {CONVERSATIONS}, got "
                             f"{conversation!r}")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.max_context = int(max_context)
        self.strict = strict  # no system role: raise (ChatTemplateError), not fold
        template = getattr(tokenizer, "chat_template", None)
        self.name = name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if conversation == "chat" and not template:
            raise ConversationError(
                f"conversation='chat' but the tokenizer of {name!r} has no chat template: "
                "set Policy.conversation='raw' (plain concatenation of observation and "
                "action ids) or give the tokenizer a chat template (tokenizer.chat_template "
                "= '...', then save_pretrained)")
        self.mode = "chat" if conversation == "chat" or (conversation == "auto" and
                                                         template) else "raw"
        # how the model writes tool calls (Task.tool_format overrides it: tool_format_of)
        self.tool_format = detect_tool_format(template) if self.mode == "chat" else "hermes"
        # its tool messages carry a tool_call_id (rollart.chat.deltas.tool_message)
        self.call_ids = self.mode == "chat" and "tool_call_id" in (template or "")
        self.prefix_stable = self.system_role = self.tools_rendered = True
        self.stable_kinds: dict = {}  # (system?, tools) -> prefix-stable (rollart.chat.deltas)
        self.end_id: int | None = None  # the template's end-of-turn token (chat)
        eos = _eos_ids(tokenizer, model_path or getattr(tokenizer, "name_or_path", None))
        if self.mode == "chat":
            self.system_role, self.tools_rendered = support.probe(self)
            if system_prompt and not self.system_role and strict:
                raise support.no_system_role(name, "Policy.system_prompt")
            self.end_id = self._probe_end_id()
            # without tools, with the system prompt where it has a role; a conversation
            # asks again with its own tools (Conversation.detached)
            self.prefix_stable = deltas.stable(self, bool(system_prompt and self.system_role))
        # the opening prompt and each new message from cached template pieces (one small
        # encode each, checked against the full render at first use); None: full renders
        self.cache = TemplateCache(self) if cache and self.mode == "chat" else None
        ends = ([self.end_id] if self.end_id is not None else []) + eos
        self.stop_ids = tuple(dict.fromkeys(ends))
        if not self.stop_ids:
            raise ConversationError(
                f"the tokenizer of {name!r} has no eos or end-of-turn token, so a "
                "generation could never stop: give it an eos_token (tokenizer.eos_token = "
                "'...') or a chat template that ends each turn with a special token")

    def start(self, log: TokenLog, task, observation: str, tools=None) -> "Conversation":
        """A conversation whose first prompt (system prompt + ``observation``) is in
        ``log``."""
        system, tools = support.opening(self, task, tools)  # folded / tools in the prompt
        return Conversation(self, log, system, observation, tools)

    # -- chat template plumbing ----------------------------------------------------------
    def render(self, messages: list[dict], generation_prompt: bool, tools=None) -> list[int]:
        """``apply_chat_template(messages)`` as ids (rendered text, then encoded)."""
        return self.encode(self.render_text(messages, generation_prompt, tools))

    def render_text(self, messages: list[dict], generation_prompt: bool, tools=None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _probe_end_id(self) -> int | None:
        """The last special token of an assistant turn as the template renders it."""
        user = [{"role": "user", "content": "probe"}]
        prompt = self.render(user, True)
        full = self.render(user + [{"role": "assistant", "content": "probe"}], False)
        special = _special_ids(self.tokenizer)
        turn = full[len(prompt):] if full[:len(prompt)] == prompt else full
        for tok in reversed(turn):
            if tok in special:
                return int(tok)
        return None


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _eos_ids(tokenizer, model_path) -> list[int]:
    """The tokenizer's eos id, then the eos ids of ``generation_config.json``."""
    out = [tokenizer.eos_token_id]
    if model_path and os.path.isfile(os.path.join(str(model_path), "generation_config.json")):
        try:
            with open(os.path.join(str(model_path), "generation_config.json")) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        out += [eos] if isinstance(eos, int) else list(eos or [])
    return [int(t) for t in out if t is not None]


# -- one conversation --------------------------------------------------------------------
class Conversation:
    """One trajectory's messages and ids (made by ``ConversationFormat.start``).

    ``add_generation`` appends what the policy generated (loss mask 1) and returns the
    assistant text; ``add_user`` / ``add_tool_results`` append a new message's delta
    (loss mask 0). ``room(n)`` says whether ``n`` more tokens fit the context budget;
    ``truncated`` is set once text had to be cut to fit; ``detached`` once the template
    re-renders this conversation as it grows (delta mode, ``rollart.chat.deltas``: found
    at start for its system prompt and tools, or at the first render that fails).
    """

    def __init__(self, fmt: ConversationFormat, log: TokenLog, system: str | None,
                 observation: str, tools=None):
        self.fmt, self.log, self.tools = fmt, log, tools or None
        self.truncated = False
        self.cut = 0  # generations closed by rollart (cut by max_new_tokens)
        self.messages: list[dict] = []
        self._ended = True  # the last generation ended with a stop id
        self.detached = False  # delta mode: new messages appended as probe deltas
        if fmt.mode == "raw":
            self._append(self._encode(observation))
            return
        content = self._cap(observation)
        if system and not fmt.system_role:  # e.g. Gemma's templates: fold it in
            system, content = None, support.fold_system(system, content)
        if system:
            self.messages.append({"role": "system", "content": system})
        self.messages.append({"role": "user", "content": content})
        self.detached = not deltas.stable(fmt, bool(system), self.tools)
        cached = fmt.cache.prompt(system, self.messages[-1]["content"], self.tools) if (
            fmt.cache is not None) else None
        # the template's view of the conversation so far (None: not rendered, see _closing)
        self._prompt = cached if cached is not None else fmt.render(self.messages, True,
                                                                    self.tools)
        self._append(self._prompt)

    @classmethod
    def of_messages(cls, fmt: ConversationFormat, log: TokenLog, messages: list[dict],
                    tools=None) -> "Conversation":
        """A chat conversation whose prompt is ``messages`` as the template renders them
        (an agent's request: ``rollart.agents.agent``). A system message under a template
        without a system role is folded into the first user message, as ``start``
        does (``Policy.strict_template``: ``ChatTemplateError``)."""
        if fmt.mode != "chat":
            raise ConversationError("an agent's messages need a chat template: the "
                                    f"tokenizer of {fmt.name!r} is used in raw mode")
        self = cls.__new__(cls)
        self.fmt, self.log, self.tools = fmt, log, tools or None
        self.truncated, self.cut, self._ended = False, 0, True
        msgs = [dict(m) for m in messages]
        if msgs and msgs[0]["role"] == "system" and not fmt.system_role:
            if fmt.strict:
                raise support.no_system_role(fmt.name, "the agent's system message")
            support.note_fold(fmt.name)
            system = msgs.pop(0)["content"]
            first = next((m for m in msgs if m["role"] == "user"), None)
            if first is None:
                msgs.insert(0, {"role": "user", "content": system})
            else:
                first["content"] = support.fold_system(system, first["content"])
        for m in msgs:
            m["content"] = self._cap(m.get("content") or "")
        self.messages = msgs
        self.detached = not deltas.stable(fmt, bool(msgs) and msgs[0]["role"] == "system",
                                          self.tools)
        self._prompt = fmt.render(msgs, True, self.tools)
        self._append(self._prompt)
        return self

    def room(self, max_new_tokens: int) -> bool:
        return len(self.log) + max_new_tokens <= self.fmt.max_context

    # -- the policy's turn ---------------------------------------------------------------
    def add_generation(self, token_ids, logprobs=None, versions=None,
                       finish_reason: str = "stop") -> str:
        """Keep the generated ids verbatim; return the assistant text (no end token)."""
        ids = list(token_ids)
        self.log.add_generation(ids, logprobs, versions)
        stops = self.fmt.stop_ids
        content = ids
        for j, t in enumerate(ids):
            if t in stops:
                content = ids[:j]
                break
        stopped = len(content) < len(ids)
        if finish_reason == "length" and not stopped:
            self.cut += 1
        # the turn is over in the template's terms only with its own end-of-turn token (a
        # generation that ended with another eos, e.g. <|endoftext|>, gets it added)
        end = self.fmt.end_id
        self._ended = stopped and (end is None or ids[len(content)] == end)
        tok = self.fmt.tokenizer
        if self.fmt.mode == "raw":
            return tok.decode(content, skip_special_tokens=True)
        text = tok.decode(content, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def add_text_generation(self, text: str) -> str:
        """A generation given as text (the warm-up's random actions): its ids and the
        end-of-turn token, as the policy would have produced them."""
        ids = list(self.fmt.tokenizer.encode(text, add_special_tokens=False))
        return self.add_generation(ids + [self.fmt.stop_ids[0]])

    # -- the env's turn ------------------------------------------------------------------
    def add_user(self, text: str) -> None:
        """The env's next observation (a ``user`` message in chat)."""
        if self.fmt.mode == "raw":
            self._append(self._encode(text))
            return
        self._add_messages([{"role": "user", "content": self._cap(text)}])

    def add_tool_results(self, results: list[str]) -> None:
        """Tool results, one ``tool`` message each (chat; raw: concatenated text)."""
        if self.fmt.mode == "raw":
            self._append(self._encode("\n".join(results)))
            return
        # a call id by the result's place, counted only where the template reads ids
        first = sum(m["role"] == "tool" for m in self.messages) if self.fmt.call_ids else 0
        self._add_messages([deltas.tool_message(self.fmt, self._cap(r), first + i)
                            for i, r in enumerate(results)])

    def add_messages(self, new: list[dict]) -> None:
        """Messages after the last assistant turn (an agent's ``user`` / ``tool``
        messages, with their own keys such as ``tool_call_id``), each capped."""
        self._add_messages([{**m, "content": self._cap(m.get("content") or "")}
                            for m in new])

    def _add_messages(self, new: list[dict]) -> None:
        plain = all(m.keys() <= {"role", "content"} for m in new)  # the cache keys no more
        cached = self._cached_delta(new) if plain else None
        ids = cached
        if ids is None and not self.detached:
            ids = self._full(new)
        if ids is None:  # delta mode: keep what the policy saw, append the new turn's ids
            if not self.detached:  # found here, not by the probe (e.g. a tool-call turn)
                self.detached = True
                deltas.note(self.fmt.name)
            ended = self._ended or self.messages[-1]["role"] != "assistant"
            ids = deltas.turn_delta(self.fmt, new, self.tools, ended)
        self.messages.extend(new)
        if cached is not None or self.detached:
            self._prompt = None
        self._append(ids)

    def _full(self, new: list[dict]) -> list[int] | None:
        """The ids ``new`` adds as the suffix of the whole conversation's render (the
        last prompt rendered kept in ``_prompt``); ``None`` where the render of the
        grown conversation does not extend the previous one, or raises."""
        fmt, tools = self.fmt, self.tools
        try:
            before = fmt.render(self.messages, False, tools)
            after = fmt.render(self.messages + new, True, tools)
            if after[:len(before)] != before:
                return None
            ids = self._closing(before) + after[len(before):]
        except Exception:  # noqa: BLE001 - e.g. a template insisting on alternation
            return None
        self._prompt = after
        return ids

    def _cached_delta(self, new: list[dict]) -> list[int] | None:
        """The ids ``new`` adds from the format's cached pieces (the end of the turn the
        policy did not generate, then the new messages); ``None`` where not cached."""
        cache = self.fmt.cache
        if cache is None or self.messages[-1]["role"] != "assistant":
            return None
        system = self.messages[0]["role"] == "system"
        tail = cache.turn_tail(self.tools, system)
        delta = (cache.delta(new, self.tools, system, self.detached) if tail is not None
                 else None)
        if delta is None:
            return None
        return (tail[1:] if self._ended else tail) + delta

    def _closing(self, before: list[int]) -> list[int]:
        """What the template puts after the assistant text that the policy did not
        generate: the rest of the turn after its end token, and the end token itself
        when the generation was cut."""
        if self.messages[-1]["role"] != "assistant":
            return []
        prompt = self._prompt
        if prompt is None:  # the last prompt came from the cache: render it
            prompt = self.fmt.render(self.messages[:-1], True, self.tools)
        turn = before[len(prompt):] if before[:len(prompt)] == prompt else None
        if turn is None:  # re-rendered history: measure the turn on the probe instead
            user = [{"role": "user", "content": "probe"}]
            prompt = self.fmt.render(user, True, self.tools)
            full = self.fmt.render(user + [{"role": "assistant", "content": "probe"}],
                                   False, self.tools)
            turn = full[len(prompt):]
        end = self.fmt.end_id
        at = max((j for j, t in enumerate(turn) if t == end), default=None)
        if at is None:  # the template ends a turn without a special token
            return [] if self._ended else [self.fmt.stop_ids[0]]
        return turn[at + 1:] if self._ended else turn[at:]

    # -- bounded growth ------------------------------------------------------------------
    def _cap(self, text: str) -> str:
        room = max(self.fmt.max_context - len(self.log), 1)
        capped = cap_text(text, room)
        if len(capped) < len(text):
            self.truncated = True
        return capped

    def _encode(self, text: str) -> list[int]:
        return list(self.fmt.tokenizer.encode(self._cap(text), add_special_tokens=False))

    def _append(self, ids: list[int]) -> None:
        room = self.fmt.max_context - len(self.log)
        if len(ids) > room:
            ids = ids[:max(room, 0)]
            self.truncated = True
        self.log.add_observation(ids)
