"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens).

``system``, the messages' content blocks (text, ``tool_use``, ``tool_result``) and the tools'
``input_schema`` become OpenAI-style chat messages and tools, which rank 0 renders with the
model's template; the answer comes back as content blocks (``thinking``, ``text``,
``tool_use``) with Anthropic's stop reasons, whole or as its stream events. Errors have
Anthropic's shape. The key is ``--api-key``, sent as ``x-api-key`` (or a bearer token).

What Claude Code sends is taken: ``system`` messages inside ``messages`` (its environment
block), kept in their place; ``thinking`` (``enabled``, ``adaptive``, ``disabled``: the
template's thinking switch); ``output_config.effort`` (the template's reasoning effort) and
``output_config.format`` (a JSON schema the answer follows, as ``output_format`` in the beta);
``context_management`` (its edits clear old thinking and tool results server-side; none is
applied here, and the answer says so); ``metadata``; ``anthropic-beta`` flags and
``?beta=true``. The billing line Claude Code puts first in ``system``
(``x-anthropic-billing-header: ...; cch=...;``, new every request) is dropped wherever it
appears, so consecutive turns share their prompt's start in the prompt cache. Server tools
(``web_search_...``, ``code_execution_...``) are left out, and the answer says so in
``notes``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from cluster.core.params import ANTHROPIC, api_fields
from cluster.core.protocol import Piece, ToolCall
from cluster.core.spec import Constraint, Sampling, ServeRequest, Template
from cluster.serve.api import constrain
from cluster.serve.api.shared import (
    MAX_MESSAGES,
    MAX_PARTS,
    Answer,
    ApiRequest,
    Door,
    RequestError,
    assistant_calls,
    call_id,
    check_count,
    check_model,
    check_object,
    function_tool,
    max_tokens,
    sampling,
    stop_strings,
)

API_SAMPLING = api_fields(Sampling, ANTHROPIC)  # request field -> our setting (core.spec)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
BILLING = "x-anthropic-billing-header:"  # Claude Code's first system block, new every request


def without_billing(text: str) -> str:
    """``text`` without Claude Code's billing line (a block of its own, or a line of one)."""
    if BILLING not in text:
        return text
    return "\n".join(x for x in text.split("\n") if not x.lstrip().startswith(BILLING))


def text_blocks(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as text."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: content must be a string or a list of blocks")
    check_count(content, MAX_PARTS, f"{where}.content")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise RequestError(400, f"{where}: blocks of type {kind!r} are not supported here")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def system_text(content: Any, where: str) -> str:
    """A system prompt (a string or text blocks) without the billing line: a block that is
    only that line goes whole."""
    if isinstance(content, list):
        content = [b for b in content if not (isinstance(b, dict) and
                   str(b.get("text", "")).lstrip().startswith(BILLING))]  # fmt: skip
    return without_billing(text_blocks(content, where))


def chat_messages(body: dict) -> list[dict]:
    """``system`` and ``messages`` as OpenAI chat messages: tool_use blocks become the
    assistant's tool_calls, tool_result blocks become tool messages, a system message stays
    where it is (rank 0 folds it into the first when the template takes none there)."""
    out: list[dict] = []
    if body.get("system") is not None:
        system = system_text(body["system"], "system")
        if system:
            out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: must be a non-empty list")
    check_count(messages, MAX_MESSAGES, "messages")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise RequestError(400, f"{where}: 'role' must be user, assistant or system")
        if m["role"] == "system":
            out.append({"role": "system", "content": system_text(m.get("content"), where)})
            continue
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(400, f"{where}: content must be a string or a list of blocks")
        check_count(content, MAX_PARTS, f"{where}.content")
        texts, calls, thinking, results = [], [], "", 0
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            here = f"{where}.content.{j}"
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("name"), str):
                    raise RequestError(400, f"{here}: tool_use needs its 'name'")
                calls.append((block.get("id"), block["name"], block.get("input") or {}))
            elif kind == "tool_result" and m["role"] == "user":
                result = text_blocks(block.get("content"), here)
                if block.get("is_error"):
                    result = f"Error: {result}"
                answer = {"role": "tool", "content": result}
                if block.get("tool_use_id") is not None:
                    answer["tool_call_id"] = str(block["tool_use_id"])
                out.append(answer)
                results += 1
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                thinking += str(block.get("thinking", ""))
            else:
                raise RequestError(
                    400, f"{here}: blocks of type {kind!r} are not supported in a {m['role']} turn"
                )
        if texts or calls or not results:
            message: dict[str, Any] = {"role": m["role"], "content": "".join(texts)}
            if calls:
                message["tool_calls"] = assistant_calls(calls)
            if thinking:
                message["reasoning_content"] = thinking
            out.append(message)
    return out


