"""Cached chat-template renders: a new message costs one small encode, not a re-render.

Consumes a ``rollart.chat.conversation.ConversationFormat`` (its tokenizer and
``render``); produces the ids a conversation's opening prompt and each new message add,
the same ids the full render gives. Used by ``rollart.chat.conversation.Conversation``
(rollout, warm-up and evaluation), which falls back to the full render where this cache
answers ``None``.

Why: rendering the whole conversation through the Jinja template and encoding it again
for every new message made a chat warm-up batch spend most of its time in the template,
and a long system prompt with tools costs that at every turn.

How: a message is the template's text around its content. For each kind of render — the
opening prompt per (system prompt, tools); the messages added after an assistant turn
per (their roles, tools, whether there is a system prompt); the end of an assistant turn
after its content — the template is rendered once with sentinel contents and its text
split around them. A new message's text is then those pieces joined with its content,
encoded on its own. That equals the full render's delta when the template puts content
in verbatim (or stripped: both are tried) and the delta starts at a token boundary the
tokenizer keeps (a special token on either side). Both are checked at first use against
the full render, on probe conversations at two positions with two contents (one with
whitespace and newlines at its ends); a kind that fails is not cached and keeps the full
render.
"""

from __future__ import annotations

import json

_SENTINEL = "\x00ROLLART{}\x00"
# two contents per message: plain, and one a trimming template would change
_PROBE_CONTENTS = ("probe text . 1", " probe\nwith lines \n")
_TRANSFORMS = ((lambda s: s), str.strip)
_MISSING = object()
_MAX_KEYS = 512  # distinct kinds kept (system prompts x tools x roles): bounded memory


