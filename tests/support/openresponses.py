"""What the OpenResponses specification (version 2026-04-24, https://www.openresponses.org,
its OpenAPI document's components) requires of a response object and of the streamed
events this server sends, as JSON Schemas for ``jsonschema``: every required field, its
type, and its nullability as the specification states them. Written out here because the
tests run offline; each name below is the specification's component name.

``check(obj, name)`` raises jsonschema's ValidationError naming the field at fault."""

from __future__ import annotations

from typing import Any

import jsonschema


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict:
    return {"type": "object", "required": list(required),
            "properties": {**required, **(optional or {})}}  # fmt: skip


def const(value: str) -> dict:
    return {"type": "string", "enum": [value]}


STRING, INTEGER, NUMBER, BOOLEAN = ({"type": t} for t in ("string", "integer", "number", "boolean"))
ARRAY = {"type": "array"}

TopLogProb = obj({"token": STRING, "logprob": NUMBER, "bytes": {"type": "array",
                  "items": INTEGER}})  # fmt: skip
LogProb = obj({**TopLogProb["properties"], "top_logprobs": {"type": "array", "items": TopLogProb}})
OutputTextContent = obj(
    {"type": const("output_text"), "text": STRING, "annotations": ARRAY},
    {"logprobs": {"type": "array", "items": LogProb}},
)
ReasoningTextContent = obj({"type": const("reasoning_text"), "text": STRING})
MessageStatus = {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}
Message = obj({
    "type": const("message"), "id": STRING, "status": MessageStatus,
    "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
    "content": {"type": "array", "items": {"anyOf": [OutputTextContent, ReasoningTextContent]}},
})  # fmt: skip
FunctionCall = obj({"type": const("function_call"), "id": STRING, "call_id": STRING,
                    "name": STRING, "arguments": STRING, "status": MessageStatus})  # fmt: skip
ReasoningBody = obj({"type": const("reasoning"), "id": STRING, "summary": ARRAY},
                    {"content": {"type": "array", "items": ReasoningTextContent}})  # fmt: skip
ItemField = {"oneOf": [Message, FunctionCall, ReasoningBody]}
Usage = obj({
    "input_tokens": INTEGER, "output_tokens": INTEGER, "total_tokens": INTEGER,
    "input_tokens_details": obj({"cached_tokens": INTEGER}),
    "output_tokens_details": obj({"reasoning_tokens": INTEGER}),
})  # fmt: skip
FunctionTool = obj({"type": const("function"), "name": STRING,
                    "description": nullable(STRING), "parameters": nullable({"type": "object"}),
                    "strict": nullable(BOOLEAN)})  # fmt: skip
ToolChoice = {"anyOf": [
    {"type": "string", "enum": ["none", "auto", "required"]},
    obj({"type": const("function")}, {"name": STRING}),
    obj({"type": const("allowed_tools"), "tools": ARRAY, "mode": STRING}),
]}  # fmt: skip
Reasoning = obj({"effort": nullable(STRING), "summary": nullable(STRING)})
TextField = obj({"format": {"type": "object", "required": ["type"]}})

ResponseResource = obj({
    "id": STRING, "object": const("response"), "created_at": INTEGER,
    "completed_at": nullable(INTEGER), "status": STRING,
    "incomplete_details": nullable(obj({"reason": STRING})), "model": STRING,
    "previous_response_id": nullable(STRING), "instructions": nullable(STRING),
    "output": {"type": "array", "items": ItemField}, "error": nullable(obj({"code": STRING,
    "message": STRING})), "tools": {"type": "array", "items": FunctionTool},
    "tool_choice": ToolChoice, "truncation": {"type": "string", "enum": ["auto", "disabled"]},
    "parallel_tool_calls": BOOLEAN, "text": TextField, "top_p": NUMBER,
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "top_logprobs": INTEGER,
    "temperature": NUMBER, "reasoning": nullable(Reasoning), "usage": nullable(Usage),
    "max_output_tokens": nullable(INTEGER), "max_tool_calls": nullable(INTEGER),
    "store": BOOLEAN, "background": BOOLEAN, "service_tier": STRING, "metadata": {},
    "safety_identifier": nullable(STRING), "prompt_cache_key": nullable(STRING),
})  # fmt: skip

EVENT = {"type": STRING, "sequence_number": INTEGER}
WHERE = {"item_id": STRING, "output_index": INTEGER}
PART = {**WHERE, "content_index": INTEGER}
EVENTS = {  # the streamed events this server sends, by type
    **{kind: obj({**EVENT, "response": ResponseResource}) for kind in (
        "response.created", "response.in_progress", "response.completed",
        "response.incomplete", "response.failed")},
    **{kind: obj({**EVENT, "output_index": INTEGER, "item": nullable(ItemField)}) for kind in (
        "response.output_item.added", "response.output_item.done")},
    **{kind: obj({**EVENT, **PART, "part": {"oneOf": [OutputTextContent,
                  ReasoningTextContent]}}) for kind in (
        "response.content_part.added", "response.content_part.done")},
    "response.output_text.delta": obj({**EVENT, **PART, "delta": STRING},
                                      {"logprobs": {"type": "array", "items": LogProb}}),
    "response.output_text.done": obj({**EVENT, **PART, "text": STRING},
                                     {"logprobs": {"type": "array", "items": LogProb}}),
    # OpenAI's names for reasoning text (the specification says response.reasoning.*,
    # the official SDKs and Codex read these): the same fields
    "response.reasoning_text.delta": obj({**EVENT, **PART, "delta": STRING}),
    "response.reasoning_text.done": obj({**EVENT, **PART, "text": STRING}),
    "response.function_call_arguments.delta": obj({**EVENT, **WHERE, "delta": STRING}),
    "response.function_call_arguments.done": obj({**EVENT, **WHERE, "arguments": STRING}),
    "error": obj({**EVENT, "error": obj({"type": STRING, "code": nullable(STRING),
                  "message": STRING, "param": nullable(STRING)})}),
}  # fmt: skip


def check(value: Any, schema: dict) -> None:
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)


def check_event(event: dict) -> None:
    assert event.get("type") in EVENTS, f"an event the specification has not: {event}"
    check(event, EVENTS[event["type"]])
