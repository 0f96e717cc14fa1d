"""Rank 0 in serve: a chat answer's text into the parts an API returns apart.

The text arrives as the client would see it (node.decode.text.AnswerText: think markers made
``<think>`` / ``</think>``, stop strings cut). Here it comes apart into reasoning (inside the
think block), content, and tool calls in the family's own markup: mlx-lm's tokenizer wrapper
knows the markers and the parser (``tool_call_start``, ``tool_call_end``, ``tool_parser``). A
call is parsed once its end marker arrives, or when the answer ends for families without one.
Markup that does not parse is kept as content: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

from cluster.core.protocol import Piece, ToolCall
from cluster.core.text import valid_text
from node.decode.reasoning import THINK_CLOSE, THINK_OPEN, held_back
from node.rank.numbers import host_float, host_floats, host_ints

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"
MOST_TRIES = 64  # parses of a cut section's prefixes


class Parts:
    """One answer's text, split as it streams; ``emit`` gets Piece and ToolCall events."""

    def __init__(self, request_id: str, tokenizer, tools: list | None, split: bool, emit,
                 json_calls: str | None = None):  # fmt: skip
        self.id = request_id
        # a forced call of a model without tool-call markup (node.decode.toolcalls): the
        # answer is the call as JSON, the arguments of the tool so named, or "required"'s
        # list of {"name", "arguments"}; it becomes the call when the answer ends
        self.json_calls = json_calls
        self.held = ""
        self.emit = emit
        self.tools = tools
        self.parser: Callable | None = None
        self.format: Any = None  # the family's (node.decode.toolcalls.Format), with a parser
        self.transitions: dict[str, list[tuple[str, str]]] = {CONTENT: [], REASONING: []}
        if split:
            self.transitions[CONTENT].append((THINK_OPEN, REASONING))
            self.transitions[REASONING].append((THINK_CLOSE, CONTENT))
        start = getattr(tokenizer, "tool_call_start", None)
        if split and tools and start and getattr(tokenizer, "tool_parser", None):
            self.parser = tokenizer.tool_parser
            for state in (CONTENT, REASONING):
                self.transitions[state].append((start, TOOL))
            end = getattr(tokenizer, "tool_call_end", None)
            self.transitions[TOOL] = [(end, CONTENT)] if end else []
            self.start_marker = start
            from node.decode.toolcalls import format_of

            self.format = format_of(tokenizer)
        self.state = CONTENT
        self.pending = ""  # text not yet shown: it may be the start of a marker
        self.call = ""  # the tool call's markup so far
        self.trim = False  # drop the whitespace that follows a marker
        self.calls = 0
        self.logprobs: list[dict[str, Any]] = []

    def token(self, entry: dict[str, Any]) -> None:
        """One decoded token's logprobs: they travel with the next piece."""
        self.logprobs.append(entry)

    def feed(self, text: str) -> None:
        self.pending += text
        while True:
            edges = self.transitions.get(self.state, [])
            hits = [(i, m, to) for m, to in edges if (i := self.pending.find(m)) >= 0]
            if not hits:
                break
            i, marker, to = min(hits)
            self.out(self.pending[:i])
            self.pending = self.pending[i + len(marker) :]
            if self.state == TOOL and not self.emit_calls(self.call):
                self.call += marker  # not the call's end: its text holds the marker (JSON)
                continue
            if self.state == TOOL:  # the call is whole, and sent
                self.call, self.state, self.trim = "", to, True
                continue
            self.switch(to, marker)
        cut = len(self.pending) - held_back(self.pending, [m for m, _ in edges])
        self.out(self.pending[:cut])
        self.pending = self.pending[cut:]
        self.send_logprobs()

    def finish(self, cut: bool = False) -> bool:
        """The answer ended: what is held back goes out. True if the model called a tool.
        ``cut``: max_tokens ended it. A call it cut short is dropped, never returned with
        arguments it did not finish, nor as markup in the content; the calls written whole
        before it are returned (a section's too, and a JSON answer's list)."""
        if cut and self.state == TOOL:
            self.pending, self.call = "", self.call + self.pending
            self.whole_calls(self.call)
            self.call, self.state = "", CONTENT
        elif cut and self.parser is not None and self.start_marker.startswith(self.pending):
            self.pending = ""  # a call's opening marker, cut before it was whole
        self.out(self.pending)
        self.pending = ""
        if self.state == TOOL:
            self.switch(CONTENT, "")
        if self.json_calls is not None:
            self.json_answer(cut)
        self.send_logprobs()
        return self.calls > 0

    def whole_calls(self, markup: str) -> None:
        """The calls of a cut section written whole (at each place a call ends, from the
        last, the markup closed there as the format closes it, until it parses); a format of
        one call per pair of markers has none: its call is the one cut."""
        fmt = self.format
        if fmt is None or not fmt.section or not fmt.call_end:
            return
        at, tries = len(markup), 0
        while (at := markup.rfind(fmt.call_end, 0, at)) >= 0 and tries < MOST_TRIES:
            end = at + len(fmt.call_end)
            for closer in (*fmt.closers, ""):
                tries += 1
                if fmt.whole(markup[:end] + closer) and self.emit_calls(markup[:end] + closer):
                    return

    def json_answer(self, cut: bool = False) -> None:
        """The held answer as the forced call(s); text that is not one is sent as content
        (nothing is lost), unless max_tokens cut it (``cut``): then the calls of a list
        written whole are returned, the one cut is dropped."""
        text, self.held = self.held, ""
        if cut:
            self.json_whole_calls(text)
            return
        try:
            value = json.loads(text)
            if self.json_calls == "required":
                found = [(c["name"], c["arguments"]) for c in value]
            else:
                found = [(self.json_calls, value)]
            if not found or not all(isinstance(n, str) and isinstance(a, dict) for n, a in found):
                raise ValueError("not a tool call")
        except (ValueError, TypeError, KeyError):
            if text:
                self.emit(Piece(self.id, text, CONTENT, self.logprobs or None))
                self.logprobs = []
            return
        for name, arguments in found:
            self.emit(ToolCall(self.id, self.calls, valid_text(name), arguments_json(arguments)))
            self.calls += 1

    def json_whole_calls(self, text: str) -> None:
        """A cut JSON answer of "required": the ``{"name", "arguments"}`` items before the
        one cut (a named call's arguments cut short give none)."""
        if self.json_calls != "required":
            return
        decoder, at = json.JSONDecoder(), text.find("[") + 1
        found = []
        while 0 < at < len(text):
            while at < len(text) and text[at] in " \t\n\r,":
                at += 1
            try:
                item, at = decoder.raw_decode(text, at)
            except ValueError:
                break
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("arguments"), dict)):  # fmt: skip
                break
            found.append(item)
        for item in found:
            self.emit(ToolCall(self.id, self.calls, valid_text(item["name"]),
                               arguments_json(item["arguments"])))  # fmt: skip
            self.calls += 1

    def switch(self, to: str, marker: str) -> None:
        """Into state ``to``; the whitespace after a marker is dropped, unless the marker
        closed markup that did not parse (that stays as the model wrote it)."""
        parsed = True
        if self.state == TOOL:
            parsed = self.parse(self.call, marker)
            self.call = ""
        elif to == TOOL:
            self.call = ""
        self.state = to
        self.trim = parsed

    def out(self, text: str) -> None:
        if self.state == TOOL:
            self.call += text
            return
        if self.json_calls is not None and self.state == CONTENT:
            self.held += text
            return
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        if text or self.logprobs:
            self.emit(Piece(self.id, text, self.state, self.logprobs or None))
            self.logprobs = []

    def send_logprobs(self) -> None:
        if self.logprobs:
            self.emit(Piece(self.id, "", self.state if self.state != TOOL else CONTENT,
                            self.logprobs))  # fmt: skip
            self.logprobs = []

    def parse(self, markup: str, end: str) -> bool:
        if self.emit_calls(markup):
            return True
        self.state = CONTENT
        self.trim = False
        self.out(self.start_marker + markup + end)  # as written: nothing is lost
        return False

    def emit_calls(self, markup: str) -> bool:
        """The calls the family's parser reads in ``markup``, sent; False (nothing sent)
        when it reads none."""
        try:
            if self.parser is None:  # markup is only looked for with a parser: never here
                raise ValueError("no tool parser")
            parsed = self.parser(markup, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            found = [
                (c["name"], c.get("arguments", {}), c.get("id"))
                for c in calls
                if isinstance(c, dict) and isinstance(c.get("name"), str)
            ]
            if not found:
                raise ValueError("no function name in it")
        except Exception:  # the family's parser: ValueError, JSONDecodeError, KeyError, ...
            return False
        for name, arguments, call_id in found:
            arguments = arguments if isinstance(arguments, str) else arguments_json(arguments)
            self.emit(ToolCall(self.id, self.calls, valid_text(name), valid_text(arguments),
                               None if call_id is None else valid_text(str(call_id))))  # fmt: skip
            self.calls += 1
        return True


def arguments_json(value: Any) -> str:
    """A parser's arguments as JSON text, whatever they hold: mlx-lm's parsers that use
    ``ast.literal_eval`` can give sets, tuples, bytes, complex numbers or non-finite floats,
    which JSON has no form for; those become lists or strings, and a number past a double's
    range (1e999) the largest double (nothing the model wrote is dropped, the call still
    reaches the client, and a number stays a number)."""
    return json.dumps(plain(value), ensure_ascii=False, allow_nan=False)


def plain(value: Any, depth: int = 0) -> Any:
    if depth > 64:
        return valid_text(repr(value)[:10_000])
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):  # past a double's range: the largest, still a number
        if math.isinf(value):
            return math.copysign(sys.float_info.max, value)
        return value if math.isfinite(value) else str(value)  # NaN has no JSON form
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict):
        return {valid_text(str(k)): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v, depth + 1) for v in value]
    return valid_text(str(value))


def token_logprobs(tokenizer, token: int, logprobs, top: int) -> dict[str, Any]:
    """OpenAI's logprobs entry of one token: its text, log-probability, UTF-8 bytes and the
    ``top`` likeliest tokens at that step (``logprobs``: the step's log-softmax, an mx.array)."""
    import mlx.core as mx

    def entry(i: int, value: float) -> dict[str, Any]:
        text = tokenizer.decode([i])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    chosen = entry(token, host_float(logprobs[token]))
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = host_floats(logprobs[ids])
        ranked = sorted(zip(host_ints(ids), values, strict=True), key=lambda p: -p[1])
        chosen["top_logprobs"] = [entry(i, v) for i, v in ranked]
    else:
        chosen["top_logprobs"] = []
    return chosen
