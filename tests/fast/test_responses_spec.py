"""The Responses API as the OpenResponses specification shapes it, through serve's real HTTP
server with a stand-in for the ranks, driven with the official openai client: every response
object and streamed event validated against the specification's required fields
(tests/support/openresponses.py); responses kept (store) and chained (previous_response_id),
read and deleted (GET, DELETE /v1/responses/{id}, /input_items); the store's bounds."""

from __future__ import annotations

import http.client
import json

import pytest

from cluster.core.protocol import Piece, ToolCall
from cluster.serve.api.shared import END
from cluster.serve.api.stored import ENTRY_BYTES, ResponseStore, Stored
from tests.support.openresponses import ResponseResource, check, check_event
from tests.support.serving import StandIn, running_api

openai = pytest.importorskip("openai")

TOOL = {"type": "function", "name": "weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


class Thinker(StandIn):
    """Answers with reasoning, text and (when the request has tools) a tool call."""

    def submit(self, req) -> None:
        self.submitted.append(req)
        req.result = {"finish_reason": "stop", "usage": {"prompt_tokens": 5,
                      "completion_tokens": 3, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 2}}}  # fmt: skip
        req.chunks.put(Piece(req.id, "let me see", channel="reasoning"))
        req.chunks.put(Piece(req.id, "Sunny", logprobs=[{"token": "Sunny", "logprob": -0.1,
                       "bytes": [83], "top_logprobs": []}]))  # fmt: skip
        if req.request.template.tools:
            req.chunks.put(ToolCall(req.id, 0, "weather", '{"city": "Lima"}'))
        req.chunks.put(END)


@pytest.fixture
def api():
    with running_api(Thinker(), responses=ResponseStore(1 << 20, 3600.0)) as server:
        server.client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.address[1]}/v1",
                                      api_key="none", max_retries=0)  # fmt: skip
        yield server


def raw(api, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*api.address, timeout=10)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
    r = conn.getresponse()
    return r.status, r.read()


