"""`serve`'s HTTP server, in the launcher's process: it stays up while the ranks restart
(cluster/serving.py runs them and routes each request to rank 0 and back). Its routes are the
endpoints of cluster/api_openai.py, api_responses.py and api_anthropic.py; GET /v1/models,
/health and /metrics are its own.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .api import END, RESTART, SSE, Answer, ApiRequest, Endpoint, RequestError, error_body
from .api_anthropic import CountTokens, Messages
from .api_openai import ChatCompletions, Completions
from .api_responses import Responses
from .protocol import Piece, ToolCall

MAX_BODY_BYTES = 4 * 1024 * 1024
DRAINED_BODY_BYTES = 64 * 1024 * 1024  # an over-size body up to this is read, then refused;
# a larger one is refused without reading it


class Api:
    """The HTTP server. ``service`` (cluster.serving.Service) takes requests (``submit``),
    drops those whose client left (``cancel``), and answers /health and /metrics."""

    def __init__(self, host: str, port: int, api_key: str | None, service):
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