def anthropic_tools(tools: Any, choice: Any) -> tuple[list | None, Constraint | None]:
    """Client tools for the template (server tools are left out: ``server_tools`` names
    them), and the constraint the tool choice or strict tools ask for."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise RequestError(400, "tools: must be a list")
    check_count(tools, MAX_PARTS, "tools")
    out, marked = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(400, f"tools.{i}: must be an object")
        if tool.get("type", "custom") != "custom":
            continue  # a server tool: Anthropic runs it, a local model cannot
        out.append(
            function_tool(
                tool.get("name"), tool.get("description"), tool.get("input_schema"), f"tools.{i}"
            )
        )
        marked.append(tool.get("strict") is True)
    return tool_choice(choice, out, marked)


def server_tools(tools: Any) -> list[str]:
    if not isinstance(tools, list):
        return []
    return [str(t.get("name") or t["type"]) for t in tools
            if isinstance(t, dict) and t.get("type", "custom") != "custom"]  # fmt: skip


def tool_choice(choice: Any, tools: list, marked: list[bool]) -> tuple:
    """Anthropic's ``tool_choice``: auto, none, any (some tool), tool (that one)."""
    if choice is None:
        return tools or None, constrain.strict(tools, marked)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return tools or None, constrain.strict(tools, marked)
    if kind == "none":
        return None, None
    if kind == "any":
        return tools, constrain.forced("required", tools, "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise RequestError(400, "tool_choice: a choice of type tool needs the tool's 'name'")
        return tools, constrain.forced(name, tools, "tool_choice")
    raise RequestError(400, "tool_choice: 'type' must be auto, any, tool or none")


def output_constraint(body: dict) -> Constraint | None:
    """``output_config.format`` (and the beta's ``output_format``): a JSON schema."""
    found = []
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError(400, "output_config: must be an object")
    for name, value in (("output_config.format", (config or {}).get("format")),
                        ("output_format", body.get("output_format"))):  # fmt: skip
        if value is None:
            continue
        if not isinstance(value, dict) or value.get("type") != "json_schema":
            raise RequestError(400, f"{name}: the type must be json_schema")
        if "schema" not in value:
            raise RequestError(400, f"{name}.schema: Field required")
        found.append(constrain.built(constrain.grammar.json_schema, value["schema"],
                                     f"{name}.schema"))  # fmt: skip
    return constrain.only(found)


def effort(body: dict) -> str | None:
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError(400, "output_config: must be an object")
    value = (config or {}).get("effort")
    if value is not None and not isinstance(value, str):
        raise RequestError(400, "output_config.effort: must be a string")
    return value


def thinking_switch(body: dict) -> bool | None:
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    return {"enabled": True, "adaptive": True, "disabled": False}.get(str(kind))


def error_body(e: RequestError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


def usage_of(result: dict) -> dict:
    usage = result.get("usage") or {}
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0) - cached,
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(result: dict) -> str:
    if result.get("stop_sequence"):
        return "stop_sequence"
    return STOP_REASONS.get(str(result.get("finish_reason")), "end_turn")


def tool_input(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {"arguments": call.arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class Messages:
    def parse(self, body: Any, door: Door) -> ServeRequest:
        body = check_object(body)
        check_model(body, door)
        most = max_tokens(body, door, "max_tokens")
        if most is None:
            raise RequestError(400, "max_tokens: Field required")
        tools, forced = anthropic_tools(body.get("tools"), body.get("tool_choice"))
        choice = body.get("tool_choice")
        single = isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True
        forced = constrain.one_call(forced, single)
        constraint = constrain.only([output_constraint(body), constrain.extension(body), forced])
        return ServeRequest(
            id="",
            kind="chat",
            sampling=sampling(
                body,
                API_SAMPLING,
                door,
                most,
                stop_strings(body.get("stop_sequences"), "stop_sequences"),
            ),
            template=Template(
                tools=tools, enable_thinking=thinking_switch(body), reasoning_effort=effort(body)
            ),
            messages=chat_messages(body),
            constraint=constraint,
        )

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        content: list[dict] = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.content or not answer.tool_calls:
            content.append({"type": "text", "text": answer.content})
        for call in answer.tool_calls:
            content.append(tool_use(req, call))
        return message_body(req, content, answer.result)

    def events(self, req: ApiRequest) -> MessageStream:
        return MessageStream(req)

    def error_body(self, e: RequestError) -> dict:
        return error_body(e)

    def echo(self, body: dict) -> dict:
        out: dict = {}
        if dropped := server_tools(body.get("tools")):
            out["notes"] = ["server tools a local model cannot run were left out: "
                            + ", ".join(sorted(set(dropped)))]  # fmt: skip
        if body.get("context_management") is not None:
            out["context_management"] = {"applied_edits": []}
        return out


def tool_use(req: ApiRequest, call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": call_id(call, "toolu_", req),
        "name": call.name,
        "input": tool_input(call),
    }


def message_body(req: ApiRequest, content: list[dict], result: dict | None) -> dict:
    body = {
        "id": f"msg_{req.id}",
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop_reason(result) if result else None,
        "stop_sequence": (result or {}).get("stop_sequence"),
        "usage": usage_of(result or {}),
    }
    for key in ("context_management", "notes"):
        if key in req.echo:
            body[key] = req.echo[key]
    return body


class MessageStream:
    """message_start, a content block per part (thinking, text, each tool_use), message_delta
    with the stop reason and usage, message_stop."""

    done = b""
    keepalive = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's own

    def __init__(self, req: ApiRequest):
        self.req = req
        self.index = -1
        self.open: str | None = None  # "thinking" or "text" while such a block is open

    def start(self):
        """message_start, with the prompt's token counts as Anthropic's stream has them there
        (rank 0 said them as the request joined: before its first token)."""
        message = message_body(self.req, [], None)
        if self.req.admitted is not None:
            prompt, cached = self.req.admitted
            message["usage"] = {**message["usage"], "input_tokens": prompt - cached,
                                "cache_read_input_tokens": cached}  # fmt: skip
        yield "message_start", {"type": "message_start", "message": message}

    def opened(self, kind: str):
        if self.open == kind:
            return
        yield from self.close()
        self.index += 1
        self.open = kind
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": self.index,
                "content_block": block,
            },
        )

    def close(self):
        if self.open is None:
            return
        if self.open == "thinking":
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "signature_delta", "signature": ""},
                },
            )
        yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
        self.open = None

    def piece(self, piece: Piece):
        if not piece.text:
            return
        thinking = piece.channel == "reasoning"
        yield from self.opened("thinking" if thinking else "text")
        delta = (
            {"type": "thinking_delta", "thinking": piece.text}
            if thinking
            else {"type": "text_delta", "text": piece.text}
        )
        yield (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": delta,
            },
        )

    def tool_call(self, call: ToolCall):
        yield from self.close()
        self.index += 1
        block = {**tool_use(self.req, call), "input": {}}
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": self.index,
                "content_block": block,
            },
        )
        yield (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(tool_input(call))},
            },
        )
        yield "content_block_stop", {"type": "content_block_stop", "index": self.index}

    def end(self, answer: Answer):
        if self.index < 0:  # an empty answer is still a text block
            yield from self.opened("text")
        yield from self.close()
        result = answer.result
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(result),
                    "stop_sequence": result.get("stop_sequence"),
                },
                "usage": usage_of(result),
            },
        )
        yield "message_stop", {"type": "message_stop"}

    def fail(self, e: RequestError):
        yield "error", error_body(e)


class CountTokens:
    """/v1/messages/count_tokens: the prompt as the template renders it, counted on rank 0."""

    def parse(self, body: Any, door: Door) -> ServeRequest:
        """Checked as Messages checks the same body (every field it reads, the schemas too),
        less ``max_tokens``, which counting does not need."""
        body = check_object(body)
        checked = Messages().parse({**body, "max_tokens": 1}, door)
        return dataclasses.replace(
            checked, kind="count", sampling=Sampling(max_tokens=1), constraint=None
        )

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        return {"input_tokens": answer.result["prompt_tokens"]}

    def events(self, req: ApiRequest):
        raise AssertionError("count_tokens does not stream")

    def error_body(self, e: RequestError) -> dict:
        return error_body(e)

    def echo(self, body: dict) -> dict:
        return {}
