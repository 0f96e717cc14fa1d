"""What a request may ask of serve, checked at the door (cluster.serve.api.shared: RANGES,
loads, the dialects' parse), and rank 0's checks once it has the tokens (node.serve.Admission);
no rank.

A property-based fuzzer sends any JSON body to every dialect: the answer is a 4xx naming
what is wrong, or a request that travels to rank 0, never an exception."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.core.spec import Sampling, ServeRequest, SharedRequest, to_dict
from cluster.serve.api import anthropic, openai, responses
from cluster.serve.api.anthropic import CountTokens, Messages
from cluster.serve.api.openai import ChatCompletions, Completions
from cluster.serve.api.responses import Responses
from cluster.serve.api.shared import RANGES, Door, RequestError, loads
from tests.support.processes import ROOT

DOOR = Door(frozenset({"m"}), max_tokens_cap=1000)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BODIES = {  # the smallest valid body of each dialect
    ChatCompletions: CHAT,
    Completions: {"prompt": "hi"},
    Responses: {"input": "hi"},
    Messages: {**CHAT, "max_tokens": 4},
    CountTokens: CHAT,
}
FIELDS = {  # each dialect's names for our settings (its own table: every one is checked)
    ChatCompletions: openai.API_SAMPLING,
    Responses: responses.API_SAMPLING,
    Messages: anthropic.API_SAMPLING,
}


def parse(endpoint, **fields) -> ServeRequest:
    return endpoint().parse({**BODIES[endpoint], **fields}, DOOR)


def refusal(endpoint, **fields) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(endpoint, **fields)
    assert 400 <= e.value.status < 500
    return e.value


def test_the_requests_that_took_serve_down_have_a_meaning():
    seeded = parse(ChatCompletions, seed=-1, temperature=0.5)
    assert seeded.sampling.seed is None and not seeded.seeded  # -1: a random seed, batched
    assert parse(ChatCompletions, seed=7).seeded
    big_k = parse(ChatCompletions, temperature=0.7, top_k=100000)
    assert big_k.sampling.top_k == 100000  # rank 0 turns k >= vocabulary into "off"
    assert parse(Responses, top_k=-1).sampling.top_k == 0  # vLLM's "off"


@pytest.mark.parametrize("endpoint", list(FIELDS))
def test_every_setting_out_of_its_range_is_a_400_naming_field_and_range(endpoint):
    bad = {  # a value just outside, and one of the wrong type
        "temp": [-0.1, 100.5, "hot"],
        "top_p": [-0.01, 1.01, True],
        "top_k": [-2, 2**31, 1.5],
        "min_p": [-0.1, 1.5, None and 0],
        "seed": [-2, 2**63, 1.0],
        "presence_penalty": [-2.5, 2.5],
        "frequency_penalty": [-2.5, 2.5],
        "repetition_penalty": [0, 10.5, -1],
        "repetition_context_size": [0, 2**20 + 1, 2.5],
    }
    for name, ours in FIELDS[endpoint].items():
        for value in bad[ours]:
            if value is None:
                continue
            e = refusal(endpoint, **{name: value})
            assert f"'{name}' must be {RANGES[ours].describe()}" in str(e), (name, value)
        low = RANGES[ours].low + (0.5 if RANGES[ours].low_open else 0)
        parse(endpoint, **{name: low if not RANGES[ours].integer else int(low)})


def test_max_tokens_default_is_the_context_left_under_the_cap():
    """Absent, max_tokens is the cap (rank 0 lowers it to what the context leaves after the
    prompt: Admission), or --default-max-tokens; above the cap it is lowered, not refused
    (Claude Code asks 128000). Anthropic's Messages requires it, as Anthropic's API does."""
    for endpoint, name in [(ChatCompletions, "max_tokens"), (ChatCompletions,
                           "max_completion_tokens"), (Completions, "max_tokens"),
                           (Responses, "max_output_tokens"), (Messages, "max_tokens")]:  # fmt: skip
        assert parse(endpoint, **{name: 128000}).sampling.max_tokens == 1000, (endpoint, name)
        assert parse(endpoint, **{name: 7}).sampling.max_tokens == 7
    fewer = dataclasses.replace(DOOR, default_max_tokens=64)
    for endpoint, name in [(ChatCompletions, "max_tokens"), (Completions, "max_tokens"),
                           (Responses, "max_output_tokens")]:  # fmt: skip
        assert parse(endpoint).sampling.max_tokens == 1000
        assert endpoint().parse(BODIES[endpoint], fewer).sampling.max_tokens == 64
        asked = {**BODIES[endpoint], name: 100}
        assert endpoint().parse(asked, fewer).sampling.max_tokens == 100
    assert "max_tokens: Field required" in str(refusal(Messages, max_tokens=None))
    from node.jobs.serve import Admission

    shared = Admission(vocab=None, context=300, max_prompt_tokens=None).request(
        list(range(200)), parse(ChatCompletions).sampling
    )
    assert shared.sampling.max_tokens == 100  # what the context leaves


def test_other_fields_are_bounded_too():
    assert "max_output_tokens" in str(refusal(Responses, max_output_tokens=0))
    assert parse(Messages, max_tokens=1000).sampling.max_tokens == 1000
    assert "'stop' has 17 items; at most 16" in str(refusal(ChatCompletions, stop=["x"] * 17))
    assert "at most 1000 characters" in str(refusal(Messages, stop_sequences=["x" * 1001]))
    assert "'messages' has 10001 items" in str(
        refusal(ChatCompletions, messages=[{"role": "user", "content": "x"}] * 10_001)
    )
    assert "not a token id" in str(refusal(ChatCompletions, logit_bias={"-1": 1}))
    assert "from -100 to 100" in str(refusal(Completions, logit_bias={"5": 101}))
    assert parse(ChatCompletions, logit_bias={"05": -100}).sampling.logit_bias == {"5": -100.0}
    assert "between 0 and 20" in str(refusal(ChatCompletions, logprobs=True, top_logprobs=21))


def test_json_that_python_takes_but_json_does_not_is_refused():
    for data, says in [
        (b'{"temperature": NaN}', "NaN is not a JSON number"),
        (b'{"temperature": Infinity}', "Infinity is not a JSON number"),
        (b"[" * 100 + b"]" * 100, "nested deeper than 64"),
        (b"[" * 100_000, "nested deeper than 64"),
        (b'{"a": "\xff\xfe"}', "not valid JSON"),
        (b"9" * 5000, "not valid JSON"),
    ]:
        with pytest.raises(RequestError, match=says):
            loads(data)
    assert loads(b"") is None and loads(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}


def test_the_second_review_s_requests_are_4xx(monkeypatch):
    """Each once took serve down or leaked: a lone surrogate (valid JSON) anywhere a string
    goes, tool-call arguments nested past the limit inside their JSON text, Unicode digits,
    a stream_options of another type, a model that is not served named by a path."""
    lone = '"\\ud800"'
    for path, data, says in [
        ("stop", b'{"stop": [' + lone.encode() + b"]}", "'stop[0]': holds a lone surrogate"),
        ("content", b'{"messages": [{"role": "user", "content": ' + lone.encode() + b"}]}",
         "'messages[0].content': holds a lone surrogate"),
        ("key", b'{"metadata": {' + lone.encode() + b': 1}}', "'metadata': a key holds"),
    ]:  # fmt: skip
        with pytest.raises(RequestError) as e:
            loads(data)
        assert says in str(e.value), path
    assert loads(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a pair is a character
    deep = "[" * 500 + "]" * 500
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]
    e = refusal(ChatCompletions, messages=[{"role": "user", "content": "x"},
                                           {"role": "assistant", "tool_calls": calls}])  # fmt: skip
    assert "'messages[1].tool_calls[0].arguments' is nested deeper than 64" in str(e)
    e = refusal(Responses, input=[{"type": "function_call", "name": "f", "call_id": "c",
                                   "arguments": "[" * 100_000}])  # fmt: skip
    assert "'input[0].arguments' is nested deeper" in str(e)
    e = refusal(ChatCompletions, messages=[{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": '{"a": "\\udfff"}'}}]}])  # fmt: skip
    assert "'messages[0].tool_calls[0].arguments.a': holds a lone surrogate" in str(e)
    assert "not a token id" in str(refusal(ChatCompletions, logit_bias={"\u00b2": 1}))
    for bad in ("x", [], 3, {"include_usage": "yes"}):
        assert "stream_options" in str(refusal(ChatCompletions, stream=True, stream_options=bad))
    assert parse(Completions, stream_options={"include_usage": True})
    door = Door(frozenset({"m", "/Users/me/models/m"}), 1000, "m")
    with pytest.raises(RequestError) as e:
        ChatCompletions().parse({**CHAT, "model": "x"}, door)
    assert e.value.status == 404 and "/Users" not in str(e.value) and "'m'" in str(e.value)


def test_a_body_of_a_million_values_is_refused_before_it_is_built():
    data = b"[" + b",".join([b"[]"] * 1_100_000) + b"]"
    with pytest.raises(RequestError, match="holds 2200001 JSON values"):
        loads(data)
    text = json.dumps({"messages": [{"role": "user", "content": "a, [b], {c}" * 200_000}]})
    assert len(loads(text.encode())["messages"][0]["content"]) == 11 * 200_000  # strings: 1 each


surrogates = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d"])
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | surrogates
    | st.sampled_from(
        [
            "\u00b2",
            "\u0663",
            "[" * 80 + "]" * 80,
            "[" * 3000,
            '"' + '\\"' * 200,
            '{"type": "object"}',
            '{"type": "string", "maxLength": 3}',
            "{",
        ]
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=20,
)
field_names = st.sampled_from(
    ["messages", "prompt", "input", "model", "max_tokens", "max_output_tokens", "stop",
     "stop_sequences", "temperature", "top_p", "top_k", "seed", "min_p", "tools",
     "tool_choice", "logprobs", "top_logprobs", "n", "stream", "system", "instructions",
     "logit_bias", "response_format", "reasoning", "thinking", "chat_template_kwargs",
     "repetition_penalty", "presence_penalty", "max_completion_tokens", "include",
     "stream_options", "text", "metadata", "tool_calls", "guided_json", "guided_regex",
     "guided_grammar", "guided_choice", "structured_outputs", "output_config", "output_format"]
)  # fmt: skip
calls = st.lists(  # tool calls whose arguments are JSON text: deep, odd or with a surrogate
    st.fixed_dictionaries({"function": st.fixed_dictionaries({
        "name": st.text(max_size=4),
        "arguments": st.sampled_from(["{}", "[" * 70 + "]" * 70, '{"a": "\\ud800"}',
                                      '{"a": {"b": [1, 2.5, null]}}', "not json", "[" * 3000]),
    })}),
    max_size=2,
)  # fmt: skip
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool", "developer", 3]),
            "content": json_values,
        },  # fmt: skip
        optional={
            "tool_calls": json_values | calls,
            "name": json_values,
            "type": json_values,
            "arguments": json_values,
            "call_id": json_values,
        },  # fmt: skip
    ),
    max_size=3,
)
bodies = st.one_of(
    json_values,
    st.dictionaries(field_names, json_values, max_size=6),
    st.builds(
        lambda m, extra: {
            "messages": m,
            "input": m,
            "prompt": "x",
            "max_tokens": 3,
            **extra,
        },  # fmt: skip
        messages,
        st.dictionaries(field_names, json_values, max_size=4),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_any_json_body_is_a_4xx_or_a_request_that_travels(body):
    """Through the door as the server takes it (bytes, then loads); a request that passes
    encodes as rank 0 gets it and as every rank gets it (share_object's encoder)."""
    from node.rank.share import encode

    for endpoint in (ChatCompletions, Completions, Responses, Messages, CountTokens):
        try:
            data = json.dumps(body).encode()  # ensure_ascii: a surrogate travels as an escape
            request = endpoint().parse(loads(data), DOOR)
        except RequestError as e:
            assert 400 <= e.status < 500 and str(e)
            continue
        assert isinstance(request, ServeRequest)
        line = json.dumps(to_dict(request))  # what goes to rank 0 is plain JSON
        encode(json.loads(line))  # and what rank 0 shares: valid Unicode, no surrogate
        s = request.sampling
        assert 1 <= s.max_tokens <= DOOR.max_tokens_cap
        for name, allowed in RANGES.items():
            value = getattr(s, name)
            assert value is None or allowed.admits(value), (name, value)


# rank 0, once it has the tokens


def test_rank0_bounds_the_prompt_and_the_answer_by_the_context():
    from node.jobs.serve import Admission, Refusal

    admit = Admission(vocab=100, context=50, max_prompt_tokens=None)
    shared = admit.request(list(range(40)), Sampling(max_tokens=30, top_k=100))
    assert shared.sampling.max_tokens == 10 and shared.sampling.top_k == 0  # the context; off
    with pytest.raises(Refusal, match="the prompt is 51 tokens, over the model's context"):
        admit.request(list(range(51)), Sampling())
    with pytest.raises(Refusal, match="fills the model's context"):
        admit.request(list(range(50)), Sampling())
    with pytest.raises(Refusal, match="token id 100 is outside the vocabulary"):
        admit.request([1], Sampling(logit_bias={"100": 1.0}))
    capped = Admission(vocab=100, context=None, max_prompt_tokens=5)
    with pytest.raises(Refusal, match="over this server's --max-prompt-tokens"):
        capped.request(list(range(6)), Sampling())
    assert capped.request([1], Sampling(max_tokens=7)).sampling.max_tokens == 7


def test_settings_that_would_fail_mid_batch_fail_before_the_request_joins():
    from node.decode.sampling import RequestFailed, tried

    def request(**s):
        return SharedRequest(Sampling(seed=1, **s), [1, 2, 3])

    with pytest.raises(RequestFailed, match="top_k"):
        tried(request(temp=0.7, top_k=5000), 2048)  # mlx-lm's apply_top_k raises in a step
    # the failure left the random state usable (mlx-lm's compiled samplers share it)
    chosen, chain = tried(request(temp=0.7, top_k=40, logit_bias={"3": 5.0}), 2048)
    assert len(chain) == 1 and callable(chosen)


def test_rank0_fits_answers_to_the_memory_every_rank_has():
    """kv_room: the tokens of KV cache the ranks agreed they hold; a request is lowered to it,
    or refused when its prompt alone does not fit."""
    from node.jobs.serve import Admission, Refusal

    admit = Admission(vocab=100, context=10_000, max_prompt_tokens=None, kv_room=50)
    assert admit.request(list(range(40)), Sampling(max_tokens=30)).sampling.max_tokens == 10
    with pytest.raises(Refusal, match="memory holds the KV cache of 50 tokens at most"):
        admit.request(list(range(50)), Sampling())


class Inbox:
    """Rank 0's inbox as the scheduler reads it, without the channel behind it."""

    def __init__(self):
        import queue
        import threading

        self.flights = queue.Queue()
        self.prepared_all, self.draining = threading.Event(), threading.Event()

    def ended(self, flight):
        pass


def scheduler(room: int | None, emit=lambda e: None, rests: bool = False):
    import node.jobs.serve as ns

    s = ns.Scheduler(None, emit, True, 30.0, ns.Admission(100, None, None, kv_room=room),
                     rests=rests)  # fmt: skip
    s.inbox = Inbox()
    return s


def flight(prompt: int, answer: int):
    import node.jobs.serve as ns

    t = ns.Flight(ServeRequest(id="r", kind="completion", sampling=Sampling()))
    t.shared = SharedRequest(Sampling(max_tokens=answer), [1] * prompt)
    t.size = ns.shared_size(t.shared)
    return t


def test_an_order_waits_for_memory_and_stays_under_its_byte_bound(monkeypatch):
    """Requests join while the KV room of the ranks has place for their prompt and answer
    (the rest wait for answers to end), and while the order stays under ORDER_BYTES: no
    order of many long prompts can pass share_object's limit on every rank."""
    import node.jobs.serve as ns

    s = scheduler(room=100)
    for _ in range(3):
        s.take(flight(40, 20))  # 60 tokens each
    assert len(s.order(live=0).insert) == 1  # 120 > 100: the second waits
    s.inserting = []
    s.reserved = 60  # the first is decoding
    assert s.order(live=1) is None  # still no room
    s.reserved = 0  # it ended
    assert len(s.order(live=0).insert) == 1
    s = scheduler(room=None)
    monkeypatch.setattr(ns, "ORDER_BYTES", 2 * flight(40, 20).size + 1)
    for _ in range(5):
        s.take(flight(40, 20))
    assert [len(s.order(live=0).insert) for _ in range(3)] == [2, 2, 1]
    with pytest.raises(ns.Refusal, match="bytes as the ranks get it"):
        ns.shared_size(SharedRequest(Sampling(max_tokens=1), [1] * 1000))
    with pytest.raises(ns.Refusal, match="cannot be passed to the other ranks"):
        ns.shared_size(SharedRequest(Sampling(max_tokens=1, stop=["\ud800"]), [1]))


def test_an_idle_rank_0_orders_a_rest_and_wakes_the_ranks_for_the_next_request():
    """With a launcher to pass its Wake on, rank 0 with nothing to do orders a rest at once
    (no ping every PING_S), waits for a request without a collective, says Wake, and the
    next order carries the request; without one it pings."""
    import threading

    from cluster.core.protocol import Wake

    events = []
    s = scheduler(None, events.append, rests=True)
    order = s.order(live=0)
    assert order.rest and not order.insert and not order.quit
    arrived = flight(4, 4)
    threading.Timer(0.2, s.inbox.flights.put, (arrived,)).start()
    s.rest()  # returns once the request is there
    assert events == [Wake()]
    assert s.order(live=0).insert == [arrived.shared]
    s.inserting = []
    assert s.order(live=0).rest

    def drain():  # as the channel's reader does at END_OF_INPUT
        s.inbox.prepared_all.set()
        s.inbox.flights.put(None)

    threading.Timer(0.2, drain).start()
    s.rest()  # woken by the drain
    assert events == [Wake(), Wake()] and s.order(live=0).quit
    pinging = scheduler(None, rests=False)
    pinging.inbox.flights.put(None)  # what a ping waits for at most (PING_S)
    assert pinging.order(live=0) is None  # a wake-up with nothing in it: nothing to order


def test_a_request_rank_0_cannot_prepare_is_answered_not_lost():
    """A bug while preparing (a template, a tokenizer, a grammar) ends that request with a
    500; it used to be dropped silently, and its client waited forever."""
    import os
    import threading

    from node.jobs.serve import Inbox

    failed = []
    done = threading.Event()

    def broken(flight):
        raise RuntimeError("boom")

    r, w = os.pipe()
    inbox = Inbox(os.fdopen(r, "rb"), lambda m: None, broken,
                  lambda rid, why: (failed.append((rid, why)), done.set()))  # fmt: skip
    req = ServeRequest(id="r1", kind="completion", sampling=Sampling(), prompt="x")
    os.write(w, json.dumps({"op": "request", "request": to_dict(req)}).encode() + b"\n")
    assert done.wait(10)
    assert failed == [("r1", "rank 0 could not prepare it (RuntimeError)")]
    assert "r1" not in inbox.known
    os.close(w)


def test_every_ranged_request_field_has_its_row_in_the_docs():
    """docs/serve.md's table of limits names every field a request may set within a range
    (the declarations in cluster.core.spec), so a new parameter is not left undocumented."""
    table = (ROOT / "docs" / "serve.md").read_text().split("## Limits and refusals")[1]
    for fields in FIELDS.values():
        for name in fields:
            assert f"`{name}`" in table, name


def test_the_third_review_s_bodies_are_4xx_not_dropped_connections():
    """Shapes that raised past the door's checks (AttributeError, RecursionError) and so
    dropped the connection: each is now a 400 naming its field."""
    from cluster.core.grammar import MAX_DEPTH

    cases = [
        (CountTokens, {**CHAT, "output_config": "x"}, "output_config"),
        (Messages, {**CHAT, "max_tokens": 5, "output_config": {"effort": 3}}, "effort"),
        (ChatCompletions, {**CHAT, "guided_json": "[" * 100_000}, "guided_json"),
        (ChatCompletions, {**CHAT, "structured_outputs": {"json": "[" * 100_000}},
         "structured_outputs.json"),
        (ChatCompletions, {**CHAT, "guided_json": "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)},
         f"deeper than {MAX_DEPTH}"),
        (CountTokens, {**CHAT, "output_config": {"format": {"type": "json_schema",
                                                            "schema": "{"}}}, "not JSON"),
    ]  # fmt: skip
    for endpoint, body, named in cases:
        with pytest.raises(RequestError) as e:
            endpoint().parse(body, DOOR)
        assert e.value.status == 400 and named in str(e.value), (body, str(e.value))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert parse(ChatCompletions, guided_json=schema).constraint is not None  # text is a schema
    counted = CountTokens().parse({**CHAT, "output_config": {"effort": "low"}}, DOOR)
    assert counted.kind == "count" and counted.constraint is None


def test_served_model_names_answer_other_names_and_globs():
    door = Door(frozenset({"m"}), 1000, "m", ("claude-*", "gpt-4o"))
    for name in ("m", "claude-sonnet-4-5", "claude-3-5-haiku-latest", "gpt-4o"):
        assert ChatCompletions().parse({**CHAT, "model": name}, door).kind == "chat"
    with pytest.raises(RequestError) as e:
        ChatCompletions().parse({**CHAT, "model": "gpt-4o-mini"}, door)
    assert e.value.status == 404 and "answers to claude-*, gpt-4o" in str(e.value)
    assert "--served-model-name" in str(refusal(ChatCompletions, model="x"))


def test_errors_name_their_field_as_openai_s_param():
    from cluster.serve.api.shared import error_body

    cases = {
        (ChatCompletions, "temperature"): {"temperature": -1},
        (ChatCompletions, "stop"): {"stop": ["x"] * 17},
        (ChatCompletions, "model"): {"model": "other"},
        (Responses, "max_output_tokens"): {"max_output_tokens": 0},
        (ChatCompletions, "structured_outputs.json"): {"structured_outputs": {"json": "["}},
    }
    for (endpoint, field), extra in cases.items():
        e = refusal(endpoint, **extra)
        assert error_body(e)["error"]["param"] == field, (field, str(e))
    assert error_body(RequestError(400, "the body is not valid JSON"))["error"]["param"] is None
