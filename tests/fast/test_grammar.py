"""Constrained decoding in one process (node.decode.grammar): sampled answers under a JSON schema
validate, for schemas hypothesis makes up too; a forced tool call is the model's own markup
with arguments under the tool's schema; a grammar waits for a think block the prompt opened;
a request's trial run leaves its matcher at the start; bad grammars are refused where they are
asked for (cluster.core.grammar). Across ranks, in both modes, and through the official
clients: tests/e2e/test_structured.py."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import load

from cluster.core import grammar
from cluster.core.spec import Grammar, Sampling, SharedRequest
from node.decode import grammar as node_grammar
from node.decode.loop import generate
from node.decode.sampling import tried

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "alive"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(models):
    return load(str(models["qwen2"]))


@pytest.fixture
def qwen(models, loaded):
    """The qwen2 model, and its tokens for the grammars (one model per process, as a rank)."""
    model, tokenizer = loaded
    node_grammar.use_tokenizer(models["qwen2"], tokenizer.eos_token_ids, 512)
    return model, tokenizer


def request(tokenizer, schema=None, temp=1.0, seed=0, max_tokens=200, text=None):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about lists"}],
                                           add_generation_prompt=True)  # fmt: skip
    sampling = Sampling(max_tokens=max_tokens, temp=temp, seed=seed)
    return SharedRequest(sampling, prompt, Grammar(text or grammar.json_schema(schema)))


def answer(model, tokenizer, req) -> tuple[str, str]:
    got = generate(model, tokenizer, req, None)
    tokens = [t for t in got.tokens if t not in tokenizer.eos_token_ids]
    return tokenizer.decode(tokens), got.stats["finish_reason"]


def test_sampled_answers_follow_the_schema(qwen):
    model, tokenizer = qwen
    for seed in range(6):
        text, finish = answer(model, tokenizer, request(tokenizer, PERSON, temp=1.0, seed=seed))
        assert finish == "stop", text  # the grammar ended the answer, not the token limit
        jsonschema.validate(json.loads(text), PERSON)
    free = dataclasses.replace(request(tokenizer, PERSON), grammar=None)
    unconstrained = generate(model, tokenizer, free, None)
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(unconstrained.tokens[:-1]))  # alone it writes no JSON


def test_a_regex_and_a_lark_grammar(qwen):
    model, tokenizer = qwen
    text, finish = answer(model, tokenizer, request(tokenizer, text=grammar.regex(r"[0-9]{3}-x")))
    assert finish == "stop" and len(text) == 5 and text[:3].isdigit() and text.endswith("-x")
    lark = grammar.lark('start: "yes" | "no"')
    assert answer(model, tokenizer, request(tokenizer, text=lark))[0] in ("yes", "no")
    assert answer(model, tokenizer, request(tokenizer, text=grammar.choice(["red", "blue"])))[
        0
    ] in ("red", "blue")


def test_an_answer_cut_by_its_token_limit_finishes_with_length(qwen):
    model, tokenizer = qwen
    text, finish = answer(model, tokenizer, request(tokenizer, PERSON, max_tokens=3))
    assert finish == "length" and text.startswith("{")


def test_a_trial_run_leaves_the_matcher_at_its_start(qwen):
    """node.sampling.tried runs the chain once on dummy logits (every rank, before a request
    joins a batch): the grammar's matcher must not keep what it saw there."""
    model, tokenizer = qwen
    req = request(tokenizer, PERSON, seed=3)
    chosen, chain = tried(req, 512)
    (constrained,) = chain
    assert constrained.start is None and constrained.fed == 0
    logits = mx.zeros((1, 512))
    masked = constrained(mx.array(req.tokens), logits)
    allowed = [i for i in range(512) if masked[0, i].item() > -1e30]
    assert all(tokenizer.decode([i]).startswith("{") for i in allowed), allowed


def test_the_grammar_waits_for_the_think_block_the_prompt_opened(qwen):
    model, tokenizer = qwen
    end = tokenizer.encode("</think>", add_special_tokens=False)
    c = node_grammar.Constrained(grammar.regex("ok"), after=end)
    prompt = mx.array([1, 2, 3])
    logits = mx.zeros((1, 512))
    assert c(prompt, logits) is logits  # thinking: free
    hmm = tokenizer.encode("hmm", add_special_tokens=False)
    assert c(mx.concatenate([prompt, mx.array(hmm)]), logits) is logits
    after = mx.concatenate([prompt, mx.array(hmm + end)])
    masked = c(after, logits)
    allowed = [i for i in range(512) if masked[0, i].item() > -1e30]
    assert allowed and all("ok".startswith(tokenizer.decode([i])) for i in allowed)


def test_bad_grammars_are_refused_naming_the_keyword():
    for make, value, says in [
        (grammar.json_schema, {"type": "strin"}, "Invalid type: strin"),
        (grammar.json_schema, {"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
        (grammar.json_schema, {"type": "string", "pattern": "(("}, "unclosed group"),
        (grammar.json_schema, "[", "not JSON"),
        (grammar.regex, "[a-", "unclosed character class"),
        (grammar.lark, "start: nowhere", "unknown name"),
        (grammar.choice, [], "non-empty list"),
    ]:
        with pytest.raises(grammar.BadGrammar) as e:
            make(value)
        assert says in str(e.value), (value, str(e.value))


# schemas hypothesis makes up: each one bounded, so that a random model's answer ends
leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)},
        st.integers(-50, 50),
        st.integers(-50, 50),
    ),  # fmt: skip
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda xs: {"enum": xs},
        st.lists(st.sampled_from(["a", "b", 1, 2.5, None]), min_size=1, max_size=3, unique=True),
    ),  # fmt: skip
)


schemas = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.builds(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            },  # fmt: skip
            st.dictionaries(st.sampled_from(["x", "y", "z"]), inner, max_size=3),
        ),
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            inner,
            st.integers(0, 3),
        ),  # fmt: skip
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
    ),
    max_leaves=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_any_bounded_schema_s_sampled_answer_validates(qwen, schema, seed):
    model, tokenizer = qwen
    text, finish = answer(model, tokenizer, request(tokenizer, schema, temp=1.0, seed=seed,
                                                    max_tokens=300))  # fmt: skip
    assert finish == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)
