"""`serve` for agents: a model that really calls a tool (tests/support/toolmodel.py), through
OpenAI's chat completions and Responses and Anthropic's Messages, each driven by its official
client, on two ranks; the server has an API key, sent as each client sends it."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.serving import Served
from tests.support.toolmodel import (
    CITIES,
    EOS,
    WEATHER_TOOL,
    conversation,
    final_answer,
    question,
    thought,
)

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "agent-key"
FUNCTION = WEATHER_TOOL["function"]
RESPONSES_TOOL = {"type": "function", **FUNCTION}
ANTHROPIC_TOOL = {
    "name": FUNCTION["name"],
    "description": FUNCTION["description"],
    "input_schema": FUNCTION["parameters"],
}


@pytest.fixture(scope="module")
def agents(tool_model):
    served = Served(tool_model, env={"MLX_CLUSTER_API_KEY": KEY})
    url = f"http://127.0.0.1:{served.port}"
    served.openai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    served.anthropic = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    served.model_id = tool_model.name
    yield served
    assert served.stop() == 0
    assert not any(KEY in line for line in served.log)


@pytest.fixture(autouse=True)
def no_stray_ranks():  # the server's ranks live for the whole module; checked at its end
    yield


def weather(city: str) -> str:
    return json.dumps({"temperature": CITIES[city]})


# OpenAI chat completions


def chat_loop(client, model: str, city: str, stream: bool) -> tuple:
    """The agent loop: ask, run the tool the model called, send its result, get the answer."""
    messages = [{"role": "user", "content": question(city)}]

    def ask():
        if not stream:
            return client.chat.completions.create(
                model=model, messages=messages, tools=[WEATHER_TOOL], temperature=0
            )
        with client.chat.completions.stream(
            model=model, messages=messages, tools=[WEATHER_TOOL], temperature=0
        ) as s:
            return s.get_final_completion()

    first = ask()
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    arguments = json.loads(call.function.arguments)
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": weather(arguments["city"])}
    )
    return first, ask()


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_agent_loop(agents, stream):
    first, second = chat_loop(agents.openai, agents.model_id, "Paris", stream)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content  # None; "" as the stream helper accumulates it
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert choice.message.model_extra["reasoning_content"].strip() == thought("Paris")
    assert second.choices[0].message.content == final_answer("Paris")
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    if not stream:  # the second turn starts from the first one's cached prompt
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached <= first.usage.prompt_tokens


def test_openai_stream_sends_reasoning_then_one_tool_call_delta(agents):
    chunks = list(
        agents.openai.chat.completions.create(
            model=agents.model_id,
            messages=[{"role": "user", "content": question("Oslo")}],
            tools=[WEATHER_TOOL],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning.strip() == thought("Oslo")
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].id
    assert json.loads(calls[0][0].function.arguments) == {"city": "Oslo"}
    assert not "".join(d.content or "" for d in deltas)  # no text outside the parts
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


def test_logprobs_cover_every_generated_token(agents):
    r = agents.openai.chat.completions.create(
        model=agents.model_id,
        messages=[{"role": "user", "content": question("Tokyo")}],
        tools=[WEATHER_TOOL],
        logprobs=True,
        top_logprobs=3,
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == conversation("Tokyo")[0][1]  # markers, EOS too
    for e in entries:
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes).decode() == e.token


def test_completions_logprobs(agents):
    r = agents.openai.completions.create(
        model=agents.model_id, prompt="What is the weather", max_tokens=5, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    joined, text = "".join(lp.tokens), r.choices[0].text
    assert joined == text or (r.choices[0].finish_reason == "stop" and joined == text + EOS)
    assert all(len(top) <= 2 for top in lp.top_logprobs)


# OpenAI Responses


def responses_loop(client, model: str, city: str, stream: bool) -> tuple:
    items: list = [{"role": "user", "content": question(city)}]

    def ask():
        if not stream:
            return client.responses.create(
                model=model, input=items, tools=[RESPONSES_TOOL], temperature=0
            )
        with client.responses.stream(
            model=model, input=items, tools=[RESPONSES_TOOL], temperature=0
        ) as s:
            kinds = [event.type for event in s]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            return s.get_final_response()

    first = ask()
    items += [item.model_dump(exclude_none=True) for item in first.output]
    call = first.output[-1]
    arguments = json.loads(call.arguments)
    items.append(
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": weather(arguments["city"]),
        }
    )
    return first, ask()


@pytest.mark.parametrize("stream", [False, True])
def test_responses_agent_loop(agents, stream):
    first, second = responses_loop(agents.openai, agents.model_id, "Lima", stream)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    reasoning, call = first.output
    assert reasoning.content[0].text.strip() == thought("Lima")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lima"}
    assert call.call_id and first.status == "completed"
    assert second.output_text == final_answer("Lima")
    assert second.usage.output_tokens > 0 and second.usage.input_tokens > 0


def test_responses_instructions_max_output_tokens_and_refusals(agents):
    r = agents.openai.responses.create(
        model=agents.model_id, input=question("Paris"), max_output_tokens=3
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    with pytest.raises(openai.NotFoundError, match="'resp_x'.* is not kept"):
        agents.openai.responses.create(
            model=agents.model_id, input="hi", previous_response_id="resp_x"
        )
    # a hosted tool a local model cannot run: left out of the prompt, said in the answer
    r = agents.openai.responses.create(
        model=agents.model_id, input="hi", tools=[{"type": "web_search"}], max_output_tokens=3
    )
    assert r.model_extra["notes"] == [
        "hosted tools a local model cannot run were left out: web_search"
    ]


# Anthropic Messages


def messages_loop(client, model: str, city: str, stream: bool) -> tuple:
    messages: list = [{"role": "user", "content": question(city)}]

    def ask():
        if not stream:
            return client.messages.create(
                model=model, max_tokens=100, messages=messages, tools=[ANTHROPIC_TOOL]
            )
        with client.messages.stream(
            model=model, max_tokens=100, messages=messages, tools=[ANTHROPIC_TOOL]
        ) as s:
            events = list(s)
            kinds = [event.type for event in events]
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            final = s.get_final_message()
            start = events[0].message.usage  # the prompt's counts, before the first token
            assert start.input_tokens > 0 and start.output_tokens == 0, start
            counted = (final.usage.input_tokens, final.usage.cache_read_input_tokens)
            assert (start.input_tokens, start.cache_read_input_tokens) == counted, start
            return final

    first = ask()
    use = first.content[-1]
    messages.append(
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    )
    messages.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": weather(use.input["city"]),
                }
            ],
        }
    )
    return first, ask()


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_agent_loop(agents, stream):
    first, second = messages_loop(agents.anthropic, agents.model_id, "Tokyo", stream)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking.strip() == thought("Tokyo")
    use = first.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Tokyo"} and use.id
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["text"]
    assert second.content[0].text == final_answer("Tokyo")


def test_anthropic_count_tokens_stop_sequences_and_errors(agents):
    messages = [{"role": "user", "content": question("Oslo")}]
    counted = agents.anthropic.messages.count_tokens(
        model=agents.model_id, messages=messages, tools=[ANTHROPIC_TOOL]
    )
    answer = agents.anthropic.messages.create(
        model=agents.model_id, max_tokens=100, messages=messages, tools=[ANTHROPIC_TOOL]
    )
    usage = answer.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 0
    answered = [  # the tool's result is in: the model answers "It is 4 degrees in Oslo."
        *messages,
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
            ],  # fmt: skip
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": weather("Oslo")}],
        },  # fmt: skip
    ]
    stopped = agents.anthropic.messages.create(
        model=agents.model_id,
        max_tokens=100,
        messages=answered,
        tools=[ANTHROPIC_TOOL],
        stop_sequences=["nothing like it", " degrees"],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " degrees"
    assert [b.text for b in stopped.content] == [final_answer("Oslo").split(" degrees")[0]]
    with pytest.raises(anthropic.BadRequestError) as e:
        agents.anthropic.messages.create(
            model=agents.model_id,
            max_tokens=10,
            messages=messages,
            tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "tool", "name": "get_time"},  # not among the tools
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        agents.anthropic.messages.create(model="claude-x", max_tokens=10, messages=messages)
    keyless = anthropic.Anthropic(base_url=str(agents.anthropic.base_url), api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as e:
        keyless.messages.create(model=agents.model_id, max_tokens=10, messages=messages)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or wrong API key"},
    }


def test_openai_refuses_what_it_cannot_do(agents):
    base = {"model": agents.model_id, "messages": [{"role": "user", "content": "hi"}]}
    for extra, field in [
        ({"n": 2}, "'n'"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "'tool_choice' names 'nope'",
        ),  # fmt: skip
        ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs'"),
    ]:
        with pytest.raises(openai.BadRequestError, match=field):
            agents.openai.chat.completions.create(**base, **extra)


# Ollama's /api/chat, through the official ollama client


def ollama_loop(client, model: str, city: str, stream: bool) -> tuple:
    """The agent loop as Ollama's clients run it (arguments as objects, the tool's result
    named by ``tool_name``); each answer as (content, thinking, calls, done_reason)."""
    messages: list = [{"role": "user", "content": question(city)}]

    def ask():
        asked = {"model": model, "messages": messages, "tools": [WEATHER_TOOL],
                 "options": {"temperature": 0}}  # fmt: skip
        if not stream:
            r = client.chat(**asked, stream=False)
            return (r.message.content, r.message.thinking, list(r.message.tool_calls or []),
                    r.done_reason)  # fmt: skip
        parts = list(client.chat(**asked, stream=True))
        assert [p.done for p in parts].count(True) == 1 and parts[-1].done
        return ("".join(p.message.content or "" for p in parts),
                "".join(p.message.thinking or "" for p in parts),
                [c for p in parts for c in p.message.tool_calls or []],
                parts[-1].done_reason)  # fmt: skip

    first = ask()
    (call,) = first[2]
    messages.append({"role": "assistant", "content": first[0], "tool_calls": [call]})
    messages.append({"role": "tool", "content": weather(call.function.arguments["city"]),
                     "tool_name": call.function.name})  # fmt: skip
    return first, ask()


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_agent_loop(agents, stream):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=f"http://127.0.0.1:{agents.port}",
                           headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    (content, thinking, calls, _), second = ollama_loop(client, agents.model_id, "Lima", stream)
    assert thinking.strip() == thought("Lima") and not content.strip()
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Lima"}
    assert second[0] == final_answer("Lima") and not second[2] and second[3] == "stop"


def test_agent_loops_through_every_api_at_once(agents):
    """Twelve agent loops, six at a time: each API, each city, streaming or not, batched in
    lockstep on both ranks; each gets its own call and answer."""
    loops = {
        "chat": (chat_loop, agents.openai),
        "responses": (responses_loop, agents.openai),
        "messages": (messages_loop, agents.anthropic),
    }
    jobs = []
    with ThreadPoolExecutor(6) as pool:
        for i, city in enumerate(CITIES):
            for api, (loop, client) in loops.items():
                job = pool.submit(loop, client, agents.model_id, city, i % 2 == 1)
                jobs.append((api, city, job))
        for api, city, job in jobs:
            _, second = job.result(timeout=300)
            text = {
                "chat": lambda r: r.choices[0].message.content,
                "responses": lambda r: r.output_text,
                "messages": lambda r: r.content[0].text,
            }[api](second)
            assert text == final_answer(city), (api, city)


def test_a_client_that_leaves_each_stream_frees_the_server(agents):
    """A client that reads the first event of a Messages or Responses stream and hangs up:
    its answer is dropped on every rank, and the next request is answered."""
    import http.client
    import time

    # greedy, this model answers "{" with 490 tokens ("Tell me a long story" got 32, which at
    # the default temperature could end before the server saw its client leave)
    bodies = {
        "/v1/messages": {
            "max_tokens": 500,
            "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": "{"}],
        },  # fmt: skip
        "/v1/responses": {
            "max_output_tokens": 500,
            "temperature": 0,
            "stream": True,
            "input": "{",
        },  # fmt: skip
    }
    before = cancelled(agents)
    for path, body in bodies.items():
        conn = http.client.HTTPConnection("127.0.0.1", agents.port, timeout=60)
        headers = {"Content-Type": "application/json", "x-api-key": KEY}
        conn.request("POST", path, json.dumps(body).encode(), headers)
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"event: ")
        response.close()  # the server's socket now gets a reset or a broken pipe
        conn.close()
    deadline = time.monotonic() + 60
    health = None
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", agents.port, timeout=60)
        conn.request("GET", "/health", headers={"Authorization": f"Bearer {KEY}"})
        health = json.loads(conn.getresponse().read())
        if health["in_flight"] == 0:
            break
        time.sleep(0.1)
    assert health["in_flight"] == 0 and health["status"] == "ok"
    assert cancelled(agents) == before + 2
    _, second = chat_loop(agents.openai, agents.model_id, "Lima", False)
    assert second.choices[0].message.content == final_answer("Lima")


def cancelled(served) -> float:
    """How many requests /metrics counts as cancelled (their client left)."""
    import http.client
    import re

    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("GET", "/metrics", headers={"x-api-key": KEY})
    metrics = conn.getresponse().read().decode()
    found = re.search(r'mlx_cluster_requests_total\{status="cancelled"\} ([0-9.]+)', metrics)
    return float(found.group(1)) if found else 0.0
