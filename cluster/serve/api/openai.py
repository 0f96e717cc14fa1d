"""OpenAI's chat completions and completions (/v1/chat/completions, /v1/completions).

Tool calls come back as ``message.tool_calls`` (``finish_reason: "tool_calls"``) and stream
as ``tool_calls`` deltas; the model's reasoning comes apart from its answer as
``reasoning_content`` (as DeepSeek's API and mlx_lm.server do); ``logprobs`` and
``top_logprobs`` as OpenAI's. ``response_format`` (a JSON schema, any JSON object), a forced
``tool_choice`` and ``strict`` tools are decoded under a grammar on every rank
(cluster.serve.api.constrain). What serve cannot do is refused with the field named: ``n``
above 1.
"""

from __future__ import annotations

from typing import Any

from cluster.core.params import OPENAI, api_fields
from cluster.core.protocol import Piece, ToolCall
from cluster.core.spec import Constraint, Sampling, ServeRequest, Template
from cluster.serve.api import constrain
from cluster.serve.api.shared import (
    MAX_MESSAGES,
    MAX_PARTS,
    SSE_KEEPALIVE,
    Answer,
    ApiRequest,
    Door,
    RequestError,
    assistant_calls,
    call_id,
    check_count,
    check_model,
    check_object,
    error_body,
    function_tool,
    include_usage,
    logit_bias,
    max_tokens,
    number,
    sampling,
    stop_strings,
)

API_SAMPLING = api_fields(Sampling, OPENAI)  # request field -> our setting (core.spec)
MAX_TOP_LOGPROBS = 20


