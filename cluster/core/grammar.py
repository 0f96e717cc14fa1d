"""Grammars from what a user or a client asks for (a JSON schema, a regex, a Lark grammar),
as llguidance's grammar text, checked without a tokenizer, so that a bad one is refused where
it is asked for (a 400 naming the keyword, a usage error) and never reaches a rank.

llguidance needs no mlx: the launcher checks here; every rank compiles the same text against
the model's tokens (node.grammar). Checking is bounded by llguidance's limits (node.grammar's
LIMITS: the lexer's states, the grammar's size) and cached by text: an agent sends the same
schema every turn.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from typing import Any

# JSON as json.dumps and chat templates' tojson write it (one space after ',' and ':') and no
# other whitespace: an answer's length is then bounded by the schema's, not by how much
# whitespace a model likes
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's bounds on one request's matcher, every one set here (not its defaults, which
# change between releases): each is counted, not timed, so a request that passes one fails at
# the same token on every rank. A matcher is one request's (node.decode.grammar): its lexer's
# states count against this request alone. Rank 0 also times each request's grammar work per
# step against the step (node.decode.grammar.Budget): counts bound one step, time the rest.
# - max_items_in_row: an Earley row (llguidance's default): an object of ~500 optional
#   properties needs ~2,000;
# - step_max_items: items made computing one mask, 1/5 of the default (50,000); a highly
#   ambiguous grammar reaches it within a few hundred tokens, JSON schemas stay far under;
# - step_lexer_fuel: the lexer's work for one mask (the default, ~3-14 ms);
# - initial_lexer_fuel: building the lexer at the start (the default);
# - max_lexer_states: 50,000 states are ~30-100 MB (the default, 250,000, up to 500 MB);
# - max_grammar_size: symbols in the grammar's productions (the default).
LIMITS: dict[str, Any] = {
    "max_items_in_row": 2_000,
    "step_max_items": 10_000,
    "step_lexer_fuel": 200_000,
    "initial_lexer_fuel": 1_000_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 500_000,
}
MAX_SOURCE = 1 << 20  # characters of a schema, regex or grammar
# a constrained request's tools (forced or strict calls): what their grammar may hold, checked
# before it is built (its size follows the properties; its parse, their nesting)
MOST_TOOL_PROPERTIES = 2_000  # properties of every tool's schema, nested ones too
MOST_TOOL_DEPTH = 24  # schemas within schemas (properties, items, anyOf, ...)


class BadGrammar(ValueError):
    """What was asked is not a grammar llguidance takes; the message says why (the keyword)."""


def json_schema(schema: Any) -> str:
    """The grammar of JSON values that ``schema`` (an object, or its JSON text) allows."""
    import llguidance

    if isinstance(schema, str):
        schema = json_text(schema)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise BadGrammar("a JSON schema is an object")
    text = json.dumps(schema)  # its own order: an answer's keys come in the schema's order
    if len(text) > MAX_SOURCE:
        raise BadGrammar(f"the schema is {len(text)} characters; at most {MAX_SOURCE}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise BadGrammar(str(e)) from None
    return checked(grammar)


MAX_DEPTH = 64  # nesting of a schema sent as JSON text, as of a request's body


def json_text(text: str) -> Any:
    """A schema sent as JSON text (a string where an object goes): parsed under the bounds of
    a body (its size, its nesting), so a string of 100,000 '[' is a BadGrammar, not a
    RecursionError that drops the connection."""
    if len(text) > MAX_SOURCE:
        raise BadGrammar(f"the schema is {len(text)} characters; at most {MAX_SOURCE}")
    try:
        value = json.loads(text)
    except RecursionError:
        raise BadGrammar(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise BadGrammar(f"not JSON: {e}") from None
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise BadGrammar(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            todo += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            todo += [(v, depth + 1) for v in item]
    return value


def regex(pattern: Any) -> str:
    import llguidance

    if not isinstance(pattern, str) or not pattern:
        raise BadGrammar("a regex is a non-empty string")
    if len(pattern) > MAX_SOURCE:
        raise BadGrammar(f"the regex is {len(pattern)} characters; at most {MAX_SOURCE}")
    return checked(llguidance.LLMatcher.grammar_from_regex(pattern))


def lark(text: Any) -> str:
    """A Lark grammar as llguidance takes it, or llama.cpp's GBNF (``root ::= ...``), which
    llguidance's own converter turns into Lark."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if not isinstance(text, str) or not text.strip():
        raise BadGrammar("a grammar is a non-empty string (Lark, or GBNF)")
    if len(text) > MAX_SOURCE:
        raise BadGrammar(f"the grammar is {len(text)} characters; at most {MAX_SOURCE}")
    if "::=" in text and not is_lark_syntax(text):
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter's own errors (GbnfToLarkError, ...)
            raise BadGrammar(f"GBNF: {first_line(str(e))}") from None
    return checked(llguidance.LLMatcher.grammar_from_lark(text))


