"""Forced and strict tool calls in every tool-call format mlx-lm parses (node.decode.toolcalls):
for each family, a tokenizer that speaks it (tests/support/toolformats.py), the grammar of
``tool_choice`` required, a named tool and strict tools, and answers sampled at random under it
(``walk``: anything the mask allows). Every call comes back through rank 0's own path (Parts
and the family's mlx-lm parser) with arguments that validate against the tool's schema; a
forced answer is calls and nothing else. A model without a format answers a forced call as
JSON, which Parts returns as the call. Across ranks and through the official clients:
tests/e2e/test_structured.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.core.protocol import Piece, ToolCall
from node.decode import grammar as node_grammar
from node.decode.parts import Parts
from node.decode.toolcalls import FORMATS, family_of, format_of, json_answer, tool_grammar
from tests.support.toolformats import FAMILIES, make_tokenizer, walk

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "detail": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23},
                  "maxItems": 3},
        "where": {"type": "object", "properties": {"lat": {"type": "number"},
                  "lon": {"type": "number"}}, "required": ["lat", "lon"],
                  "additionalProperties": False},
        "note": {"type": "string"},
    }, "required": ["city", "unit", "days"], "additionalProperties": False}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
       "properties": {}}}}  # fmt: skip
# function_gemma's parser reads flat values only (a list or an object cannot be written)
FLAT = {"type": "function", "function": {**WEATHER["function"], "parameters": {
    **WEATHER["function"]["parameters"], "properties": {
        k: v for k, v in WEATHER["function"]["parameters"]["properties"].items()
        if k not in ("hours", "where")}}}}  # fmt: skip
SEEDS = 6


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return {family: (make_tokenizer(root / family.replace("[", "_").rstrip("]"), family),
                     root / family.replace("[", "_").rstrip("]"))
            for family in FAMILIES}  # fmt: skip


@pytest.fixture
def speaking(tokenizers):
    """speaking(family): that tokenizer as the job's (llguidance's view of its tokens, as a
    rank has it), the one before put back after the test."""
    before = node_grammar._SOURCE

    def use(family: str):
        wrapper, path = tokenizers[family]
        node_grammar.use_tokenizer(path, [wrapper.eos_token_id], len(wrapper._tokenizer))
        return wrapper, path

    yield use
    node_grammar._SOURCE = before
    node_grammar.tokens.cache_clear()


def test_every_family_mlx_lm_parses_has_a_format():
    import pkgutil

    import mlx_lm.tool_parsers

    known = {m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    assert known <= set(FORMATS), f"families without a grammar: {known - set(FORMATS)}"
    assert {f.split("[")[0] for f in FAMILIES} == set(FORMATS)


def llguidance_of(wrapper):
    """Which tokens llguidance takes as special, as rank 0 asks it (node.decode.grammar)."""
    return lambda token: node_grammar.is_special(wrapper, token)


def calls_of(wrapper, text: str, tools: list) -> tuple[list[ToolCall], str]:
    events: list = []
    parts = Parts("r", wrapper, tools, True, events.append)
    parts.feed(text)
    parts.finish()
    content = "".join(e.text for e in events if isinstance(e, Piece))
    return [e for e in events if isinstance(e, ToolCall)], content


@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_follow_their_schemas_in_the_model_s_own_format(speaking, family):
    wrapper, path = speaking(family)
    # laguna's parser is glm47's own (mlx-lm re-exports it): the same format
    assert family_of(wrapper) == {"laguna": "glm47"}.get(family, family.split("[")[0])
    weather = FLAT if family == "function_gemma" else WEATHER
    tools = [weather, NOW]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    made = 0
    for choice, single in [("required", False), ("get_weather", False), ("strict", False),
                           ("required", True), ("strict", True)]:  # fmt: skip
        grammar = tool_grammar(
            wrapper, tools, choice, single=single, special=llguidance_of(wrapper)
        )
        assert grammar is not None
        for seed in range(SEEDS if not single else 2):
            text, ended = walk(wrapper, path, grammar, seed)
            calls, content = calls_of(wrapper, text, tools)
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            made += len(calls)
            if single:  # parallel_tool_calls false, disable_parallel_tool_use
                assert len(calls) <= 1 and (calls or choice == "strict"), text
            if choice == "strict":
                continue
            assert ended, (choice, seed, text[-300:])
            assert calls and not content.strip(), (choice, seed, text, content)
            if choice == "get_weather":
                assert [c.name for c in calls] == ["get_weather"], text
    assert made >= 2 * SEEDS


def test_a_model_without_a_format_answers_a_forced_call_as_json(speaking):
    wrapper, path = speaking("json_tools")
    wrapper._tool_call_start = None  # as a tokenizer without a parser
    try:
        assert format_of(wrapper) is None
        assert json_answer(wrapper, "required") and not json_answer(wrapper, "strict")
        assert tool_grammar(wrapper, [WEATHER, NOW], "strict") is None  # nothing to start
        for choice in ("required", "get_weather"):
            grammar = tool_grammar(wrapper, [WEATHER, NOW], choice, special=llguidance_of(wrapper))
            for seed in range(SEEDS):
                text, ended = walk(wrapper, path, grammar, seed)
                assert ended
                events: list = []
                parts = Parts("r", wrapper, [WEATHER, NOW], True, events.append, json_calls=choice)
                parts.feed(text)
                parts.finish()
                calls = [e for e in events if isinstance(e, ToolCall)]
                assert calls and not [e for e in events if isinstance(e, Piece) and e.text]
                for call in calls:
                    schema = {"get_weather": WEATHER, "now": NOW}[call.name]
                    jsonschema.validate(json.loads(call.arguments),
                                        schema["function"]["parameters"])  # fmt: skip
                if choice == "get_weather":
                    assert [c.name for c in calls] == ["get_weather"]
    finally:
        wrapper._tool_call_start = "<tool_call>"
    events = []
    cut = Parts("r", wrapper, [WEATHER], True, events.append, json_calls="get_weather")
    cut.feed('{"city": "Pa')  # cut by max_tokens: sent as it is, nothing lost
    cut.finish()
    assert [e.text for e in events] == ['{"city": "Pa']


def test_a_tool_the_request_lacks_is_refused(speaking):
    wrapper, _ = speaking("qwen3_coder")
    with pytest.raises(ValueError, match="no tool named 'nope'"):
        tool_grammar(wrapper, [WEATHER], "nope")
    with pytest.raises(ValueError, match="no tools"):
        tool_grammar(wrapper, [], "required")


def wide_tool(n: int, name: str = "wide") -> dict:
    """A tool of ``n`` optional string properties, strict (an 18 kB body at 300)."""
    props = {f"field_{i}": {"type": "string"} for i in range(n)}
    return {"type": "function", "function": {"name": name, "strict": True,
            "parameters": {"type": "object", "properties": props}}}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tools_grammar_grows_with_its_properties_not_their_square(speaking, family):
    """300 optional properties: pythonic's grammar was 6.0 MB and gemma4's 1.8 MB (over
    llguidance's lexer limit: a 500), every neighbour waiting behind its compilation; now
    each rule names the ones after it. Doubling the properties at most doubles the grammar
    (and a little), and the grammar compiles for the model."""
    wrapper, _ = speaking(family)
    special = llguidance_of(wrapper)
    sizes = [len(tool_grammar(wrapper, [wide_tool(n)], "strict", special=special))
             for n in (150, 300)]  # fmt: skip
    assert sizes[1] < 2.2 * sizes[0], sizes
    assert sizes[1] < 200_000, sizes
    node_grammar.check(tool_grammar(wrapper, [wide_tool(300)], "strict", special=special))


def test_tools_too_large_to_constrain_are_refused_before_a_grammar_is_built(speaking):
    from cluster.core.grammar import MOST_TOOL_DEPTH, MOST_TOOL_PROPERTIES
    from cluster.serve.api.constrain import forced, strict
    from cluster.serve.api.shared import RequestError

    wrapper, _ = speaking("pythonic")
    deep: dict = {"type": "string"}
    for _ in range(MOST_TOOL_DEPTH):
        deep = {"type": "object", "properties": {"x": deep}}
    nested = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    for tools, says in [([wide_tool(MOST_TOOL_PROPERTIES + 1)], "more than 2000 properties"),
                        ([wide_tool(1500), wide_tool(600, "b")], "more than 2000 properties"),
                        ([nested], "deeper than 24 levels")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            tool_grammar(wrapper, tools, "strict")
        for make in (lambda t: forced("required", t, "tool_choice"),
                     lambda t: strict(t, [True] * len(t))):  # fmt: skip
            with pytest.raises(RequestError, match=f"'tools': .*{says}") as e:
                make(tools)
            assert e.value.status == 400
    assert forced("required", [wide_tool(MOST_TOOL_PROPERTIES)], "tool_choice").tools


def test_an_llguidance_panic_is_a_refusal_not_a_crash(monkeypatch):
    """pyo3's PanicException is a BaseException: it went past every ``except Exception`` on
    rank 0's prepare thread. It is the grammar's refusal now (a 400 naming the field)."""
    import llguidance

    from cluster.core import grammar as core_grammar

    class PanicException(BaseException):
        pass

    def panics(*args, **kwargs):
        raise PanicException("index out of bounds: the len is 3 but the index is 7")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", panics)
    from collections import OrderedDict

    why = core_grammar.verdict("start: /x/\n", None, OrderedDict())
    assert why.startswith("llguidance failed on this grammar (index out of bounds")
    with pytest.raises(core_grammar.BadGrammar, match="llguidance failed"):
        core_grammar.checked("start: /panics/\n")


def cut_parts(wrapper, tools, text: str, json_calls: str | None = None):
    events: list = []
    parts = Parts("r", wrapper, tools, True, events.append, json_calls=json_calls)
    parts.feed(text)
    parts.finish(cut=True)
    content = "".join(e.text for e in events if isinstance(e, Piece))
    return [e for e in events if isinstance(e, ToolCall)], content


@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_cut_by_max_tokens_return_those_written_whole_and_drop_the_cut_one(speaking, family):
    """A forced answer of several calls, cut anywhere (as max_tokens cuts it): the calls
    written whole before the cut come back, in order, as they would uncut; the one cut is
    dropped; no markup becomes content, no call breaks its schema (before: GLM gave the cut
    call with arguments {}, Qwen3-Coder's markup came back as content)."""
    wrapper, path = speaking(family)
    weather = FLAT if family == "function_gemma" else WEATHER
    tools = [weather, NOW]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    grammar = tool_grammar(wrapper, tools, "required", special=llguidance_of(wrapper))
    checked = 0
    for seed in range(8):
        text, ended = walk(wrapper, path, grammar, seed)
        whole, _ = calls_of(wrapper, text, tools)
        if not ended or len(whole) < 2:
            continue
        ids = wrapper._tokenizer.encode(text, add_special_tokens=False)
        for k in sorted({len(ids) * i // 24 for i in range(1, 24)}):  # a cut between tokens
            cut = wrapper._tokenizer.decode(ids[:k])
            calls, content = cut_parts(wrapper, tools, cut)
            assert not content.strip(), (family, cut, content)
            assert [(c.name, c.arguments) for c in calls] == [
                (c.name, c.arguments) for c in whole[: len(calls)]], (family, cut)  # fmt: skip
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            checked += 1
        # cut in its last call: every call before it comes back
        calls, _ = cut_parts(wrapper, tools, wrapper._tokenizer.decode(ids[:-2]))
        assert len(calls) >= len(whole) - 1, (family, text, calls)
    assert checked, f"{family}: no answer of two calls or more among the seeds"


def test_a_json_answer_cut_by_max_tokens_returns_the_calls_written_whole(speaking):
    wrapper, _ = speaking("json_tools")
    text = ('[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": '
            '{"city": "Lima", "unit": "celsius", "days": 2}}, {"name": "get_weather", '
            '"arguments": {"city": "Pa')  # fmt: skip
    calls, content = cut_parts(wrapper, [WEATHER, NOW], text, json_calls="required")
    assert [c.name for c in calls] == ["now", "get_weather"] and not content
    assert json.loads(calls[1].arguments)["city"] == "Lima"
    calls, content = cut_parts(wrapper, [WEATHER], '{"city": "Pa', json_calls="get_weather")
    assert not calls and not content


HOSTILE = ["null", "None", "</tool_call>", 'a"b', "x\ny", " spaced ", "true", "5", "{}",
           '<|"|>', "</arg_value>", "</parameter>", "]]>", "a,b", "c}", "d)", "'q'", "\\",
           "plain"]  # fmt: skip


def hostile_tool(name: str, key: str, typed: bool) -> dict:
    value = {"enum": HOSTILE, **({"type": "string"} if typed else {})}
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {key: value, "n": {"type": ["integer", "null"]},
                                         "free": {"type": "string", "maxLength": 16}},
        "required": [key, "n"]}}}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_what_a_grammar_allows_parses_back_to_the_call_it_spells(speaking, family):
    """Hostile names and values (markers, quotes, newlines, "null", spaces, JSON look-alikes):
    each call the grammar lets the model write comes back from the family's parser with that
    tool's name, a value of the enum exactly (a string, never null or a number), the other
    arguments of their types; a name or value the format cannot carry is never written (a
    name: the tool is refused, naming it; a value: left out of the grammar). Before: "null"
    came back as null, a value holding a marker gave no call, a name with a space or ">"
    came back as another name."""
    wrapper, path = speaking(family)
    special = llguidance_of(wrapper)
    written = 0
    for name, key in [("get_weather", "city"), ("get weather", "city name"), ("a>b", 'k"ey'),
                      ("ns.tool", "x-y")]:  # fmt: skip
        for typed in (True, False):
            tools = [hostile_tool(name, key, typed)]
            try:
                grammar = tool_grammar(wrapper, tools, "required", special=special)
            except ValueError as e:
                assert "cannot be written" in str(e) and name != "get_weather", e
                continue
            node_grammar.check(grammar)
            for seed in range(4):
                text, ended = walk(wrapper, path, grammar, seed)
                if not ended:
                    continue
                calls, content = calls_of(wrapper, text, tools)
                assert calls and not content.strip(), (family, text, content)
                for call in calls:
                    args = json.loads(call.arguments)
                    assert call.name == name, (family, text)
                    assert isinstance(args[key], str) and args[key] in HOSTILE, (family, text)
                    assert args["n"] is None or type(args["n"]) is int, (family, text)
                    assert isinstance(args.get("free", ""), str), (family, text)
                    written += 1
    assert written >= 8, family
