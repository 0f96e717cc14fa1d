"""Tool calls under a grammar, written in the model's own tool-call format.

A forced call (``tool_choice`` required or a named tool, Anthropic's ``any``/``tool``) or a
strict tool (the model chooses whether to call; a call it makes follows its schema) becomes a
Lark grammar for llguidance (node.decode.grammar compiles it on every rank). The grammar is
the markup mlx-lm's parser of the model's family reads (``mlx_lm/tool_parsers``), with each
argument's value constrained so that what the parser gives back follows the tool's schema:

- JSON formats carry the arguments as one JSON object under the tool's parameters schema:
  json_tools (Qwen2.5, Hermes), mistral (``[TOOL_CALLS][...]`` or ``name[ARGS]{...}``, as the
  template writes it), kimi_k2, kimi_k3 (its JSON block).
- Key/value formats carry each parameter apart (qwen3_coder, glm47 and laguna, longcat,
  minimax_m2, minicpm5, muse_spark, gemma4, function_gemma, pythonic): the schema's properties
  in their order, the required ones always, a string parameter as the raw text the parser
  keeps (its enum's values, its length bounds), any other as JSON under its schema (which the
  parser converts by the schema's type). Where a parser reads every value as JSON first
  (muse_spark) strings are JSON strings, so that "5" stays a string.

A model without a tool-call format, or a family this module does not know (a newer mlx-lm),
still gets forced calls: the answer is the arguments as JSON under the schema (or a list of
``{"name", "arguments"}`` for ``required``), which rank 0 returns as the tool call
(``json_answer``: node.decode.parts), as vLLM does. Strict tools of such a model are not
constrained: it has no markup that could start a call.

Markers are this model's tokens: a special token is matched as the token (its bytes are not
text), any other as text, however the model spells it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.core.grammar import JSON_OPTIONS, MAX_SOURCE, tool_bounds

COMPACT = {"x-guidance": JSON_OPTIONS}  # JSON as cluster.core.grammar writes it
ANY_TEXT = r"(.|\n)*"
NL, QUOTE = "\n", '"'
NEWLINE = '"\\n"'  # a newline in Lark
COMMA = '","'


class Writer:
    """One grammar being written: literals in this model's tokens, rules named as made."""

    def __init__(self, tokenizer, special: Callable[[int], bool] | None = None):
        self.tokenizer = tokenizer
        self.special = special or (lambda token: flagged_special(tokenizer, token))
        self.rules: list[str] = []

    def pieces(self, text: str) -> list[str]:
        """``text`` as Lark items: each special token it holds as ``<[id]>``, the runs of
        text between as quoted strings."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out: list[str] = []
        run: list[int] = []
        for token in [*ids, None]:
            if token is not None and not self.special(token):
                run.append(token)
                continue
            if run:
                out.append(json.dumps(self.tokenizer.decode(run)))
                run = []
            if token is not None:
                out.append(f"<[{token}]>")
        return out

    def lit(self, text: str) -> str:
        return " ".join(self.pieces(text)) if text else ""

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def json(self, schema: Any) -> str:
        schema = schema if isinstance(schema, dict) else {}
        return f"%json {json.dumps({**schema, **COMPACT})}"

    def text_until(self, close: str, value: str = ANY_TEXT) -> str:
        """Text matching the regex ``value`` and then ``close``; the text ends where
        ``close`` first appears (a lazy lexeme), so it never holds it."""
        pieces = self.pieces(close)
        if pieces[0].startswith("<["):  # a special token: text cannot hold it
            return f"/{value}/ {' '.join(pieces)}"
        first = self.rule(f"/{value}/ {pieces[0]}", lazy=True)
        return " ".join([first, *pieces[1:]])

    def string(self, schema: dict, close: str) -> str:
        """A string parameter as raw text, then ``close``: its enum's values, or text within
        its length bounds (its pattern is not followed: the text is free). Only the values
        the parsers read back as written (``raw_text_reads_back``); ValueError when none is
        left."""
        values = enum_strings(schema)
        if values is not None:
            ends = [
                close,
                *filter(
                    None,
                    (
                        getattr(self.tokenizer, "tool_call_start", None),
                        getattr(self.tokenizer, "tool_call_end", None),
                    ),
                ),
            ]
            typed = schema.get("type") == "string"
            values = [v for v in values if raw_text_reads_back(v, ends, typed)]
            if not values:
                shown = schema.get("enum", schema.get("const"))
                raise ValueError(f"no value of {shown!r} can be written as raw text in this "
                                 "model's tool-call format")  # fmt: skip
            return f"({' | '.join(self.lit(v) for v in values)}) {self.lit(close)}"
        return self.text_until(close, bounded(schema))

    def sequence(self, items: list[tuple[str, bool]], sep: str) -> str:
        """``items`` (Lark, required) in order, the optional ones may be left out, ``sep``
        (Lark) between two that are written (never before the first). Each rule names the
        rules after it, so the grammar grows with the items, not with their square."""
        if not items:
            return '""'
        if not sep:
            return " ".join(one if required else f"({one})?" for one, required in items)
        rest = ""  # a rule: the items after i, each with its separator
        first = ""  # a rule: the items from i, the first written without one
        for one, required in reversed(items):
            alone = f"{one} {rest}".strip()
            if required:
                first = self.rule(alone)
            else:
                first = self.rule(f"{alone} | {first}" if first else f"({alone})?")
            with_sep = f"{sep} {one} {rest}".strip()
            rest = self.rule(with_sep if required else f"({with_sep})?")
        return first

    def grammar(self, start: str) -> str:
        text = "\n".join(["%llguidance {}", f"start: {start}", *self.rules]) + "\n"
        if len(text) > MAX_SOURCE:
            raise ValueError(f"the tools' grammar would be {len(text):,} characters, over "
                             f"{MAX_SOURCE:,}: fewer or smaller tools")  # fmt: skip
        return text


def flagged_special(tokenizer, token: int) -> bool:
    """Whether the tokenizer flags ``token`` special (rank 0 passes llguidance's own view,
    node.decode.grammar.is_special, which also takes an added ``<...>`` token as one)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return token in special or bool(getattr(added.get(token), "special", False))