class TemplateCache:
    """Per-format cache of template pieces (one per ``ConversationFormat``)."""

    def __init__(self, fmt):
        self.fmt = fmt
        self._pieces: dict = {}  # key -> (pieces, transform) or None (not cacheable)

    # -- the three renders a conversation needs ----------------------------------------
    def prompt(self, system: str | None, content: str, tools=None) -> list[int] | None:
        """Ids of ``[system?, user content]`` with the generation prompt."""
        key = ("prompt", system, _tools_key(tools))
        found = self._get(key, lambda: self._prompt_pieces(system, tools))
        return None if found is None else self._encode(found, [content])

    def delta(self, new: list[dict], tools=None, system: bool = False,
              detached: bool = False) -> list[int] | None:
        """Ids ``new`` (messages after an assistant turn) add, generation prompt included:
        the full render's suffix (for a conversation in delta mode, ``detached``: the
        suffix on the probe conversation ``rollart.chat.deltas`` measures it on)."""
        roles = tuple(m["role"] for m in new)
        key = ("delta", roles, _tools_key(tools), system, detached)
        found = self._get(key, lambda: self._delta_pieces(roles, tools, system, detached))
        return None if found is None else self._encode(found, [m["content"] for m in new])

    def turn_tail(self, tools=None, system: bool = False) -> list[int] | None:
        """Ids the template puts after an assistant message's content, from its
        end-of-turn token on (``None``: not cacheable)."""
        key = ("tail", _tools_key(tools), system)
        return self._get(key, lambda: self._tail_ids(tools, system))

    # -- building and checking pieces ---------------------------------------------------
    def _get(self, key, build):
        # safe from several threads (the warm-up plays episodes on threads): a kind two
        # threads miss at once is built twice, the same pieces; a clear between another
        # thread's store and its read cannot lose what that thread returns
        found = self._pieces.get(key, _MISSING)
        if found is _MISSING:
            if len(self._pieces) >= _MAX_KEYS:
                self._pieces.clear()
            try:
                found = build()
            except Exception:  # noqa: BLE001 - a template that raises on the probe: the
                found = None   # full render (or delta) path says what is wrong
            self._pieces[key] = found
        return found

    def _encode(self, found, contents: list[str]) -> list[int]:
        pieces, transform = found[0], found[1]
        text = pieces[0] + "".join(transform(c) + p for c, p in zip(contents, pieces[1:]))
        return list(self.fmt.tokenizer.encode(text, add_special_tokens=False))

    def _text(self, messages, generation_prompt: bool, tools) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.fmt.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)

    def _checked(self, pieces, expected_of) -> tuple | None:
        """``(pieces, transform)`` for the first transform whose joined pieces encode to
        ``expected_of(contents)`` for every probe content; else ``None``."""
        if pieces is None:
            return None
        n = len(pieces) - 1
        for transform in _TRANSFORMS:
            found = (pieces, transform)
            if all(self._encode(found, [c] * n) == expected_of(c) for c in _PROBE_CONTENTS):
                return found
        return None

    def _prompt_pieces(self, system, tools):
        def msgs(c):
            return ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": c}]
        text = self._text(msgs(_SENTINEL.format(0)), True, tools)
        return self._checked(_split(text, 1), lambda c: self.fmt.render(msgs(c), True, tools))

    def _delta_pieces(self, roles, tools, system, detached):
        fmt = self.fmt

        def new(c):
            return [{"role": r, "content": c} for r in roles]
        sentinels = [{"role": r, "content": _SENTINEL.format(i)} for i, r in enumerate(roles)]
        # delta mode: one position, the probe's [user, assistant] (rollart.chat.deltas)
        bases = _bases(False)[:1] if detached else _bases(system)
        found = None
        for base in bases:  # the same pieces at two positions
            pieces = self._suffix_pieces(base, sentinels, tools)
            if found is not None and (pieces is None or pieces != found[0]):
                return None
            before = fmt.render(base, False, tools)

            def expected(c, base=base, before=before):
                after = fmt.render(base + new(c), True, tools)
                return after[len(before):] if after[:len(before)] == before else None
            found = self._checked(pieces, expected)
            if found is None:
                return None
        return found

    def _suffix_pieces(self, base, new, tools):
        before = self._text(base, False, tools)
        after = self._text(base + new, True, tools)
        if not after.startswith(before):
            return None
        return _split(after[len(before):], len(new))

    def _tail_ids(self, tools, system):
        """The ids of an assistant turn after its content, from the end-of-turn token
        on, checked against the full render at two positions."""
        fmt, end = self.fmt, self.fmt.end_id
        found = None
        for base in _bases(system):
            prompt_msgs = base[:-1]
            prompt_text = self._text(prompt_msgs, True, tools)
            text = self._text(prompt_msgs + [{"role": "assistant",
                                              "content": _SENTINEL.format(0)}], False, tools)
            pieces = (_split(text[len(prompt_text):], 1)
                      if text.startswith(prompt_text) else None)
            if pieces is None or (found is not None and pieces != found[0]):
                return None
            prompt = fmt.render(prompt_msgs, True, tools)

            def expected(c, prompt_msgs=prompt_msgs, prompt=prompt):
                full = fmt.render(prompt_msgs + [{"role": "assistant", "content": c}],
                                  False, tools)
                return full[len(prompt):] if full[:len(prompt)] == prompt else None
            found = self._checked(pieces, expected)
            if found is None:
                return None
        tail = list(fmt.tokenizer.encode(found[0][1], add_special_tokens=False))
        if end is None or end not in tail:
            return None
        return tail[len(tail) - 1 - tail[::-1].index(end):]


def _split(text: str, n: int) -> list[str] | None:
    """``text`` cut around sentinels 0..n-1, each there once and in order."""
    pieces, rest = [], text
    for i in range(n):
        s = _SENTINEL.format(i)
        if rest.count(s) != 1 or text.count(s) != 1:
            return None
        head, rest = rest.split(s)
        pieces.append(head)
    return pieces + [rest]


def _bases(system: bool) -> list[list[dict]]:
    """Two probe conversations ending with an assistant turn, at different positions."""
    head = [{"role": "system", "content": "probe system"}] if system else []
    one = head + [{"role": "user", "content": "probe one"},
                  {"role": "assistant", "content": "probe"}]
    return [one, one + [{"role": "user", "content": "probe two"},
                        {"role": "assistant", "content": "probe reply"}]]


def _tools_key(tools) -> str | None:
    return json.dumps(tools, sort_keys=True) if tools else None