def test_every_response_and_event_carries_what_the_specification_requires(api):
    body = {"model": "m", "input": "Weather in Lima?", "tools": [TOOL], "temperature": 0.5,
            "reasoning": {"effort": "low"}, "max_output_tokens": 64, "metadata": {"k": "v"},
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    status, data = raw(api, "POST", "/v1/responses", body)
    assert status == 200
    r = json.loads(data)
    check(r, ResponseResource)
    assert (r["temperature"], r["top_p"], r["presence_penalty"], r["top_logprobs"]) == (
        0.5,
        1.0,
        0.0,
        2,
    )
    assert r["truncation"] == "disabled" and r["store"] is True and r["completed_at"] >= r[
        "created_at"]  # fmt: skip
    assert r["tools"][0]["strict"] is False  # not asked: not applied, and said so
    assert r["reasoning"] == {"effort": "low", "summary": None}
    assert [item["type"] for item in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == 2

    status, data = raw(api, "POST", "/v1/responses", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in data.decode().splitlines()
              if line.startswith("data: ")]  # fmt: skip
    for event in events:
        check_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    streamed = json.dumps(events[-1]["response"]["output"])  # the same items, another id
    assert streamed.replace(events[0]["response"]["id"][5:], r["id"][5:]) == json.dumps(r["output"])
    assert events[0]["response"]["completed_at"] is None  # not completed yet


def test_a_chained_response_continues_its_stored_conversation(api):
    client = api.client
    first = client.responses.create(model="m", instructions="Be brief.", input="Weather?",
                                    tools=[TOOL])  # fmt: skip
    second = client.responses.create(model="m", previous_response_id=first.id,
                                     input=[{"type": "function_call_output",
                                             "call_id": first.output[2].call_id,
                                             "output": "21 C"}],
                                     instructions="Answer in French.")  # fmt: skip
    assert second.previous_response_id == first.id
    messages = api.service.submitted[-1].request.messages
    assert messages == [
        {"role": "system", "content": "Answer in French."},  # the first's not carried over
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sunny", "tool_calls": [{"id": first.output[2].call_id,
         "type": "function", "function": {"name": "weather", "arguments": {"city": "Lima"}}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": first.output[2].call_id},
    ]  # fmt: skip
    third = client.responses.create(model="m", previous_response_id=second.id, input="Thanks")
    chained = api.service.submitted[-1].request.messages  # three turns, no instructions
    assert (
        chained[3:]
        == [{"role": "assistant", "content": "Sunny"}, {"role": "user", "content": "Thanks"}]
        and chained[:3] == messages[1:]
    )

    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    assert client.responses.input_items.list(first.id, order="asc").data[0].content[0].text == (
        "Weather?"
    )
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:  # its chain is broken: named, never half
        client.responses.create(model="m", previous_response_id=third.id, input="More")
    assert first.id in str(e.value) and e.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model="m", input="Hi", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    status, _ = raw(api, "DELETE", f"/v1/responses/{unkept.id}")
    assert status == 404
    status, data = raw(api, "POST", "/v1/responses", {"input": "x", "background": True})
    assert status == 400 and b"background" in data


def stored(size: int, previous: str | None = None) -> Stored:
    return Stored.of({"pad": "x" * size}, [], [{"role": "user", "content": str(size)}], previous)


def test_the_store_is_bounded_by_bytes_and_by_age_and_keeps_a_used_chain():
    now = [0.0]
    one = stored(300).size
    assert one > 300 + ENTRY_BYTES
    store = ResponseStore(3 * one + 10, 60.0, clock=lambda: now[0])  # 3 fit
    assert store.put("a", stored(300)) and store.put("b", stored(300, "a"))
    assert store.put("other", stored(300))
    assert store.conversation("b") == [{"role": "user", "content": "300"}] * 2  # a, b used now
    assert store.put("c", stored(300, "b"))  # over 1200 bytes: the least recently used goes
    assert store.get("other") is None and store.get("a") is not None
    assert store.bytes <= 3 * one + 10
    assert not store.put("huge", stored(4 * one))  # alone over the bound: not kept
    now[0] = 61.0
    assert store.get("c") is None and store.bytes == 0  # past its age
    with pytest.raises(KeyError):
        store.conversation("c")
    off = ResponseStore(0, 60.0)
    assert not off.enabled and not off.put("a", stored(1))


def test_the_store_counts_the_bytes_it_holds():
    """Each response is held as its compact JSON, counted with what keeping it costs: the
    bound is the memory held (before: the JSON's length was counted while the objects it
    came from were held, 1.2-4.3x as much)."""
    import gc
    import tracemalloc

    store = ResponseStore(1 << 30, 60.0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(500):
            text = " ".join(f"w{i}.{j}" for j in range(100))
            store.put(f"resp_{i}", Stored.of({"id": f"resp_{i}", "output": [{"text": text}]},
                                             [{"id": f"item_{i}", "text": text}],
                                             [{"role": "user", "content": text}]))  # fmt: skip
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.8 * store.bytes < held <= store.bytes, (held, store.bytes)


def test_a_chain_too_long_is_refused_as_such_not_as_a_missing_response(monkeypatch):
    import cluster.serve.api.stored as st

    monkeypatch.setattr(st, "MAX_CHAIN", 3)
    store = ResponseStore(1 << 20, 60.0)
    previous = None
    for i in range(5):
        store.put(f"r{i}", stored(10, previous))
        previous = f"r{i}"
    assert len(store.conversation("r2")) == 3
    with pytest.raises(st.ChainTooLong, match="more than 3 responses"):
        store.conversation("r4")
    from cluster.serve.api.responses import Responses
    from cluster.serve.api.shared import RequestError

    with pytest.raises(RequestError) as e:  # a 400 that says so, not a 404 blaming r1
        Responses(store).history({"previous_response_id": "r4"})
    assert e.value.status == 400 and "chains more than 3 responses" in str(e.value)