def check_n(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(400, "'n' above 1 is not supported: send n requests (they batch)")


def chat_tools(tools: Any, choice: Any) -> tuple[list | None, Constraint | None]:
    """Chat completions' tools for the template (None when there are none or none may be
    called), and the constraint its tool_choice or strict tools ask for."""
    if tools is None:
        return tool_choice(choice, [], [], "tool_choice")
    if not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list")
    check_count(tools, MAX_PARTS, "tools")
    out, marked = [], []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(400, f"tools[{i}]: only tools of type 'function' are supported")
        if not isinstance(function, dict):
            raise RequestError(400, f"tools[{i}] needs a 'function' object")
        out.append(
            function_tool(
                function.get("name"),
                function.get("description"),
                function.get("parameters"),
                f"tools[{i}]",
            )
        )
        marked.append(function.get("strict") is True)
    return tool_choice(choice, out, marked, "tool_choice")


def tool_choice(choice: Any, tools: list, marked: list[bool],
                name: str) -> tuple[list | None, Constraint | None]:  # fmt: skip
    """The tools the template gets under OpenAI's ``choice`` (auto, none, required, or
    ``{"type": "function", ...}`` naming one: its name under ``function`` in chat, beside
    the type in Responses), and the constraint it asks for."""
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is None or kind == "auto":
        return tools or None, constrain.strict(tools, marked)
    if kind == "none":
        return None, None
    if kind == "required":
        return tools, constrain.forced("required", tools, name)
    if kind == "function" and isinstance(choice, dict):
        inner = choice.get("function")
        called = (inner if isinstance(inner, dict) else choice).get("name")
        if not isinstance(called, str):
            raise RequestError(400, f"'{name}' of type function needs the function's 'name'")
        return tools, constrain.forced(called, tools, name)
    raise RequestError(
        400, f"'{name}' {str(kind)[:40]!r} is not supported (auto, none, required or a function)"
    )


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: 'content' must be a string or a list of parts")
    check_count(content, MAX_PARTS, f"{where}.content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text"):
            raise RequestError(
                400, f"{where}: content parts of type {kind!r} are not supported (text only)"
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def chat_message(m: Any, i: int) -> dict:
    """One OpenAI chat message in the form chat templates take."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(400, f"{where} must be an object with a 'role'")
    role = "system" if m["role"] == "developer" else m["role"]
    out: dict[str, Any] = {"role": role, "content": text_of(m.get("content"), where)}
    if role == "assistant":
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise RequestError(400, f"{where}: 'tool_calls' must be a list")
        check_count(calls, MAX_PARTS, f"{where}.tool_calls")
        triples = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(400, f"{where}: each tool call needs a function and its name")
            triples.append((call.get("id"), function["name"], function.get("arguments", "{}")))
        if triples:
            out["tool_calls"] = assistant_calls(triples, f"{where}.tool_calls")
        if isinstance(m.get("reasoning_content"), str):
            out["reasoning_content"] = m["reasoning_content"]
    elif role == "tool":
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = str(m["tool_call_id"])
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def cache_key(body: dict) -> str | None:
    """``prompt_cache_key``: the prompt cache's entries of this key are where the request
    looks (and what it leaves), so one session's prompts are never found by another's."""
    key = body.get("prompt_cache_key")
    if key is None:
        return None
    if not isinstance(key, str) or len(key) > 256:
        raise RequestError(400, "'prompt_cache_key' must be a string of at most 256 characters")
    return key


def top_logprobs(body: dict, name: str) -> int | None:
    """How many likeliest tokens to return beside each token (0 to MAX_TOP_LOGPROBS)."""
    top = number(body, name, (int,))
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(400, f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}")
    return top


def chat_logprobs(body: dict) -> int | None:
    top = top_logprobs(body, "top_logprobs")
    if not body.get("logprobs"):
        if top:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def template_switches(body: dict) -> dict:
    """reasoning_effort, and chat_template_kwargs' enable_thinking (as vLLM takes it)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError(400, "'chat_template_kwargs' must be an object")
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    thinking = kwargs.get("enable_thinking")
    return {
        "reasoning_effort": effort if isinstance(effort, str) else None,
        "enable_thinking": thinking if isinstance(thinking, bool) else None,
    }


class ChatCompletions:
    def parse(self, body: Any, door: Door) -> ServeRequest:
        body = check_object(body)
        check_model(body, door)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list")
        check_count(messages, MAX_MESSAGES, "messages")
        check_n(body)
        include_usage(body)
        tools, forced = chat_tools(body.get("tools"), body.get("tool_choice"))
        forced = constrain.one_call(forced, body.get("parallel_tool_calls") is False)
        constraint = constrain.only([
            constrain.response_format(body.get("response_format"), "response_format"),
            constrain.extension(body),
            forced,
        ])  # fmt: skip
        chosen = sampling(
            body,
            API_SAMPLING,
            door,
            max_tokens(body, door, "max_completion_tokens", "max_tokens"),
            stop_strings(body.get("stop"), "stop"),
            logit_bias(body.get("logit_bias")),
        )
        return ServeRequest(
            id="",
            kind="chat",
            sampling=chosen,
            template=Template(tools=tools, **template_switches(body)),
            messages=[chat_message(m, i) for i, m in enumerate(messages)],
            seeded=chosen.seed is not None,
            logprobs=chat_logprobs(body),
            constraint=constraint,
            cache_key=cache_key(body),
        )

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        result = answer.result
        message: dict[str, Any] = {
            "role": "assistant",
            "content": answer.content if answer.content or not answer.tool_calls else None,
        }
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [tool_call(req, c) for c in answer.tool_calls]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": answer.logprobs} if req.request.logprobs is not None else None,
            "finish_reason": result["finish_reason"],
        }
        return body_of(req, "chat.completion", [choice], result)

    def events(self, req: ApiRequest) -> ChatStream:
        return ChatStream(req)

    def error_body(self, e: RequestError) -> dict:
        return error_body(e)

    def echo(self, body: dict) -> dict:
        return {"include_usage": include_usage(body)}


def tool_call(req: ApiRequest, call: ToolCall, streaming: bool = False) -> dict:
    out = {
        "id": call_id(call, "call_", req),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return {"index": call.index, **out} if streaming else out


def body_of(req: ApiRequest, obj: str, choices: list, result: dict | None) -> dict:
    body = {
        "id": ("chatcmpl-" if obj.startswith("chat") else "cmpl-") + req.id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": choices,
    }
    if result is not None:
        body["usage"] = result["usage"]
        if "timings" in result:
            body["timings"] = result["timings"]
    return body


class ChatStream:
    done = b"data: [DONE]\n\n"
    keepalive = SSE_KEEPALIVE

    def __init__(self, req: ApiRequest):
        self.req = req

    def chunk(self, delta: dict, finish: str | None = None, logprobs=None) -> tuple:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return None, body_of(self.req, "chat.completion.chunk", [choice], None)

    def start(self):
        yield self.chunk({"role": "assistant", "content": ""})

    def piece(self, piece: Piece):
        if not piece.text and not piece.logprobs:
            return
        key = "reasoning_content" if piece.channel == "reasoning" else "content"
        yield self.chunk(
            {key: piece.text}, logprobs={"content": piece.logprobs} if piece.logprobs else None
        )

    def tool_call(self, call: ToolCall):
        yield self.chunk({"tool_calls": [tool_call(self.req, call, streaming=True)]})

    def end(self, answer: Answer):
        yield self.chunk({}, answer.result["finish_reason"])
        if self.req.echo.get("include_usage"):
            usage = body_of(self.req, "chat.completion.chunk", [], answer.result)
            usage.pop("timings", None)
            yield None, usage

    def fail(self, e: RequestError):
        yield None, error_body(e)


# Completions


def legacy_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The completions endpoint's logprobs shape, from OpenAI chat's entries."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


class Completions:
    def parse(self, body: Any, door: Door) -> ServeRequest:
        body = check_object(body)
        check_model(body, door)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(400, "'prompt' must be a non-empty string")
        check_n(body)
        include_usage(body)
        if body.get("echo"):
            raise RequestError(400, "'echo' is not supported")
        if (body.get("best_of") or 1) != 1:
            raise RequestError(400, "'best_of' above 1 is not supported")
        top = top_logprobs(body, "logprobs")
        chosen = sampling(
            body,
            API_SAMPLING,
            door,
            max_tokens(body, door, "max_tokens"),
            stop_strings(body.get("stop"), "stop"),
            logit_bias(body.get("logit_bias")),
        )
        return ServeRequest(
            id="",
            kind="completion",
            sampling=chosen,
            prompt=prompt,
            seeded=chosen.seed is not None,
            logprobs=top,
            constraint=constrain.only(
                [
                    constrain.response_format(body.get("response_format"), "response_format"),
                    constrain.extension(body),
                ]
            ),  # fmt: skip
            cache_key=cache_key(body),
        )

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        wanted = req.request.logprobs is not None
        choice = {
            "index": 0,
            "text": answer.content,
            "logprobs": legacy_logprobs(answer.logprobs) if wanted else None,
            "finish_reason": answer.result["finish_reason"],
        }
        return body_of(req, "text_completion", [choice], answer.result)

    def events(self, req: ApiRequest) -> CompletionStream:
        return CompletionStream(req)

    def error_body(self, e: RequestError) -> dict:
        return error_body(e)

    def echo(self, body: dict) -> dict:
        return {"include_usage": include_usage(body)}


class CompletionStream:
    done = b"data: [DONE]\n\n"
    keepalive = SSE_KEEPALIVE

    def __init__(self, req: ApiRequest):
        self.req = req
        self.offset = 0

    def chunk(self, text: str, finish: str | None = None, logprobs=None) -> tuple:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return None, body_of(self.req, "text_completion", [choice], None)

    def start(self):
        return ()

    def piece(self, piece: Piece):
        if piece.text or piece.logprobs:
            logprobs = legacy_logprobs(piece.logprobs, self.offset) if piece.logprobs else None
            self.offset += sum(len(e["token"]) for e in piece.logprobs or [])
            yield self.chunk(piece.text, logprobs=logprobs)

    def tool_call(self, call: ToolCall):
        return ()

    def end(self, answer: Answer):
        yield self.chunk("", answer.result["finish_reason"])
        if self.req.echo.get("include_usage"):
            usage = body_of(self.req, "text_completion", [], answer.result)
            usage.pop("timings", None)
            yield None, usage

    def fail(self, e: RequestError):
        yield None, error_body(e)
