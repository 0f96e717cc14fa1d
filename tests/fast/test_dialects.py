"""The API dialects without ranks: each body into the chat messages rank 0 renders, each answer
back into the dialect's shapes; and rank 0's split of an answer into reasoning, content and
tool calls (node.decode.parts) on scripted text."""

from __future__ import annotations

import json
import sys

import pytest

from cluster.core.protocol import Piece, ToolCall
from cluster.serve.api.anthropic import CountTokens, Messages
from cluster.serve.api.openai import ChatCompletions
from cluster.serve.api.responses import Responses
from cluster.serve.api.shared import Answer, ApiRequest, Door, RequestError
from node.decode.parts import Parts

MODELS = Door(frozenset({"m"}))
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALLED = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ],
}


def test_every_dialect_renders_the_same_agent_turn():
    """The same conversation (system, question, a call, its result) in each dialect becomes
    the same chat messages and tools, so the model sees the same prompt."""
    chat = ChatCompletions().parse(
        {
            "messages": [
                {"role": "developer", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "Q"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'},
                        }  # fmt: skip
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "R"},
            ],
            "tools": [TOOL],
        },
        MODELS,
    )
    responses = Responses().parse(
        {
            "instructions": "S",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
                {"type": "reasoning", "id": "rs", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "R"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        },
        MODELS,
    )
    messages = Messages().parse(
        {
            "max_tokens": 5,
            "system": [{"type": "text", "text": "S"}],
            "messages": [
                {"role": "user", "content": "Q"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "R"}],
                },
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        },
        MODELS,
    )
    expected = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        CALLED,
        {"role": "tool", "content": "R", "tool_call_id": "c1"},
    ]
    for request in (chat, responses, messages):
        assert request.messages == expected
        assert request.template.tools == [TOOL]
        assert request.kind == "chat"


def test_anthropic_turn_with_results_and_text_and_a_failed_tool():
    request = Messages().parse(
        {
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "a",
                            "content": [{"type": "text", "text": "boom"}],
                            "is_error": True,
                        },  # fmt: skip
                        {"type": "text", "text": "and then?"},
                    ],
                }
            ],
            "stop_sequences": ["X"],
            "thinking": {"type": "enabled", "budget_tokens": 100},
        },
        MODELS,
    )
    assert request.messages == [
        {"role": "tool", "content": "Error: boom", "tool_call_id": "a"},
        {"role": "user", "content": "and then?"},
    ]
    assert request.sampling.stop == ["X"] and request.sampling.max_tokens == 5
    assert request.template.enable_thinking is True
    assert (
        CountTokens().parse({"messages": [{"role": "user", "content": "x"}]}, MODELS).kind
        == "count"
    )


