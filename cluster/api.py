"""What `serve`'s API dialects share: the request as it travels (ApiRequest), the answer as
rank 0's events build it (Answer), errors (RequestError) and the checks of a body's fields.

The HTTP server is cluster/apiserver.py. Each of its routes is an endpoint of one API dialect
(cluster/api_openai.py: chat completions and completions; cluster/api_responses.py: OpenAI's
Responses; cluster/api_anthropic.py: Anthropic's Messages). An endpoint turns a body into the
request rank 0 decodes (a cluster.spec.ServeRequest: OpenAI chat messages, tools, sampling)
and rank 0's answer back into its own shapes; everything between is shared.

HTTP threads parse and check a request, hand it to the service and wait on its ``chunks``:
rank 0's events (Piece, ToolCall), then END; or a RequestError (a 4xx from rank 0, a
503 after the restart wait, an error that ends a stream under way); or RESTART, which tells a
non-streaming request that its answer so far is void and will be decoded again.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .protocol import Piece, ToolCall
from .spec import Sampling, ServeRequest

DEFAULT_MAX_TOKENS = 512
END = object()  # the answer is complete (its stats are in ApiRequest.result)
RESTART = object()  # the ranks restarted: a non-streaming answer starts again


class RequestError(ValueError):
    """A request the API refuses: HTTP status, error type (OpenAI's names; each dialect maps
    them to its own) and message."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.retry_after = status, kind, retry_after


SSE = tuple[str | None, dict]  # (event name or None, payload): one server-sent event


class Endpoint(Protocol):
    """One route's dialect."""

    def parse(self, body: Any, model_ids: set[str]) -> ServeRequest:
        """The request rank 0 decodes, or RequestError (the field named)."""

    def reply(self, job: ApiRequest, answer: Answer) -> dict:
        """The whole answer as one JSON body."""

    def events(self, job: ApiRequest) -> Stream:
        """A stream's events, one answer's worth."""

    def error_body(self, e: RequestError) -> dict: ...


class Stream(Protocol):
    done: bytes  # what ends the stream after the last event (b"" for none)

    def start(self) -> Iterable[SSE]: ...

    def piece(self, piece: Piece) -> Iterable[SSE]: ...

    def tool_call(self, call: ToolCall) -> Iterable[SSE]: ...

    def end(self, answer: Answer) -> Iterable[SSE]: ...

    def fail(self, e: RequestError) -> Iterable[SSE]: ...


@dataclass
class Answer:
    """An answer as rank 0's events built it: content, reasoning, tool calls, logprobs."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    result: dict = field(default_factory=dict)  # finish_reason, usage, timings, stop_sequence

    def add(self, item) -> None:
        if isinstance(item, Piece):
            if item.channel == "reasoning":
                self.reasoning += item.text
            else:
                self.content += item.text
            self.logprobs += item.logprobs or []
        elif isinstance(item, ToolCall):
            self.tool_calls.append(item)


@dataclass
class ApiRequest:
    endpoint: Endpoint
    request: ServeRequest  # what rank 0 gets (its id is set from ours)
    stream: bool
    model: str  # the id answers name
    body: dict = field(default_factory=dict)
    chunks: queue.Queue = field(default_factory=queue.Queue)  # events, then END (see above)
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)
    result: dict | None = None  # the answer's stats, set before END
    status: int | None = None  # how it ended, for /metrics (None while under way)

    def to_rank0(self) -> ServeRequest:
        return dataclasses.replace(self.request, id=self.id)


def call_id(call: ToolCall, prefix: str, job: ApiRequest) -> str:
    """A tool call's id: the model's, else one made from the request's id and its index."""
    return call.id or f"{prefix}{job.id}{call.index}"


# Checks and conversions every dialect uses


def check_model(body: dict, model_ids: set[str]) -> None:
    model = body.get("model")
    if model is not None and model not in model_ids:
        served = ", ".join(sorted(model_ids))
        raise RequestError(
            404,
            f"model {model!r} is not served here (this server serves {served}); "
            "GET /v1/models lists it",
            "not_found_error",
        )


def check_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def number(body: dict, name: str, types: tuple = (int, float)) -> Any:
    """body[name] if it is a number of ``types`` (None if absent), else a 400."""
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
        kind = "an integer" if types == (int,) else "a number"
        raise RequestError(400, f"'{name}' must be {kind}")
    return value


def positive(body: dict, *names: str) -> int | None:
    """The first of ``names`` present, a positive integer (None if none is)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(400, f"'{name}' must be a positive integer")
        return value
    return None


def stop_strings(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return list(value)
    raise RequestError(400, f"'{name}' must be a string or a list of strings")


def sampling(body: dict, fields: dict[str, tuple[str, tuple]], max_tokens: int | None,
             stop: list[str]) -> Sampling:  # fmt: skip
    """The Sampling of a body: ``fields`` maps the dialect's names to ours and their types."""
    chosen = {
        ours: value
        for name, (ours, types) in fields.items()
        if (value := number(body, name, types)) is not None
    }
    return Sampling(max_tokens=max_tokens or DEFAULT_MAX_TOKENS, stop=stop, **chosen)


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict:
    """One tool in the form chat templates take (OpenAI chat's)."""
    if not isinstance(name, str) or not name:
        raise RequestError(400, f"{where}: a tool needs a 'name'")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(400, f"{where}: a tool's parameters must be a JSON schema object")
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def arguments_object(arguments: Any) -> Any:
    """A tool call's arguments as templates render them: the object, not its JSON text (as
    mlx_lm.server passes them); text that is not JSON stays as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def assistant_calls(calls: list[tuple[str, str, Any]]) -> list[dict]:
    """(id, name, arguments) into the assistant message's ``tool_calls``."""
    return [
        {
            "id": cid,
            "type": "function",
            "function": {"name": name, "arguments": arguments_object(arguments)},
        }
        for cid, name, arguments in calls
    ]


def error_body(e: RequestError) -> dict:
    """OpenAI's error shape (chat completions, completions, Responses, and the shared
    routes)."""
    return {"error": {"message": str(e), "type": e.kind, "param": None, "code": None}}
