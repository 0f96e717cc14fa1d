"""`serve`'s OpenAI-compatible HTTP API, in the launcher's process: it stays up while the ranks
restart (cluster/serving.py runs them and routes each request to rank 0 and back).

HTTP threads parse and check a request, hand it to the service and wait on its ``chunks``: text
pieces, then END; or a RequestError (a 4xx from rank 0, a 503 after the restart wait, an error
that ends a stream under way); or RESTART, which tells a non-streaming request that its answer
so far is void and will be decoded again.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .spec import Sampling, ServeRequest, Template

MAX_BODY_BYTES = 4 * 1024 * 1024
DRAINED_BODY_BYTES = 64 * 1024 * 1024  # an over-size body up to this is read, then refused;
# a larger one is refused without reading it
SAMPLING_FIELDS = {  # OpenAI field -> (our setting, accepted types)
    "temperature": ("temp", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", (int,)),
    "min_p": ("min_p", (int, float)),
    "seed": ("seed", (int,)),
    "presence_penalty": ("presence_penalty", (int, float)),
    "frequency_penalty": ("frequency_penalty", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
}
DEFAULT_MAX_TOKENS = 512
END = object()  # the answer is complete (its stats are in ApiRequest.result)
RESTART = object()  # the ranks restarted: a non-streaming answer starts again


class RequestError(ValueError):
    """A request the API refuses: HTTP status, OpenAI error type and message."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.retry_after = status, kind, retry_after


@dataclass
class ApiRequest:
    kind: str  # "chat" or "completion"
    body: dict
    stream: bool
    model: str  # the id answers name
    chunks: queue.Queue = field(default_factory=queue.Queue)  # text, then END (see above)
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)
    result: dict | None = None  # the answer's stats, set before END
    status: int | None = None  # how it ended, for /metrics (None while under way)

    def to_rank0(self) -> ServeRequest:
        """What rank 0 needs of it: the prompt or messages, the sampling, the template."""
        body = self.body
        messages = [
            {"role": m["role"], "content": _text(m.get("content"))}
            for m in body.get("messages") or []
        ]
        return ServeRequest(
            id=self.id,
            kind=self.kind,
            sampling=request_sampling(body),
            template=Template(tools=body.get("tools") or None),
            messages=messages,
            prompt=body.get("prompt") or "",
            seeded=body.get("seed") is not None,
        )