@pytest.mark.parametrize(
    "endpoint, body, words",
    [
        (Messages(), {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            Messages(),
            {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "'image'",
        ),  # fmt: skip
        (
            ChatCompletions(),
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "'image_url'",
        ),  # fmt: skip
        (ChatCompletions(), {"messages": [{"role": "user", "content": "x"}], "n": 3}, "'n'"),
        (
            ChatCompletions(),
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
            "top_logprobs",
        ),  # fmt: skip
        (Responses(), {"input": []}, "'input'"),
        (Responses(), {"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        (Responses(), {"input": [{"type": "file_search_call"}]}, "file_search_call"),
    ],
)
def test_what_cannot_be_served_is_refused_with_its_field(endpoint, body, words):
    with pytest.raises(RequestError) as e:
        endpoint.parse(body, MODELS)
    assert e.value.status == 400 and words in str(e.value)


def answer_job(endpoint, body) -> ApiRequest:
    return ApiRequest(endpoint, endpoint.parse(body, MODELS), False, "m", endpoint.echo(body))


RESULT = {
    "finish_reason": "tool_calls",
    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    "timings": {},
    "stop_sequence": None,
}


def answered() -> Answer:
    answer = Answer(result=RESULT)
    for item in (
        Piece("x", "think", "reasoning"),
        Piece("x", "", "content"),
        ToolCall("x", 0, "f", '{"a": 1}'),
        ToolCall("x", 1, "g", "{}", id="own"),
    ):
        answer.add(item)
    return answer


def test_one_answer_in_each_dialect():
    chat = ChatCompletions()
    req = answer_job(chat, {"messages": [{"role": "user", "content": "x"}]})
    body = chat.reply(req, answered())
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == "think"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f", "g"]
    assert message["tool_calls"][1]["id"] == "own"
    assert body["choices"][0]["finish_reason"] == "tool_calls"

    responses = Responses()
    body = responses.reply(answer_job(responses, {"input": "x"}), answered())
    assert [o["type"] for o in body["output"]] == ["reasoning", "function_call", "function_call"]
    assert body["status"] == "completed" and body["usage"]["output_tokens"] == 3

    messages = Messages()
    req = answer_job(messages, {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
    body = messages.reply(req, answered())
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use", "tool_use"]
    assert body["content"][1]["input"] == {"a": 1} and body["stop_reason"] == "tool_use"
    assert body["usage"]["input_tokens"] == 7


def test_the_responses_stream_opens_and_closes_each_item_in_order():
    responses = Responses()
    req = answer_job(responses, {"input": "x"})
    stream = responses.events(req)
    events = [*stream.start()]
    for item in (Piece("x", "a", "reasoning"), Piece("x", "b"), Piece("x", "c")):
        events += stream.piece(item)
    events += stream.tool_call(ToolCall("x", 0, "f", "{}"))
    events += stream.end(Answer(result={**RESULT, "finish_reason": "stop"}))
    kinds = [name for name, _ in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    assert events[10][1]["text"] == "bc"
    assert [o["type"] for o in events[-1][1]["response"]["output"]] == [
        "reasoning", "message", "function_call"
    ]  # fmt: skip


# rank 0's split (node.decode.parts), on scripted text


class Tokenizer:
    tool_call_start, tool_call_end = "<tool_call>", "</tool_call>"

    @staticmethod
    def tool_parser(text, tools):
        return json.loads(text)


def split(segments: list[str], tools=(TOOL,), tokenizer=None, split=True) -> list:
    tokenizer = tokenizer or Tokenizer()
    events = []
    parts = Parts("r", tokenizer, list(tools), split, events.append)
    for segment in segments:
        parts.feed(segment)
    called = parts.finish()
    merged: list = []
    for e in events:  # adjacent pieces of one channel, joined
        if merged and isinstance(e, Piece) and isinstance(merged[-1], Piece):
            if merged[-1].channel == e.channel:
                merged[-1] = Piece("r", merged[-1].text + e.text, e.channel)
                continue
        merged.append(e if not isinstance(e, Piece) else Piece("r", e.text, e.channel))
    return [called, *merged]


def test_markers_split_across_segments_come_apart():
    segments = ["<thi", "nk>\nhm", "m</th", "ink>\n\n<tool", '_call>{"name": "f", "argu']
    segments.append('ments": {"a": 1}}</tool_call>')
    assert split(segments) == [
        True,
        Piece("r", "hmm", "reasoning"),
        ToolCall("r", 0, "f", '{"a": 1}'),
    ]


def test_markup_that_does_not_parse_stays_as_content_and_no_tools_means_no_parsing():
    assert split(["<tool_call>not json</tool_call> ok"]) == [
        False,
        Piece("r", "<tool_call>not json</tool_call> ok", "content"),
    ]
    text = '<tool_call>{"name": "f"}</tool_call>'
    assert split([text], tools=()) == [False, Piece("r", text, "content")]
    assert split(["<think>x</think>y"], split=False) == [
        False,
        Piece("r", "<think>x</think>y", "content"),
    ]


def test_a_call_cut_by_the_token_limit_is_kept_as_text():
    assert split(['<tool_call>{"name": "f", "argu']) == [
        False,
        Piece("r", '<tool_call>{"name": "f", "argu', "content"),
    ]


def test_a_family_without_an_end_marker_calls_at_the_end():
    class Mistral(Tokenizer):
        tool_call_start, tool_call_end = "[TOOL_CALLS]", None

        @staticmethod
        def tool_parser(text, tools):
            return [{"name": c["name"], "arguments": c["arguments"]} for c in json.loads(text)]

    calls = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}]'
    assert split(["Sure. [TOOL_", "CALLS]" + calls], tokenizer=Mistral()) == [
        True,
        Piece("r", "Sure. ", "content"),
        ToolCall("r", 0, "f", "{}"),
        ToolCall("r", 1, "g", '{"b": 2}'),
    ]


def test_a_stream_cut_by_failed_ranks_ends_in_each_dialects_error_event():
    cut = RequestError(502, "the answer was cut: rank 1 of 2 exited", "server_error")
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "input": "x"}
    for endpoint, name, check in [
        (ChatCompletions(), None, lambda p: p["error"]["type"] == "server_error"),
        (Messages(), "error", lambda p: p["error"]["type"] == "api_error"),
        (Responses(), "response.failed", lambda p: p["response"]["status"] == "failed"),
    ]:
        stream = endpoint.events(answer_job(endpoint, body))
        events = [*stream.start(), *stream.piece(Piece("x", "partial")), *stream.fail(cut)]
        last_name, last = events[-1]
        assert last_name == name and check(last) and "rank 1 of 2" in json.dumps(last)


def test_arguments_a_parser_gives_in_python_forms_still_serialize():
    """mlx-lm's parsers that use ast.literal_eval return sets, tuples, bytes and complex
    numbers, and a "\\ud800" in the markup decodes to a lone surrogate: the call still reaches
    the client as valid JSON, nothing dropped."""
    import ast

    class Literal(Tokenizer):
        @staticmethod
        def tool_parser(text, tools):
            return {"name": "f", "arguments": ast.literal_eval(text)}

    markup = "{'s': {1}, 't': (1, 2), 'b': b'x', 'c': 1j, 'n': float('nan'), 'u': '\\ud800'}"
    markup = markup.replace("float('nan')", "1e999")  # literal_eval's inf
    called, call = split([f"<tool_call>{markup}</tool_call>"], tokenizer=Literal())
    assert called and isinstance(call, ToolCall)
    assert json.loads(call.arguments) == {"s": [1], "t": [1, 2], "b": "x", "c": "1j",
                                          "n": sys.float_info.max, "u": "\ufffd"}  # fmt: skip
    call.arguments.encode("utf-8")  # no surrogate left