def bounded(schema: dict, char: str = r"(.|\n)") -> str:
    """The regex of a string's text: ``char`` repeated, within the schema's length bounds."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    if not isinstance(low, int) and not isinstance(high, int):
        return f"{char}*"
    low = low if isinstance(low, int) else 0
    return f"{char}{{{low},{high if isinstance(high, int) else ''}}}"


def raw_text_reads_back(value: str, ends: list[str], typed: bool) -> bool:
    """Whether mlx-lm's key/value parsers give ``value`` back as written, as raw text before
    its closing marker: it holds none of ``ends`` (where the parameter or the call ends),
    they strip it, some read ``null`` as null, and an enum without ``"type": "string"``
    (``typed``) is read as JSON where it parses as JSON."""
    if not value or value != value.strip() or any(m in value for m in ends):
        return False
    if value.lower() in ("null", "none", "nil"):
        return False
    if not typed:
        try:
            return isinstance(json.loads(value), str)
        except ValueError:
            return True
    return True


# What a tool's name and its parameters' names may be in each format: the characters its
# markup and its parser take as a name (a name outside them is a 400 naming the tool)
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
NAMES: dict[str, tuple[str, str]] = {  # family -> (tool name, parameter name)
    "pythonic": (r"[A-Za-z_][A-Za-z0-9_.]*", IDENTIFIER),
    "gemma4": (r"[A-Za-z0-9_.]+", IDENTIFIER),
    "function_gemma": (r"[A-Za-z0-9_.]+", IDENTIFIER),
    "qwen3_coder": (r"[^<>\s]+", r"[^<>\s]+"),
    "glm47": (r"[^<>\s]+", r"[^<>\s](?:[^<>\n]*[^<>\s])?"),
    "laguna": (r"[^<>\s]+", r"[^<>\s](?:[^<>\n]*[^<>\s])?"),
    "longcat": (r"[^<>\s]+", r"[^<>\s](?:[^<>\n]*[^<>\s])?"),
    "minimax_m2": (r"[^<>\"\s]+", r"[^<>\"\s](?:[^<>\"\n]*[^<>\"\s])?"),
    "muse_spark": (r"[^<>\"\s]+", r"[^<>\"\s](?:[^<>\"\n]*[^<>\"\s])?"),
    "minicpm5": (r"[^<>\"\s]+", r"[^<>\"\s](?:[^<>\"\n]*[^<>\"\s])?"),
    "kimi_k2": (r"[^:<>\s]+", ".+"),
    "kimi_k3": (r"[^<>\"\s]+", ".+"),
    "mistral": (r"[A-Za-z0-9_-]+", ".+"),
    "json_tools": (".+", ".+"),
}


def writable_names(family: str, calls: list[Call]) -> None:
    """ValueError naming a tool or parameter whose name ``family``'s markup cannot carry."""
    import re

    name_rule, key_rule = NAMES.get(family, (".+", ".+"))
    for call in calls:
        if not re.fullmatch(name_rule, call.name, re.DOTALL):
            raise ValueError(f"tool {call.name[:80]!r}: its name cannot be written in this "
                             f"model's tool-call format ({family})")  # fmt: skip
        for key, _, _ in call.properties:
            if not re.fullmatch(key_rule, key, re.DOTALL):
                raise ValueError(f"tool {call.name[:80]!r}: parameter {key[:80]!r} cannot "
                                 f"be written in this model's tool-call format "
                                 f"({family})")  # fmt: skip


