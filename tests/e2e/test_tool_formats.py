"""Forced and strict tool calls beyond JSON markup, through serve on two ranks, driven by the
official clients at temperature > 0: a model that speaks Qwen3-Coder's XML calls (its
``<tool_call>`` markers single tokens, as in Qwen's tokenizer) served in tensor mode. (A model
without any tool-call format, a forced call answered as JSON and returned as the call:
tests/e2e/test_serve.py, on its pipeline server.) Every call validates against its tool's
schema; a strict tool with ``tool_choice`` auto is served, never refused. Each family's
grammar, sampled at random: tests/fast/test_tool_formats.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.serving import Served

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

QWEN3_CODER = (  # mlx-lm infers qwen3_coder from "<tool_call>\n<function="
    "{%- if tools %}<|system|>Call tools as <tool_call>\n<function=NAME>\n<parameter=KEY>\n"
    "VALUE\n</parameter>\n</function>\n</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True,
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SAMPLES = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.support.tiny import make_model

    out = tmp_path_factory.mktemp("formats") / "qwen3_coder"
    model = make_model(out, "qwen2", seed=3, chat_template=QWEN3_CODER,
                       extra_special=["<tool_call>", "</tool_call>"])  # fmt: skip
    server = Served(model, "--mode", "tensor")
    clients(server, model.name)
    yield server
    server.stop_clean()


def clients(server: Served, model_id: str) -> None:
    url = f"http://127.0.0.1:{server.port}"
    server.openai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    server.anthropic = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    server.model_id = model_id


@pytest.fixture(autouse=True)
def no_stray_ranks():  # the server's ranks live for the module; checked when it stops
    yield


def valid(calls) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments,
                            SCHEMAS[name])  # fmt: skip


def forced_calls_follow_their_schemas(served) -> None:
    chat = served.openai.chat.completions
    for seed in range(SAMPLES):
        ask = {
            "model": served.model_id,
            "tools": TOOLS,
            "temperature": 0.9,
            "seed": seed,
            "max_tokens": 160,
            "messages": [{"role": "user", "content": f"Weather? {seed}"}],
        }
        r = chat.create(
            **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_weather"]
        valid([(c.function.name, c.function.arguments) for c in calls])
        r = chat.create(**ask, tool_choice="required", parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
        valid([(c.function.name, c.function.arguments) for c in calls])
        m = served.anthropic.messages.create(
            model=served.model_id, max_tokens=160, extra_body={"temperature": 0.9},
            tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                   for t in TOOLS], tool_choice={"type": "any", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": f"Hi {seed}"}])  # fmt: skip
        uses = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1, m.content
        valid(uses)
    r = served.openai.responses.create(
        model=served.model_id, input="Time?", temperature=0.9, max_output_tokens=160,
        tools=[{"type": "function", **t["function"]} for t in TOOLS],
        tool_choice={"type": "function", "name": "get_time"})  # fmt: skip
    valid([(o.name, o.arguments) for o in r.output if o.type == "function_call"])


def test_forced_calls_follow_their_schemas_in_every_dialect(served):
    forced_calls_follow_their_schemas(served)


def test_a_strict_tool_with_tool_choice_auto_is_served(served):
    """OpenAI's Agents SDK marks every function tool strict: never a 400 for the format."""
    r = served.openai.chat.completions.create(
        model=served.model_id, tools=TOOLS, tool_choice="auto", temperature=0.9, seed=1,
        max_tokens=40, messages=[{"role": "user", "content": "Weather in Lima?"}])  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    valid([(c.function.name, c.function.arguments) for c in calls] or [("get_time",
          '{"zone": "UTC"}')])  # fmt: skip
