"""Structured outputs and forced tool calls through serve, driven by the official clients, at
temperature > 0, on two ranks in each mode: ``chat.completions.parse`` with a pydantic model,
Responses' ``text.format``, a forced strict tool call, Anthropic's ``tool_choice`` ``tool``
and ``any``; constrained and free requests batched together; every answer validated with
jsonschema; bad schemas are 400s; the server never restarts. (One process, many schemas:
tests/e2e/test_grammar.py.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.support.serving import Served
from tests.support.toolmodel import TIME_TOOL, TOOLS

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")

SAMPLES = 6  # answers per kind and mode, each sampled at temperature 0.9


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog", "fish"]})
    legs: int = pydantic.Field(ge=0, le=8)


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    pets: list[Pet] = pydantic.Field(max_length=2)
    happy: bool


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def served(request, tool_model):
    server = Served(tool_model, "--mode", request.param)
    url = f"http://127.0.0.1:{server.port}"
    server.openai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    server.anthropic = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    server.model_id = tool_model.name
    yield server
    server.stop_clean(refusals=True)  # its bad schemas are 400s


@pytest.fixture(autouse=True)
def no_stray_ranks():  # the server's ranks live for the module; checked when it stops
    yield


def ask(served) -> list[dict]:
    return [{"role": "user", "content": "Describe a person."}]


def test_parse_with_a_pydantic_model_validates_every_sample(served):
    schema = Person.model_json_schema()
    for seed in range(SAMPLES):
        r = served.openai.chat.completions.parse(
            model=served.model_id, messages=ask(served), response_format=Person,
            temperature=0.9, seed=seed, max_tokens=300)  # fmt: skip
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Person), message.content
        jsonschema.validate(json.loads(message.content), schema)


def test_responses_text_format_and_free_requests_in_one_batch(served):
    """Constrained and unconstrained requests decoded together (no seed: batched): each
    constrained answer validates, each free one is the model's own text."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
              "temperature": {"type": "integer", "minimum": -30, "maximum": 45}},
              "required": ["city", "temperature"], "additionalProperties": False}  # fmt: skip

    def one(i):
        if i % 2:
            r = served.openai.chat.completions.create(model=served.model_id, messages=ask(served),
                                                      temperature=0.9, max_tokens=30)  # fmt: skip
            return None, r.choices[0].message.content
        r = served.openai.responses.create(
            model=served.model_id,
            input="The weather, please.",
            temperature=0.9,
            max_output_tokens=200,
            text={"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}},
        )
        return r.status, r.output_text  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(2 * SAMPLES)))
    for status, text in answers[0::2]:
        assert status == "completed", text
        jsonschema.validate(json.loads(text), schema)
    assert all(isinstance(text, str) for _, text in answers[1::2])


def test_a_forced_strict_tool_call_names_the_tool_with_valid_arguments(served):
    for seed in range(SAMPLES):
        choice = {"type": "function", "function": {"name": "get_time"}}
        r = served.openai.chat.completions.create(
            model=served.model_id,
            messages=[{"role": "user", "content": "What time is it?"}],
            tools=TOOLS,
            tool_choice=choice,
            temperature=0.9,
            seed=seed,
            max_tokens=120,
        )
        (call,) = r.choices[0].message.tool_calls  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments),
                            TIME_TOOL["function"]["parameters"])  # fmt: skip
        r = served.openai.chat.completions.create(
            model=served.model_id,
            messages=[{"role": "user", "content": "Hello"}],
            tools=TOOLS,
            tool_choice="required",
            temperature=0.9,
            seed=seed,
            max_tokens=120,
        )
        calls = r.choices[0].message.tool_calls  # fmt: skip
        assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)


def test_anthropic_tool_choice_tool_and_any(served):
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    for seed, choice in enumerate([{"type": "tool", "name": "get_weather"}, {"type": "any"}] * 3):
        m = served.anthropic.messages.create(
            model=served.model_id, max_tokens=120, extra_body={"temperature": 0.9}, tools=tools,
            tool_choice=choice, messages=[{"role": "user", "content": f"Hi {seed}"}])  # fmt: skip
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses, m.content
        if choice["type"] == "tool":
            assert uses[0].name == "get_weather"
        for use in uses:
            schema = next(t["input_schema"] for t in tools if t["name"] == use.name)
            jsonschema.validate(use.input, schema)


def test_bad_schemas_are_400s_naming_the_keyword(served):
    for fmt, says in [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
         "Invalid type: strin"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
         'Unimplemented keys: ["not"]'),
        ({"type": "json_schema", "json_schema": {"name": "x"}},
         "'response_format.json_schema.schema'"),
        ({"type": "yaml"}, "'response_format' of type 'yaml'"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            served.openai.chat.completions.create(model=served.model_id, messages=ask(served),
                                                  response_format=fmt)  # fmt: skip
        assert says in str(e.value), str(e.value)
    with pytest.raises(anthropic.BadRequestError, match="names 'nope'"):
        served.anthropic.messages.create(
            model=served.model_id, max_tokens=10, messages=ask(served),
            tools=[{"name": "get_time", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "nope"})  # fmt: skip


def test_a_hostile_grammar_ends_alone_with_an_error_and_its_neighbour_is_untouched(
    served, tool_model
):
    """The third review's ambiguous grammar (its mask's work grows with every token; the
    end of sequence held off by logit_bias) beside a greedy free request: the grammar's
    request ends with a 400 naming its field (its time budget or llguidance's counts, on
    every rank alike), the neighbour's text is its lone answer, and the same grammar sent
    again is refused at once."""
    eos = json.loads((tool_model / "config.json").read_text())["eos_token_id"]
    ambiguous = 'start: x\nx: x x | x x x | "a" | "b" | "ab"\n'
    hostile = {"prompt": "x", "max_tokens": 400, "temperature": 1.0,
               "logit_bias": {str(eos): -100},
               "structured_outputs": {"grammar": ambiguous}}  # fmt: skip

    def neighbour() -> str:
        r = served.openai.chat.completions.create(
            model=served.model_id, messages=ask(served), temperature=0, max_tokens=60)  # fmt: skip
        return r.choices[0].message.content

    alone = neighbour()
    with ThreadPoolExecutor(2) as pool:
        refused = pool.submit(served.openai.completions.create, model=served.model_id, **{
            k: v for k, v in hostile.items() if k in ("prompt", "max_tokens", "temperature",
                                                      "logit_bias")},
            extra_body={"structured_outputs": hostile["structured_outputs"]})  # fmt: skip
        beside = pool.submit(neighbour)
        with pytest.raises(openai.BadRequestError) as e:
            refused.result(timeout=300)
        assert beside.result(timeout=300) == alone
    message = e.value.body["message"]
    assert "'structured_outputs.grammar'" in message and "the answer was ended" in message
    with pytest.raises(openai.BadRequestError, match="refused for 600 s after a failure"):
        served.openai.completions.create(
            model=served.model_id, prompt="x", max_tokens=40,
            extra_body={"structured_outputs": hostile["structured_outputs"]})  # fmt: skip
    # with a seed the request is decoded alone; its grammar is timed all the same
    alone = 'start: y\ny: y y | y y y | "b" | "a" | "ba"\n'
    with pytest.raises(openai.BadRequestError, match="the answer was ended"):
        served.openai.completions.create(
            model=served.model_id, prompt="x", max_tokens=400, temperature=1.0, seed=1,
            logit_bias={str(eos): -100},
            extra_body={"structured_outputs": {"grammar": alone}})  # fmt: skip