def enum_strings(schema: dict) -> list[str] | None:
    """The values of a string enum (or const), None if the schema is not one."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None


def is_string(schema: Any) -> bool:
    """Whether a parameter's values are strings (its type, or a string enum)."""
    if not isinstance(schema, dict):
        return False
    return schema.get("type") == "string" or (
        "type" not in schema and enum_strings(schema) is not None
    )


@dataclass(frozen=True)
class Call:
    """One tool as a call: its name, its parameters' schema, its properties in order (the
    required flag of each), and the schema's ``$defs`` a property may refer to."""

    name: str
    parameters: dict
    properties: list[tuple[str, dict, bool]]

    @classmethod
    def of(cls, function: dict) -> Call:
        parameters = function.get("parameters")
        parameters = parameters if isinstance(parameters, dict) else {"type": "object"}
        props = parameters.get("properties")
        props = props if isinstance(props, dict) else {}
        required = set(parameters.get("required") or [])
        defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
        properties = [(k, {**v, **defs} if isinstance(v, dict) else {}, k in required)
                      for k, v in props.items()]  # fmt: skip
        return cls(function["name"], parameters, properties)

    def arguments(self, w: Writer, item: Callable[[str, dict], str], sep: str = "") -> str:
        """The parameters, each ``item(key, schema)``, in the schema's order: the required
        ones always, the others optional; ``sep`` (Lark) between two."""
        return w.sequence([(item(k, schema), required) for k, schema, required in self.properties],
                          sep)  # fmt: skip


def json_schema_of(call: Call) -> dict:
    """The schema of ``{"name": ..., "arguments": {...}}`` for this tool."""
    return {"type": "object", "properties": {"name": {"const": call.name},
            "arguments": call.parameters}, "required": ["name", "arguments"],
            "additionalProperties": False}  # fmt: skip


def json_call(w: Writer, call: Call) -> str:
    """``{"name": ..., "arguments": {...}}`` under the tool's schema."""
    return w.json(json_schema_of(call))


# Each format: one call's Lark (between its markers, when each call has its own), how calls
# follow one another, and whether one pair of markers holds all of them (``section``).


def json_tools(w: Writer, call: Call) -> str:
    return f'"\\n" {json_call(w, call)} "\\n"'


def mistral_json(w: Writer, call: Call) -> str:
    return json_call(w, call)


def mistral_args(w: Writer, call: Call) -> str:
    return f"{w.lit(call.name + '[ARGS]')} {w.json(call.parameters)}"


def qwen3_coder(w: Writer, call: Call) -> str:
    def item(key: str, schema: dict) -> str:
        head = w.lit(f"<parameter={key}>" + NL)
        if is_string(schema):
            return f"{head} {w.string(schema, '</parameter>')} {NEWLINE}"
        return f"{head} {w.json(schema)} {w.lit(NL + '</parameter>')} {NEWLINE}"

    opening = w.lit(NL + f"<function={call.name}>" + NL)
    return f"{opening} {call.arguments(w, item)} {w.lit('</function>')} {NEWLINE}"


