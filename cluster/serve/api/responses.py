"""OpenAI's Responses API (/v1/responses), as the OpenResponses specification shapes it.

``input`` (a string, or items: messages, function calls and their outputs; ``developer``
messages are system ones) and ``instructions`` become the chat messages rank 0 renders with the
model's template; function tools become the template's tools (a ``namespace`` tool's functions
among them, each call answered with its namespace); hosted tools a local model cannot run
(``web_search``, ``file_search``, ...) are left out of the prompt, and the response says so in
``notes``. The answer comes back as output items (reasoning, a message, function calls), whole
or as the typed stream events of the API; every response object carries each field the
specification requires, with the values used (the sampling settings, ``truncation``
"disabled": a prompt over the context is refused, never cut). A response is kept (``store``,
true unless the request says false) in serve's bounded store (cluster.serve.api.stored):
``previous_response_id`` continues its conversation, and GET / DELETE ``/v1/responses/{id}``
(and ``/input_items``) read or drop it. ``text.format``, a forced ``tool_choice`` and strict
tools are decoded under a grammar (cluster.serve.api.constrain); ``prompt_cache_key`` scopes
the prompt cache.
"""

from __future__ import annotations

import time
from typing import Any

from cluster.core.params import RESPONSES, api_fields
from cluster.core.protocol import Piece, ToolCall
from cluster.core.spec import Sampling, ServeRequest, Template
from cluster.serve.api import constrain
from cluster.serve.api.openai import cache_key, text_of, tool_choice, top_logprobs
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
    max_tokens,
    sampling,
)
from cluster.serve.api.stored import ChainTooLong, ResponseStore, Stored

API_SAMPLING = api_fields(Sampling, RESPONSES)  # request field -> our setting (core.spec)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ECHOED = ("instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "reasoning", "text", "metadata", "previous_response_id", "max_tool_calls",
          "safety_identifier", "prompt_cache_key", "user")  # fmt: skip


def input_items(body: dict) -> list:
    """``input`` as a list of items (a string is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError(400, "'input' must be a non-empty string or list of items")
    return check_count(items, MAX_MESSAGES, "input")


def input_messages(body: dict, history: list[dict] | None = None) -> list[dict]:
    """``instructions``, the stored conversation (``history``, from previous_response_id)
    and ``input`` as chat messages."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError(400, "'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    return messages + (history or []) + turn_messages(input_items(body))


def turn_messages(items: list) -> list[dict]:
    """Input items as chat messages (consecutive function calls become one assistant message
    with several tool calls)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(400, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(400, f"{where}: 'role' must be user, assistant or system")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise RequestError(400, f"{where}: a function_call needs its 'name'")
            call = (item.get("call_id"), item["name"], item.get("arguments", "{}"))
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"] += assistant_calls([call], where, indexed=False)
            else:
                messages.append(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": assistant_calls([call], where, indexed=False),
                    }
                )
        elif kind == "function_call_output":
            output = item.get("output")
            output = output if isinstance(output, str) else text_of(output, where)
            message = {"role": "tool", "content": output}
            if item.get("call_id") is not None:
                message["tool_call_id"] = str(item["call_id"])
            messages.append(message)
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: templates drop it from the history
        else:
            raise RequestError(400, f"{where}: input items of type {kind!r} are not supported")
    return messages


HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter",
          "computer_use_preview", "computer", "image_generation", "mcp", "local_shell",
          "shell", "apply_patch", "tool_search")  # fmt: skip


def tool_items(tools: Any) -> list[tuple[str, dict, str | None]]:
    """Each function tool as (where, tool, namespace): a ``namespace`` tool's functions
    flattened; hosted tools left out (``dropped`` names them)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list")
    check_count(tools, MAX_PARTS, "tools")
    out: list[tuple[str, dict, str | None]] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append((f"tools[{i}]", tool, None))
        elif kind == "namespace":
            inner = tool.get("tools")
            space = tool.get("name")
            if not isinstance(inner, list) or not isinstance(space, str):
                raise RequestError(400, f"tools[{i}]: a namespace needs its 'name' and 'tools'")
            check_count(inner, MAX_PARTS, f"tools[{i}].tools")
            for j, t in enumerate(inner):
                if not isinstance(t, dict) or t.get("type", "function") != "function":
                    raise RequestError(400, f"tools[{i}].tools[{j}]: functions only")
                out.append((f"tools[{i}].tools[{j}]", t, space))
        elif not (isinstance(kind, str) and kind.startswith(HOSTED)):
            raise RequestError(400, f"tools[{i}]: tools of type {str(kind)[:40]!r} are not "
                                    "supported (function, namespace, and hosted tools, which "
                                    "are left out)")  # fmt: skip
    return out


