"""`serve`'s HTTP API, in the launcher's process: it stays up while the ranks restart
(cluster/serving.py runs them and routes each request to rank 0 and back).

Each route is an endpoint of one API dialect (cluster/api_openai.py: chat completions and
completions; cluster/api_responses.py: OpenAI's Responses; cluster/api_anthropic.py:
Anthropic's Messages). An endpoint turns a body into the request rank 0 decodes (a
cluster.spec.ServeRequest: OpenAI chat messages, tools, sampling) and rank 0's answer back into
its own shapes; everything between is shared.

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
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from .protocol import Piece, ToolCall
from .spec import Sampling, ServeRequest

MAX_BODY_BYTES = 4 * 1024 * 1024
DRAINED_BODY_BYTES = 64 * 1024 * 1024  # an over-size body up to this is read, then refused;
# a larger one is refused without reading it
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


class Api:
    """The HTTP server. ``service`` (cluster.serving.Service) takes requests (``submit``),
    drops those whose client left (``cancel``), and answers /health and /metrics."""

    def __init__(self, host: str, port: int, api_key: str | None, service):
        from .api_anthropic import CountTokens, Messages
        from .api_openai import ChatCompletions, Completions
        from .api_responses import Responses

        self.api_key = api_key
        self.service = service
        self.routes: dict[str, Endpoint] = {
            "/v1/chat/completions": ChatCompletions(),
            "/v1/completions": Completions(),
            "/v1/responses": Responses(),
            "/v1/messages": Messages(),
            "/v1/messages/count_tokens": CountTokens(),
        }
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - stderr is for our own lines
                pass

            def do_GET(self):
                if not api.authorized(self, None):
                    return
                path = self.path.split("?")[0].rstrip("/")
                if path == "/v1/models":
                    data = [
                        {
                            "id": service.model_id,
                            "object": "model",
                            "owned_by": "mlx-cluster",
                            "created": 0,
                            "type": "model",  # Anthropic's /v1/models fields
                            "display_name": service.model_id,
                            "created_at": "1970-01-01T00:00:00Z",
                        }
                    ]
                    self.reply(200, {"object": "list", "data": data, "has_more": False})
                elif path == "/health":
                    health = service.health()
                    ok = health["status"] in ("ok", "degraded")
                    self.reply(200 if ok else 503, health)
                elif path == "/metrics":
                    self.send_bytes(200, service.metrics.exposition(), service.metrics.content_type)
                else:
                    self.error(RequestError(404, f"no route {self.path}", "not_found_error"))

            def do_POST(self):
                endpoint = api.routes.get(self.path.split("?")[0].rstrip("/"))
                if not api.authorized(self, endpoint):
                    return
                try:
                    if endpoint is None:
                        raise RequestError(404, f"no route {self.path}", "not_found_error")
                    body = self.read_json()
                    request = endpoint.parse(body, service.model_ids())
                except RequestError as e:
                    service.metrics.finished(e.status)
                    return self.error(e, endpoint)
                stream = bool(body.get("stream")) and request.kind != "count"
                job = ApiRequest(endpoint, request, stream, service.model_id, body)
                service.submit(job)
                if job.stream:
                    self.stream(job)
                else:
                    self.collect(job)

            def read_json(self):
                try:
                    size = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    raise RequestError(400, "bad Content-Length") from None
                if size > MAX_BODY_BYTES:
                    self.close_connection = True
                    if size <= DRAINED_BODY_BYTES:  # read it, so the client is not cut off mid-send
                        while size > 0:
                            size -= len(self.rfile.read(min(size, 1 << 20)) or b"x" * size)
                    raise RequestError(413, f"the body is over {MAX_BODY_BYTES} bytes")
                try:
                    return json.loads(self.rfile.read(size) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise RequestError(400, f"the body is not valid JSON: {e}") from None

            def send_bytes(self, status: int, data: bytes, content_type: str, headers=()):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def reply(self, status: int, payload: dict, headers=()) -> None:
                self.send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

            def error(self, e: RequestError, endpoint: Endpoint | None = None) -> None:
                headers = [("Retry-After", str(e.retry_after))] if e.retry_after else []
                shape = endpoint.error_body if endpoint is not None else error_body
                self.reply(e.status, shape(e), headers)

            def collect(self, job: ApiRequest) -> None:
                answer = Answer()
                try:
                    while (item := job.chunks.get()) is not END:
                        if isinstance(item, RequestError):
                            return self.error(item, job.endpoint)
                        if item is RESTART:
                            answer = Answer()
                        else:
                            answer.add(item)
                    answer.result = job.result or {}
                    self.reply(200, job.endpoint.reply(job, answer))
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    service.cancel(job)

            def stream(self, job: ApiRequest) -> None:
                item = job.chunks.get()
                while item is RESTART:  # nothing was sent yet: wait for the new answer
                    item = job.chunks.get()
                if isinstance(item, RequestError):
                    return self.error(item, job.endpoint)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                events = job.endpoint.events(job)
                answer = Answer()
                try:
                    self.send_events(events.start())
                    while item is not END:
                        if isinstance(item, RequestError):  # the ranks failed mid-answer
                            self.send_events(events.fail(item))
                            break
                        answer.add(item)
                        if isinstance(item, Piece):
                            self.send_events(events.piece(item))
                        elif isinstance(item, ToolCall):
                            self.send_events(events.tool_call(item))
                        item = job.chunks.get()
                    else:
                        answer.result = job.result or {}
                        self.send_events(events.end(answer))
                    self.wfile.write(events.done)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    service.cancel(job)

            def send_events(self, events: Iterable[SSE]) -> None:
                for name, payload in events:
                    head = f"event: {name}\n".encode() if name else b""
                    self.wfile.write(head + b"data: " + json.dumps(payload).encode() + b"\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="http")

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, handler, endpoint: Endpoint | None) -> bool:
        """``--api-key`` as OpenAI's clients send it (Authorization: Bearer) or Anthropic's
        (x-api-key)."""
        if self.api_key is None:
            return True
        bearer = handler.headers.get("Authorization", "")
        key = handler.headers.get("x-api-key", "")
        if secrets.compare_digest(bearer, f"Bearer {self.api_key}") or secrets.compare_digest(
            key, self.api_key
        ):
            return True
        self.service.metrics.finished(401)
        handler.error(
            RequestError(401, "missing or wrong API key", "authentication_error"), endpoint
        )
        return False