def key_value(tag: str) -> Callable[[Writer, Call], str]:
    """GLM's ``name<arg_key>k</arg_key><arg_value>v</arg_value>`` (``tag``: "arg" for
    glm47 and laguna, "longcat_arg" for longcat)."""

    def write(w: Writer, call: Call) -> str:
        def item(key: str, schema: dict) -> str:
            head = f'{w.lit(f"<{tag}_key>{key}</{tag}_key>")} "\\n"? {w.lit(f"<{tag}_value>")}'
            close = f"</{tag}_value>"
            if schema.get("type") == "string":  # the parsers keep only these as text
                return f'{head} {w.string(schema, close)} "\\n"?'
            if enum_strings(schema) is not None:  # raw text that is not JSON stays text
                return f'{head} {w.string(schema, close)} "\\n"?'
            return f'{head} {w.json(schema)} {w.lit(close)} "\\n"?'

        if tag == "longcat_arg" and not any(r for _, _, r in call.properties):
            return json_call(w, call)  # its parser needs one pair, or this JSON form
        return f'{w.lit(call.name)} "\\n"? {call.arguments(w, item)}'

    return write


def kimi_k2(w: Writer, call: Call) -> str:
    return (f"{w.lit('<|tool_call_begin|>functions.' + call.name + ':')} /[0-9]{{1,4}}/ "
            f"{w.lit('<|tool_call_argument_begin|>')} {w.json(call.parameters)} "
            f"{w.lit('<|tool_call_end|>')}")  # fmt: skip


def kimi_k3(w: Writer, call: Call) -> str:
    opening = w.lit(f'<|open|>call tool="{call.name}" index="')
    block = w.lit('"<|sep|>') + f" {NEWLINE}? " + w.lit('<|open|>json type="object"<|sep|>')
    ending = w.lit("<|close|>json<|sep|>") + f" {NEWLINE}? " + w.lit("<|close|>call<|sep|>")
    return f"{opening} /[0-9]{{1,4}}/ {block} {w.json(call.parameters)} {ending}"


def xml_parameters(w: Writer, call: Call, invoke: str, parameter: str, end_param: str,
                   end_invoke: str, strings: str) -> str:  # fmt: skip
    """MiniMax's and Muse Spark's ``<invoke name="f"><parameter name="k">v</parameter>``
    (``strings``: "raw" text, or "json" where the parser reads every value as JSON first)."""

    def item(key: str, schema: dict) -> str:
        head = w.lit(f'{parameter}"{key}">')
        if strings == "raw" and is_string(schema):
            return f'{head} {w.string(schema, end_param)} "\\n"?'
        return f'{head} {w.json(schema)} {w.lit(end_param)} "\\n"?'

    opening = w.lit(invoke + '"' + call.name + '">')
    return (f"{NEWLINE}? {opening} {NEWLINE}? {call.arguments(w, item)} {w.lit(end_invoke)} "
            f"{NEWLINE}?")  # fmt: skip


def minimax_m2(w: Writer, call: Call) -> str:
    return xml_parameters(w, call, "<invoke name=", "<parameter name=", "</parameter>",
                          "</invoke>", "raw")  # fmt: skip


def muse_spark(w: Writer, call: Call) -> str:
    return xml_parameters(w, call, "<atem:invoke name=", "<atem:parameter name=",
                          "</atem:parameter>", "</atem:invoke>", "json")  # fmt: skip


def minicpm5(w: Writer, call: Call) -> str:
    """``<function name="f"><param name="k">v</param></function>`` (the opening marker is
    ``<function name=``); a string holding ``<``, ``&`` or a newline goes in CDATA."""

    def item(key: str, schema: dict) -> str:
        head = w.lit(f'<param name="{key}">')
        if is_string(schema):
            if enum_strings(schema) is not None or "maxLength" in schema or "minLength" in schema:
                return f"{head} {w.string(schema, '</param>')}"
            cdata = f"{w.lit('<![CDATA[')} {w.text_until(']]>')}"
            return f"{head} ({cdata} | /[^<&\\n]*/) {w.lit('</param>')}"
        return f"{head} {w.json(schema)} {w.lit('</param>')}"

    return f"{w.lit(QUOTE + call.name + QUOTE + '>')} {call.arguments(w, item)}"