def check_body(kind: str, body: Any, model_ids: set[str]) -> None:
    """Refuse what we cannot serve, with the field named (OpenAI-style 400/404)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model not in model_ids:
        raise RequestError(
            404, f"model {model!r} is not served here; GET /v1/models lists it", "not_found_error"
        )
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(400, "each message must be an object with a 'role'")
            if not isinstance(m.get("content", ""), (str, list, type(None))):
                raise RequestError(400, "a message's 'content' must be a string or a list")
    else:
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            raise RequestError(400, "'prompt' must be a non-empty string")
    for name, (_, types) in SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise RequestError(400, f"'{name}' must be a number")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise RequestError(400, "'max_tokens' must be a positive integer")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise RequestError(400, "'stop' must be a string or a list of strings")
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise RequestError(400, "'tools' must be a list")


def request_sampling(body: dict) -> Sampling:
    """The Sampling of an OpenAI request body (checked by check_body)."""
    chosen: dict[str, Any] = {
        ours: body[name]
        for name, (ours, _) in SAMPLING_FIELDS.items()
        if body.get(name) is not None
    }
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    stop = body.get("stop")
    return Sampling(
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        **chosen,
    )


def _text(content) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def completion_body(job: ApiRequest, text: str, result: dict) -> dict:
    if job.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": result["finish_reason"],
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": result["finish_reason"]}
        obj = "text_completion"
    return {
        "id": ("chatcmpl-" if job.kind == "chat" else "cmpl-") + job.id,
        "object": obj,
        "created": job.created,
        "model": job.model,
        "choices": [choice],
        "usage": result["usage"],
        "timings": result["timings"],
    }


def chunk_body(
    job: ApiRequest, delta, finish: str | None = None, usage: dict | None = None
) -> dict:
    if job.kind == "chat":
        if isinstance(delta, str):
            delta = {"content": delta}
        choices = [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
        obj = "chat.completion.chunk"
    else:
        choices = [] if usage else [{"index": 0, "text": delta or "", "finish_reason": finish}]
        obj = "text_completion"
    body = {
        "id": ("chatcmpl-" if job.kind == "chat" else "cmpl-") + job.id,
        "object": obj,
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if usage:
        body["usage"] = usage
    return body


def error_body(e: RequestError) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "code": None}}


class Api:
    """The HTTP server. ``service`` (cluster.serving.Service) takes requests (``submit``),
    drops those whose client left (``cancel``), and answers /health and /metrics."""

    def __init__(self, host: str, port: int, api_key: str | None, service):
        self.api_key = api_key
        self.service = service
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - stderr is for our own lines
                pass

            def do_GET(self):
                if not api.authorized(self):
                    return
                path = self.path.rstrip("/")
                if path == "/v1/models":
                    data = [{"id": service.model_id, "object": "model", "owned_by": "mlx-cluster"}]
                    self.reply(200, {"object": "list", "data": data})
                elif path == "/health":
                    health = service.health()
                    ok = health["status"] in ("ok", "degraded")
                    self.reply(200 if ok else 503, health)
                elif path == "/metrics":
                    self.send_bytes(200, service.metrics.exposition(), service.metrics.content_type)
                else:
                    self.error(RequestError(404, f"no route {self.path}", "not_found_error"))

            def do_POST(self):
                if not api.authorized(self):
                    return
                routes = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
                kind = routes.get(self.path.rstrip("/"))
                try:
                    if kind is None:
                        raise RequestError(404, f"no route {self.path}", "not_found_error")
                    body = self.read_json()
                    check_body(kind, body, service.model_ids())
                except RequestError as e:
                    service.metrics.finished(e.status)
                    return self.error(e)
                job = ApiRequest(kind, body, bool(body.get("stream")), service.model_id)
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

            def error(self, e: RequestError) -> None:
                headers = [("Retry-After", str(e.retry_after))] if e.retry_after else []
                self.reply(e.status, error_body(e), headers)

            def collect(self, job: ApiRequest) -> None:
                parts: list[str] = []
                try:
                    while (item := job.chunks.get()) is not END:
                        if isinstance(item, RequestError):
                            return self.error(item)
                        if item is RESTART:
                            parts = []
                        else:
                            parts.append(item)
                    self.reply(200, completion_body(job, "".join(parts), job.result))
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    service.cancel(job)

            def stream(self, job: ApiRequest) -> None:
                item = job.chunks.get()
                while item is RESTART:  # nothing was sent yet: wait for the new answer
                    item = job.chunks.get()
                if isinstance(item, RequestError):
                    return self.error(item)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                try:
                    if job.kind == "chat":
                        self.event(chunk_body(job, {"role": "assistant", "content": ""}))
                    while item is not END:
                        if isinstance(item, RequestError):  # the ranks failed mid-answer
                            self.event(error_body(item))
                            break
                        if item is not RESTART:
                            self.event(chunk_body(job, item))
                        item = job.chunks.get()
                    else:
                        self.event(chunk_body(job, None, job.result["finish_reason"]))
                        options = job.body.get("stream_options") or {}
                        if options.get("include_usage"):
                            self.event(chunk_body(job, None, usage=job.result["usage"]))
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    service.cancel(job)

            def event(self, payload: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
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

    def authorized(self, handler) -> bool:
        if self.api_key is None:
            return True
        given = handler.headers.get("Authorization", "")
        if secrets.compare_digest(given, f"Bearer {self.api_key}"):
            return True
        self.service.metrics.finished(401)
        handler.error(RequestError(401, "missing or wrong API key", "authentication_error"))
        return False