def choice(options: Any) -> str:
    """One of a list of strings (vLLM's guided choice)."""
    import re

    if (
        not isinstance(options, list)
        or not options
        or not all(isinstance(o, str) and o for o in options)
    ):
        raise BadGrammar("a choice is a non-empty list of non-empty strings")
    return regex("|".join(re.escape(o) for o in options))


def tool_bounds(tools: Any) -> str | None:
    """Why a request's tools are too large to constrain a call with (their properties, their
    nesting), None when they are not: checked before any grammar is built."""
    count = 0

    def walk(node: Any, depth: int) -> str | None:
        nonlocal count
        if depth > MOST_TOOL_DEPTH:
            return f"a tool's schema nests deeper than {MOST_TOOL_DEPTH} levels"
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                count += len(props)
                if count > MOST_TOOL_PROPERTIES:
                    return (f"the tools' schemas have more than {MOST_TOOL_PROPERTIES} "
                            "properties: too many to constrain a call with")  # fmt: skip
            children: list[Any] = list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            return None
        for child in children:
            if isinstance(child, (dict, list)) and (why := walk(child, depth + 1)):
                return why
        return None

    return walk(tools, 0)


def is_panic(e: BaseException) -> bool:
    """Whether llguidance's Rust code panicked (pyo3's PanicException, a BaseException): a
    grammar it cannot take, answered as one."""
    return type(e).__name__ == "PanicException"


def checked(grammar: str) -> str:
    """``grammar`` once llguidance compiles it without a tokenizer; BadGrammar naming the
    first error otherwise."""
    if why := verdict(grammar, None, VERDICTS):
        raise BadGrammar(why)
    return grammar


def verdict(grammar: str, tokenizer, verdicts: OrderedDict[bytes, str]) -> str:
    """Why llguidance cannot compile ``grammar`` (against ``tokenizer``, an LLTokenizer, or
    none), "" when it can. Each verdict is kept in ``verdicts`` by the text's digest (an
    agent sends the same schema every turn), never the text nor a matcher: the cache is a few
    KB whatever the grammars. The launcher's door and rank 0's prepare each keep one."""
    import llguidance

    key = digest(grammar)
    why = verdicts.get(key)
    if why is None:
        limits = llguidance.LLParserLimits(**LIMITS)
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        except BaseException as e:
            if not is_panic(e):
                raise
            error = f"llguidance failed on this grammar ({first_line(str(e))})"
        why = first_line(error) if error and not error.startswith("WARNING") else ""
    remember(verdicts, key, why)
    return why


VERDICTS_KEPT = 1024
VERDICTS: OrderedDict[bytes, str] = OrderedDict()  # digest -> "" (valid) or the error


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def remember(verdicts: OrderedDict[bytes, str], key: bytes, verdict: str) -> None:
    """A verdict kept, the oldest forgotten past VERDICTS_KEPT (the launcher's threads may
    race here: the worst is a grammar checked twice)."""
    verdicts[key] = verdict
    verdicts.move_to_end(key)
    while len(verdicts) > VERDICTS_KEPT:
        verdicts.popitem(last=False)


def first_line(error: str) -> str:
    """llguidance's message on one line (a regex error draws its caret over several; a
    matcher's error is followed by a dump of its state, left out)."""
    error = error.split("<state>")[0]
    lines = [x.strip() for x in error.strip().splitlines() if x.strip() and x.strip() != "^"]
    return " ".join(lines)[:500] if lines else "invalid"


class Failures:
    """Grammars whose answers failed lately (a limit, the time budget), by digest (hex): the
    same grammar again within FORGET_S is refused where it is seen first (the launcher's
    door; rank 0 as it prepares one the door could not know, a forced tool call's), before
    any rank builds it or any step pays for it, so a client that resends it cannot keep the
    batch slow. Rank 0 decides a failure; the launcher learns it from the Refused event."""

    KEPT = 1024
    FORGET_S = 600.0

    def __init__(self) -> None:
        self.seen: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.lock = threading.Lock()

    def add(self, key: str, why: str) -> None:
        with self.lock:
            self.seen[key] = (why, time.monotonic())
            self.seen.move_to_end(key)
            while len(self.seen) > self.KEPT:
                self.seen.popitem(last=False)

    def why(self, key: str) -> str | None:
        """Why a grammar of this digest is refused now (None: it is not)."""
        with self.lock:
            found = self.seen.get(key)
        if found is None or time.monotonic() - found[1] >= self.FORGET_S:
            return None
        return (f"this grammar's answer failed {time.monotonic() - found[1]:.0f} s ago "
                f"({found[0]}); it is refused for {self.FORGET_S:g} s after a failure")  # fmt: skip