def gemma(quote: str, char: str = r"(.|\n)") -> Callable[[Writer, Call], str]:
    """Gemma's ``call:f{k:<|"|>text<|"|>,n:5}`` (``quote``: its string delimiter, <|"|> for
    gemma4, <escape> for function_gemma). Gemma 4 writes objects and lists the same way
    (bare keys, delimited strings); function_gemma's parser reads only flat values."""
    nested = quote == '<|"|>'

    def write(w: Writer, call: Call) -> str:
        def value(schema: dict) -> str:
            if is_string(schema):
                values = enum_strings(schema)
                if values is not None:
                    values = [v for v in values if quote not in v and v == v.strip()]
                    if not values:
                        raise ValueError(f"no value of {schema.get('enum')!r} can be written "
                                         "in this model's tool-call format")  # fmt: skip
                    return f"({' | '.join(w.lit(quote + v + quote) for v in values)})"
                return f"{w.lit(quote)} {w.text_until(quote, bounded(schema, char))}"
            kind = schema.get("type")
            if nested and kind == "object" and isinstance(schema.get("properties"), dict):
                inner = Call.of({"name": "", "parameters": schema})
                return f'"{{" {inner.arguments(w, item, sep=COMMA)} "}}"'
            sized = "minItems" in schema or "maxItems" in schema
            if nested and kind == "array" and isinstance(schema.get("items"), dict) and not sized:
                one = w.rule(value(schema["items"]))
                return f'"[" ({one} ({COMMA} {one})*)? "]"'
            return w.json(schema)

        def item(key: str, schema: dict) -> str:
            return f"{w.lit(key + ':')} {value(schema)}"

        opening = w.lit(f"call:{call.name}" + "{")
        return f'{opening} {call.arguments(w, item, sep=COMMA)} "}}"'

    return write


def pythonic(w: Writer, call: Call) -> str:
    def item(key: str, schema: dict) -> str:
        return f"{w.lit(key + '=')} {w.json(schema)}"

    return f'{w.lit(call.name)} "(" {call.arguments(w, item, sep=chr(34) + ", " + chr(34))} ")"'


