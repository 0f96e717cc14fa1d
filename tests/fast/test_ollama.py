"""Ollama's API (cluster/serve/api/ollama.py) through serve's real HTTP server with a stand-in
for the ranks, driven with the official ``ollama`` client: chat and generate, streamed (as
Ollama does unless told otherwise) and whole, tool calls with their arguments as objects,
``options`` and ``format`` mapped onto the same settings as OpenAI's, the model's listing,
card and process, errors as the client raises them. Through a real serve: tests/e2e."""

from __future__ import annotations

import json

import pytest

from cluster.core.protocol import Piece, ToolCall
from cluster.serve.api.shared import END
from tests.support.serving import StandIn, running_api

ollama = pytest.importorskip("ollama")

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}},
    "required": ["city"]}}}  # fmt: skip


class Speaker(StandIn):
    """Answers with reasoning, two pieces of text and, when asked with tools, a call."""

    def submit(self, req) -> None:
        self.submitted.append(req)
        req.result = {"finish_reason": "length", "usage": {"prompt_tokens": 7,
                      "completion_tokens": 3, "total_tokens": 10},
                      "timings": {"prompt_ms": 20.0, "predicted_ms": 30.0}}  # fmt: skip
        req.chunks.put(Piece(req.id, "hmm", channel="reasoning"))
        req.chunks.put(Piece(req.id, "Hello"))
        req.chunks.put(Piece(req.id, " there"))
        if req.request.template.tools:
            req.chunks.put(ToolCall(req.id, 0, "get_weather", '{"city": "Lima"}'))
        req.chunks.put(END)


@pytest.fixture
def api():
    with running_api(Speaker()) as server:
        server.client = ollama.Client(host=f"http://127.0.0.1:{server.address[1]}")
        yield server


def test_chat_whole_and_streamed_with_tools_and_counts(api):
    client = api.client
    r = client.chat(model="m", messages=[{"role": "user", "content": "Hi"}], stream=False,
                    tools=[TOOL])  # fmt: skip
    assert r.message.content == "Hello there" and r.message.thinking == "hmm"
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Lima"}
    assert (r.done, r.done_reason, r.prompt_eval_count, r.eval_count) == (True, "length", 7, 3)
    assert r.eval_duration == 30_000_000 and r.prompt_eval_duration == 20_000_000
    parts = list(
        client.chat(model="m:latest", messages=[{"role": "user", "content": "Hi"}], stream=True)
    )
    assert "".join(p.message.content for p in parts) == "Hello there"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 3
    # the conversation goes on with the call's result, Ollama's way (arguments as objects)
    client.chat(model="m", stream=False, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "21 C", "tool_name": "get_weather"}])  # fmt: skip
    sent = api.service.submitted[-1].request.messages
    assert sent[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Lima"},
    }
    assert sent[2] == {"role": "tool", "content": "21 C", "name": "get_weather"}


def test_generate_and_the_options_format_and_think_it_maps(api):
    client = api.client
    r = client.generate(model="m", prompt="Why?", system="Be brief.", stream=False, think=True,
                        format={"type": "object", "properties": {"a": {"type": "integer"}}},
                        options={"temperature": 0.5, "top_k": 7, "num_predict": 9, "seed": 3,
                                 "repeat_penalty": 1.1, "repeat_last_n": 32, "stop": ["x"],
                                 "num_ctx": 8192, "mirostat": 0})  # fmt: skip
    assert r.response == "Hello there" and r.thinking == "hmm" and r.done
    request = api.service.submitted[-1].request
    assert request.messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Why?"}]  # fmt: skip
    s = request.sampling
    assert (s.temp, s.top_k, s.max_tokens, s.seed, s.repetition_penalty,
            s.repetition_context_size, s.stop) == (0.5, 7, 9, 3, 1.1, 32, ["x"])  # fmt: skip
    assert request.template.enable_thinking is True
    assert request.constraint is not None and request.constraint.source.startswith(
        "response_format")  # fmt: skip
    text = "".join(
        p.response for p in client.generate(model="m", prompt="Why?", raw=True, stream=True)
    )
    assert text == "Hello there" and api.service.submitted[-1].request.kind == "completion"
    unlimited = client.generate(model="m", prompt="Go", options={"num_predict": -1}, stream=False)
    assert unlimited.done and api.service.submitted[-1].request.sampling.max_tokens == 32768


def test_listing_card_processes_and_version(api):
    client = api.client
    (model,) = client.list().models
    assert model.model == "m"
    (running,) = client.ps().models
    assert running.model == "m"
    card = client.show("m")
    assert "completion" in card.capabilities
    assert card.modelinfo["general.architecture"]
    import urllib.request

    url = f"http://127.0.0.1:{api.address[1]}/api/version"
    assert json.loads(urllib.request.urlopen(url).read())["version"]


def test_errors_are_ollama_s_and_the_client_raises_them(api):
    client = api.client
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="other", messages=[{"role": "user", "content": "Hi"}], stream=False)
    assert e.value.status_code == 404 and "not served here" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=[{"role": "user", "content": "Hi"}], stream=False,
                    options={"temperature": -1})  # fmt: skip
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("other")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="m", prompt="x", suffix="y", stream=False)
    assert e.value.status_code == 400 and "suffix" in e.value.error


def test_what_ollama_s_own_server_does_with_odd_bodies_and_refusals():
    """Three places serve differed from Ollama (issue 62): a ``"stream": "false"`` string
    streamed (now a 400, as Ollama's typed decoding refuses it); /api/show's refusals
    before its body (the API key) came in OpenAI's error shape; curl's default form content
    type got a 415 (Ollama reads the body as JSON, whatever its label)."""
    import urllib.error
    import urllib.request

    with running_api(Speaker(), key="sekrit") as server:
        base = f"http://127.0.0.1:{server.address[1]}"

        def post(path: str, body: dict, kind: str = "application/json", key: bool = True):
            headers = {"Content-Type": kind, **({"Authorization": "Bearer sekrit"} if key else {})}
            req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
        status, data = post("/api/chat", {**chat, "stream": "false"})
        assert status == 400 and json.loads(data) == {
            "error": "'stream' must be true or false, got 'false'"}  # fmt: skip
        status, data = post("/v1/chat/completions", {**chat, "stream": 1})
        assert status == 400 and "'stream' must be true or false" in data.decode()
        status, data = post("/api/show", {"model": "m"}, key=False)
        assert status == 401 and json.loads(data) == {"error": "missing or wrong API key"}
        status, data = post("/api/chat", {**chat, "stream": False},
                            kind="application/x-www-form-urlencoded")  # fmt: skip
        assert status == 200 and json.loads(data)["message"]["content"] == "Hello there"
        status, _ = post("/v1/chat/completions", chat, kind="application/x-www-form-urlencoded")
        assert status == 415  # OpenAI's and Anthropic's routes keep asking for JSON