def dropped(tools: Any) -> list[str]:
    """The hosted tools a request named, which a local model cannot run."""
    if not isinstance(tools, list):
        return []
    return [t["type"] for t in tools if isinstance(t, dict) and t.get("type") not in
            ("function", "namespace") and isinstance(t.get("type"), str)]  # fmt: skip


def response_tools(tools: Any, choice: Any) -> tuple[list | None, constrain.Constraint | None]:
    items = tool_items(tools)
    out = [function_tool(t.get("name"), t.get("description"), t.get("parameters"), where)
           for where, t, _ in items]  # fmt: skip
    marked = [t.get("strict") is True for _, t, _ in items]
    return tool_choice(choice, out, marked, "tool_choice")


class Responses:
    def __init__(self, store: ResponseStore | None = None):
        self.store = store if store is not None else ResponseStore(0, 0)

    def history(self, body: dict) -> list[dict]:
        """The conversation ``previous_response_id`` continues (its instructions not carried
        over, as the specification says), or a 404 naming what is not kept."""
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise RequestError(400, "'previous_response_id' must be a string")
        try:
            return self.store.conversation(previous)
        except ChainTooLong as e:
            raise RequestError(400, f"'previous_response_id': {e}; send the whole "
                                    "conversation in 'input'") from None  # fmt: skip
        except KeyError as e:
            missing = f"response {str(e.args[0])[:100]!r}"
            chain = "" if e.args[0] == previous else f", which {previous[:100]!r} follows,"
            raise RequestError(
                404,
                f"'previous_response_id': {missing}{chain} is not kept by this server: it was "
                "made with store false, deleted, or dropped (serve keeps responses for "
                "--responses-store-hours, in at most --responses-store-mb, until it stops); "
                "send the whole conversation in 'input'",
                "not_found_error",
            ) from None

    def parse(self, body: Any, door: Door) -> ServeRequest:
        body = check_object(body)
        check_model(body, door)
        for name in ("store", "background"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise RequestError(400, f"'{name}' must be a boolean")
        if body.get("background"):
            raise RequestError(400, "'background': true is not supported: this server answers "
                                    "while the connection is open (stream: true for long "
                                    "answers)")  # fmt: skip
        if body.get("truncation", "disabled") not in ("auto", "disabled"):
            raise RequestError(400, "'truncation' must be 'auto' or 'disabled'")
        text = body.get("text") or {}
        if not isinstance(text, dict):
            raise RequestError(400, "'text' must be an object")
        tools, forced = response_tools(body.get("tools"), body.get("tool_choice"))
        forced = constrain.one_call(forced, body.get("parallel_tool_calls") is False)
        constraint = constrain.only([
            constrain.response_format(text.get("format"), "text.format", flat=True),
            constrain.extension(body),
            forced,
        ])  # fmt: skip
        reasoning = body.get("reasoning") or {}
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        include = body.get("include") or []
        top = top_logprobs(body, "top_logprobs")
        wanted = LOGPROBS_INCLUDE in include if isinstance(include, list) else False
        chosen = sampling(body, API_SAMPLING, door, max_tokens(body, door, "max_output_tokens"), [])
        return ServeRequest(
            id="",
            kind="chat",
            sampling=chosen,
            template=Template(
                tools=tools,
                reasoning_effort=effort if isinstance(effort, str) else None,
            ),
            messages=input_messages(body, self.history(body)),
            seeded=chosen.seed is not None,
            logprobs=(top or 0) if wanted or top else None,
            constraint=constraint,
            cache_key=cache_key(body),
        )

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        items = []
        if answer.reasoning:
            items.append(reasoning_item(req, answer.reasoning))
        if answer.content or not answer.tool_calls:
            items.append(message_item(req, answer.content, answer.logprobs))
        items += [function_item(req, c) for c in answer.tool_calls]
        return kept(self.store, req, response_body(req, items, answer.result))

    def events(self, req: ApiRequest) -> ResponseStream:
        return ResponseStream(req, self.store)

    def error_body(self, e: RequestError) -> dict:
        return error_body(e)

    def echo(self, body: dict) -> dict:
        out = {k: body[k] for k in ECHOED if k in body}
        out["store"] = self.store.enabled and body.get("store") is not False
        if out["store"]:  # this turn's items, kept with the answer once it ends
            out["input"] = input_items(body)
        out["namespaces"] = {t.get("name"): space for _, t, space in tool_items(body.get("tools"))
                             if space is not None}  # fmt: skip
        if hosted := dropped(body.get("tools")):
            out["notes"] = [f"hosted tools a local model cannot run were left out: "
                            f"{', '.join(sorted(set(hosted)))}"]  # fmt: skip
        return out


def reasoning_item(req: ApiRequest, text: str, done: bool = True) -> dict:
    return {
        "id": f"rs_{req.id}",
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if done else [],
        "status": "completed" if done else "in_progress",
    }


def output_text(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(req: ApiRequest, text: str, logprobs: list[dict], done: bool = True) -> dict:
    return {
        "id": f"msg_{req.id}",
        "type": "message",
        "role": "assistant",
        "status": "completed" if done else "in_progress",
        "content": [output_text(text, logprobs)] if done else [],
    }


def function_item(req: ApiRequest, call: ToolCall, done: bool = True) -> dict:
    item = {
        "id": f"fc_{req.id}{call.index}",
        "type": "function_call",
        "call_id": call_id(call, "call_", req),
        "name": call.name,
        "arguments": call.arguments if done else "",
        "status": "completed" if done else "in_progress",
    }
    if space := req.echo.get("namespaces", {}).get(call.name):
        item["namespace"] = space
    return item


def echoed_tools(tools: Any) -> list:
    """The request's tools as the response repeats them: a function tool with every field
    the specification requires (``strict`` as it was applied: false unless asked)."""
    out = []
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and tool.get("type") == "function":
            tool = {"type": "function", "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": tool.get("parameters"),
                    "strict": tool.get("strict") is True}  # fmt: skip
        out.append(tool)
    return out


def echoed_reasoning(reasoning: Any) -> dict | None:
    if not isinstance(reasoning, dict):
        return None
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def response_body(req: ApiRequest, output: list[dict], result: dict | None,
                  status: str | None = None) -> dict:  # fmt: skip
    """The response object: in progress (no result yet) or ended (its usage, its status),
    each field the specification requires present, the sampling values those used."""
    body = req.echo
    sampling = req.request.sampling
    incomplete = None
    if result is not None:
        reason = result.get("finish_reason")
        if reason == "length":
            incomplete = {"reason": "max_output_tokens"}
        elif reason == "cancelled":
            incomplete = {"reason": "cancelled"}
        status = status or ("incomplete" if incomplete else "completed")
    text: dict = body["text"] if isinstance(body.get("text"), dict) else {}
    out = {
        "id": f"resp_{req.id}",
        "object": "response",
        "created_at": req.created,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status or "in_progress",
        "incomplete_details": incomplete,
        "model": req.model,
        "previous_response_id": body.get("previous_response_id"),
        "instructions": body.get("instructions"),
        "output": output,
        "error": None,
        "tools": echoed_tools(body.get("tools")),
        "tool_choice": body.get("tool_choice") or "auto",
        "truncation": "disabled",
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "text": {**text, "format": text.get("format") or {"type": "text"}},
        "top_p": sampling.top_p,
        "presence_penalty": sampling.presence_penalty or 0.0,
        "frequency_penalty": sampling.frequency_penalty or 0.0,
        "top_logprobs": req.request.logprobs or 0,
        "temperature": sampling.temp,
        "reasoning": echoed_reasoning(body.get("reasoning")),
        "user": body.get("user"),
        "usage": None,
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "store": bool(body.get("store")),
        "background": False,
        "service_tier": "default",
        "metadata": body.get("metadata") or {},
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
    }
    if body.get("notes"):
        out["notes"] = body["notes"]
    if result is not None and "usage" in result:
        usage = result["usage"]
        out["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
    return out


def kept(store: ResponseStore, req: ApiRequest, body: dict) -> dict:
    """An ended response into the store (when its request asked, and it did not fail)."""
    if not body["store"] or body["status"] not in ("completed", "incomplete"):
        return body
    items = [identified(item, req.id, i) for i, item in enumerate(req.echo["input"])]
    turn = turn_messages(items) + answer_messages(body["output"])
    if not store.put(body["id"], Stored.of(body, items, turn, body["previous_response_id"])):
        body["store"] = False  # larger alone than --responses-store-mb
    return body


def identified(item: Any, rid: str, i: int) -> Any:
    """An input item as GET .../input_items lists it: with an id (and a message's text as
    content parts)."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")
    out = {"id": item.get("id") or f"{INPUT_ID.get(kind, 'item')}_{rid}_{i}", "type": kind,
           **{k: v for k, v in item.items() if k not in ("id", "type")}}  # fmt: skip
    if kind == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    return out


INPUT_ID = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
            "reasoning": "rs"}  # fmt: skip


def answer_messages(output: list[dict]) -> list[dict]:
    """The output items as the chat messages a later turn's template renders: the text
    and the function calls in one assistant message (reasoning left out, as templates
    drop earlier thinking)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item["content"])  # fmt: skip
    calls = [(c["call_id"], c["name"], c["arguments"]) for c in output
             if c["type"] == "function_call"]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = assistant_calls(calls, "output", indexed=True)
    return [message]


class ResponseStream:
    """The typed events, each with its sequence number. The reasoning item and the message
    open when their first text arrives and close before the next item opens."""

    done = b""
    keepalive = SSE_KEEPALIVE

    def __init__(self, req: ApiRequest, store: ResponseStore | None = None):
        self.req = req
        self.store = store if store is not None else ResponseStore(0, 0)
        self.sequence = 0
        self.items: list[dict] = []  # output items done so far
        self.open: str | None = None  # "reasoning" or "message" while one is open
        self.text = ""
        self.logprobs: list[dict] = []

    def event(self, kind: str, **fields) -> tuple[str, dict]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, payload

    def start(self):
        yield self.event("response.created", response=response_body(self.req, [], None))
        yield self.event("response.in_progress", response=response_body(self.req, [], None))

    def opened(self, kind: str):
        """Open an item of ``kind`` (closing another first)."""
        if self.open == kind:
            return
        yield from self.close()
        self.open, self.text, self.logprobs = kind, "", []
        index = len(self.items)
        if kind == "reasoning":
            item = reasoning_item(self.req, "", done=False)
            yield self.event("response.output_item.added", output_index=index, item=item)
        else:
            item = message_item(self.req, "", [], done=False)
            yield self.event("response.output_item.added", output_index=index, item=item)
            yield self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=output_text("", []),
            )

    def close(self):
        index = len(self.items)
        if self.open == "reasoning":
            item = reasoning_item(self.req, self.text)
            yield self.event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=self.text,
            )
        elif self.open == "message":
            item = message_item(self.req, self.text, self.logprobs)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield self.event(
                "response.output_text.done", **where, text=self.text, logprobs=self.logprobs
            )
            yield self.event("response.content_part.done", **where, part=item["content"][0])
        else:
            return
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
        self.open = None

    def piece(self, piece: Piece):
        if not piece.text and not piece.logprobs:
            return
        kind = "reasoning" if piece.channel == "reasoning" else "message"
        yield from self.opened(kind)
        self.text += piece.text
        index = len(self.items)
        if kind == "reasoning":
            yield self.event(
                "response.reasoning_text.delta",
                item_id=f"rs_{self.req.id}",
                output_index=index,
                content_index=0,
                delta=piece.text,
            )
        else:
            self.logprobs += piece.logprobs or []
            yield self.event(
                "response.output_text.delta",
                item_id=f"msg_{self.req.id}",
                output_index=index,
                content_index=0,
                delta=piece.text,
                logprobs=piece.logprobs or [],
            )

    def tool_call(self, call: ToolCall):
        yield from self.close()
        index = len(self.items)
        item = function_item(self.req, call, done=False)
        yield self.event("response.output_item.added", output_index=index, item=item)
        where = {"item_id": item["id"], "output_index": index}
        yield self.event("response.function_call_arguments.delta", **where, delta=call.arguments)
        yield self.event(
            "response.function_call_arguments.done",
            **where,
            name=call.name,
            arguments=call.arguments,
        )
        item = function_item(self.req, call)
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)

    def end(self, answer: Answer):
        if not self.items and self.open is None:  # an empty answer is still a message
            yield from self.opened("message")
        yield from self.close()
        body = kept(self.store, self.req, response_body(self.req, self.items, answer.result))
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=body)

    def fail(self, e: RequestError):
        yield from self.close()
        body = response_body(self.req, self.items, None, status="failed")
        body["error"] = {"code": "server_error", "message": str(e)}
        yield self.event("response.failed", response=body)