def python_calls(markup: str) -> bool:
    """Whether ``markup`` is a Python list of calls (mlx-lm's pythonic parser reads calls out
    of text that is not one, a string cut short among them)."""
    import ast

    try:
        tree = ast.parse(markup.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return False
    return isinstance(tree, ast.List) and all(isinstance(e, ast.Call) for e in tree.elts)


@dataclass(frozen=True)
class Format:
    call: Callable[[Writer, Call], str]
    section: bool = False  # one pair of markers around every call (else each call its own)
    sep: str = ""  # between two calls (Lark)
    inner: tuple[str, str] = ("", "")  # inside a section, around its calls (Lark)
    sep_marker: str = ""  # between two calls, a marker (text in this model's tokens)
    # a section cut short (max_tokens): where a call inside it ends, and what closes the
    # section's text there, so that the calls written whole are still read (node.decode.parts)
    call_end: str = ""
    closers: tuple[str, ...] = ("",)
    whole: Callable[[str], bool] = lambda markup: True  # a lenient parser's text checked


FORMATS: dict[str, Format] = {
    "json_tools": Format(json_tools, sep='"\\n"?'),
    "mistral": Format(
        mistral_json,
        section=True,
        sep='"," " "?',
        inner=('"["', '"]"'),
        call_end="}",
        closers=("]",),
    ),
    "qwen3_coder": Format(qwen3_coder, sep='"\\n"?'),
    "glm47": Format(key_value("arg"), sep='"\\n"?'),
    "laguna": Format(key_value("arg"), sep='"\\n"?'),
    "longcat": Format(key_value("longcat_arg"), sep='"\\n"?'),
    "kimi_k2": Format(kimi_k2, section=True, call_end="<|tool_call_end|>"),
    "kimi_k3": Format(
        kimi_k3,
        section=True,
        sep='"\\n"?',
        inner=('"\\n"?', '"\\n"?'),
        call_end="<|close|>call<|sep|>",
    ),
    "minimax_m2": Format(minimax_m2, section=True, call_end="</invoke>"),
    "muse_spark": Format(muse_spark, section=True, call_end="</atem:invoke>"),
    "minicpm5": Format(minicpm5),
    "gemma4": Format(gemma('<|"|>')),
    "function_gemma": Format(gemma("<escape>", r"[^}]"), sep=""),
    "pythonic": Format(
        pythonic,
        section=True,
        sep='", "',
        inner=('"["', '"]"'),
        call_end=")",
        closers=("]",),
        whole=python_calls,
    ),  # fmt: skip
}


def family_of(tokenizer) -> str | None:
    """The model's tool-call family (mlx-lm's parser module), None without one."""
    if not getattr(tokenizer, "tool_call_start", None):
        return None
    parser = getattr(getattr(tokenizer, "tool_parser", None), "__module__", "") or ""
    return parser.rsplit(".", 1)[-1] or None


def format_of(tokenizer) -> Format | None:
    """How this model writes calls; None for none this module knows (forced calls are then
    answered as JSON: ``json_answer``)."""
    family = family_of(tokenizer)
    if family == "mistral" and "[ARGS]" in str(getattr(tokenizer, "chat_template", "") or ""):
        return Format(
            mistral_args,
            section=True,
            sep_marker="[TOOL_CALLS]",  # v11 templates
            call_end="}",
        )
    return FORMATS.get(family or "")


def json_answer(tokenizer, choice: str | None) -> bool:
    """Whether a request with this tool choice is answered as JSON that rank 0 makes the
    tool call (a forced call, and no format this module writes)."""
    return choice not in (None, "", "strict") and format_of(tokenizer) is None


def tool_grammar(tokenizer, tools: list[dict], choice: str, think: str = "",
                 single: bool = False,
                 special: Callable[[int], bool] | None = None) -> str | None:  # fmt: skip
    """The grammar of an answer under the request's tools: ``choice`` "required" (one call
    or more, nothing else), a tool's name (exactly that call), or "strict" (free text, each
    call made to follow its tool's schema; None when the model has no markup to start one).
    ``think``: a think block of the model's special markers (a Lark rule named think) free
    text may begin with; ``single``: one call at most. ValueError for a tool the request
    does not have. ``special``: which tokens llguidance takes as special (Writer)."""
    if why := tool_bounds(tools):
        raise ValueError(why)
    functions = {t["function"]["name"]: t["function"] for t in tools
                 if isinstance(t.get("function"), dict)}  # fmt: skip
    if choice not in ("required", "strict") and choice not in functions:
        raise ValueError(f"no tool named {choice!r} among the request's tools")
    names = list(functions) if choice in ("required", "strict") else [choice]
    if not names:
        raise ValueError("the request has no tools to call")
    calls = [Call.of(functions[n]) for n in names]
    w = Writer(tokenizer, special)
    fmt = format_of(tokenizer)
    if fmt is not None:
        writable_names(family_of(tokenizer) or "", calls)
    if fmt is None:
        if choice == "strict":
            return None
        if choice != "required":
            return w.grammar(w.json(calls[0].parameters))
        if single:
            return w.grammar(
                w.json(
                    {
                        "type": "array",
                        "items": {"anyOf": [json_schema_of(c) for c in calls]},
                        "minItems": 1,
                        "maxItems": 1,
                    }
                )
            )
        each = [json_schema_of(c) for c in calls]
        return w.grammar(w.json({"type": "array", "items": {"anyOf": each}, "minItems": 1}))
    one = w.rule(" | ".join(f"({fmt.call(w, c)})" for c in calls))
    close = w.lit(tokenizer.tool_call_end or "")
    sep = w.lit(fmt.sep_marker) if fmt.sep_marker else fmt.sep
    several = choice in ("required", "strict") and not single
    if fmt.section:
        calls_lark = f"{one} ({sep} {one})*" if several else one
        after_open = f"{fmt.inner[0]} {calls_lark} {fmt.inner[1]} {close}"
    else:
        after_open = f"{one} {close}"
    if choice == "strict":
        ends = not tokenizer.tool_call_end  # mistral: its calls are the answer's end
        return strict(w, tokenizer.tool_call_start, after_open, think, ends or single)
    wrapped = w.rule(f"{w.lit(tokenizer.tool_call_start)} {after_open}")
    if several and not fmt.section:
        return w.grammar(f"{wrapped} ({sep} {wrapped})*")
    return w.grammar(wrapped)


def strict(w: Writer, marker: str, after_open: str, think: str, once: bool = False) -> str:
    """Free text in which each call, once its opening ``marker`` is written, follows the
    grammar (``after_open``: the call or section and its closing marker; ``once``: one call
    at most, as for a format without a closing marker, whose calls end the answer)."""
    pieces = w.pieces(marker)
    if pieces[0].startswith("<["):  # a special token: text cannot hold it
        start_call = f"TEXT {' '.join(pieces)}"
    else:  # a text marker: the text before it is lazy, so that the marker ends it
        start_call = " ".join([w.rule(f"TEXT {pieces[0]}", lazy=True), *pieces[1:]])
    call = w.rule(f"{start_call} {after_open}")
    w.rules.append(f"TEXT: /{ANY_TEXT}/")
    if think:
        w.rules.append(think.strip())
    body = f"({call} | TEXT)" if once else f"{call}* TEXT"
    return w.grammar(f"{'think? ' if think else ''}{body}")
