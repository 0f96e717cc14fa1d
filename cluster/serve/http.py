"""`serve`'s HTTP server, in the launcher's process: it stays up while the ranks restart
(cluster/serve/service.py runs them and routes each request to rank 0 and back). Its routes are the
endpoints of cluster/serve/api/ (openai.py, responses.py, anthropic.py); GET /v1/models,
/health and /metrics are its own, and GET / DELETE /v1/responses/{id} read the Responses
API's store (cluster/serve/api/stored.py).

What a client sends is bounded here before anything else sees it: the Host header must name
this server and a browser's Origin must be this server's own (or ``--cors-origins``), so that
no web page the user opens can reach the API (DNS rebinding, a form posted across origins);
the key is checked before the body is read; a request's line, headers and body must arrive
within ``read_timeout``; a body is at most ``max_body_bytes`` and JSON routes take only
``application/json``; at most ``max_connections`` are open at once (503 past it), and the
listen backlog holds that many arriving at once. A body that is not read (a refusal first)
closes the connection, so no byte of it is taken for the next request. A client that leaves
while its request waits, is prefilled or is decoded is noticed within POLL_S and its request
cancelled on every rank.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import queue
import select
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cluster.core.protocol import Piece, ToolCall
from cluster.serve.api.anthropic import CountTokens, Messages
from cluster.serve.api.ollama import VERSION, ModelCard, OllamaChat, OllamaGenerate, is_ollama
from cluster.serve.api.ollama import error_body as ollama_error
from cluster.serve.api.openai import ChatCompletions, Completions
from cluster.serve.api.responses import Responses
from cluster.serve.api.shared import (
    END,
    RESTART,
    SSE,
    Answer,
    ApiRequest,
    Endpoint,
    RequestError,
    ascii_digits,
    error_body,
    loads,
    session_of,
)
from cluster.serve.api.stored import ResponseStore

POLL_S = 0.5  # how often a waiting request looks whether its client is still there
SSE_KEEPALIVE_S = 10.0  # a stream with nothing to send yet (a long prefill) says so this often
GONE = (BrokenPipeError, ConnectionResetError, TimeoutError, OSError)  # a client that left


PAGE_DIR = Path(__file__).with_name("page")
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript",
              "page.css": "text/css"}  # fmt: skip


class Api:
    """The HTTP server. ``service`` (cluster.serve.service.Service) takes requests (``submit``),
    drops those whose client left (``cancel``), and answers /health and /metrics."""

    def __init__(
        self,
        host: str,
        port: int,
        api_key: str | None,
        service,
        max_body_bytes: int = 16 << 20,
        read_timeout: float = 30.0,
        max_connections: int = 256,
        keepalive_s: float = SSE_KEEPALIVE_S,
        allowed_hosts: Iterable[str] = (),
        cors_origins: Iterable[str] = (),
        log=None,
        responses: ResponseStore | None = None,
    ):
        self.log = log or (lambda line: print(f"mlx-cluster: {line}", file=sys.stderr))
        self.keepalive_s = keepalive_s
        self.hosts = own_names(host) | {h.lower().rstrip(".") for h in allowed_hosts}
        self.origins = {o.rstrip("/").lower() for o in cors_origins}
        self.key = api_key.encode() if api_key is not None else None
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.routes: dict[str, Endpoint] = {
            "/v1/chat/completions": ChatCompletions(),
            "/v1/completions": Completions(),
            "/v1/responses": Responses(responses or ResponseStore(64 << 20, 3600.0)),
            "/v1/messages": Messages(),
            "/v1/messages/count_tokens": CountTokens(),
            "/api/chat": OllamaChat(),
            "/api/generate": OllamaGenerate(),
        }
        self.card: ModelCard | None = None  # Ollama's view of the model, read when first asked
        self.httpd = Server((host, port), Handler, self, max_connections)
        self.thread = threading.Thread(
            target=self.httpd.serve_until_stopped, daemon=True, name="http"
        )

    def model_card(self) -> ModelCard:
        if self.card is None:
            spec = getattr(self.service, "spec", None)
            self.card = ModelCard(self.service.model_id, spec.model if spec else "")
        return self.card

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.stop()
        if self.thread.is_alive():
            self.thread.join()
        self.httpd.server_close()

    def authorized(self, headers) -> bool:
        """``--api-key`` as OpenAI's clients send it (Authorization: Bearer) or Anthropic's
        (x-api-key), compared as bytes (a header may hold any byte)."""
        if self.key is None:
            return True
        bearer = raw(headers.get("Authorization", ""))
        key = raw(headers.get("x-api-key", ""))
        return hmac.compare_digest(bearer, b"Bearer " + self.key) | hmac.compare_digest(
            key, self.key
        )

    def host_allowed(self, headers) -> bool:
        """One Host header that names this server: an IP address, a loopback name, one of
        this machine's names, or one of ``--allowed-hosts`` (a name another site's page
        could resolve to 127.0.0.1 is none of these). No header at all: not a browser."""
        hosts = headers.get_all("Host") or []
        if len(hosts) > 1:
            return False
        host = hosts[0] if hosts else None
        if host is None or "*" in self.hosts:
            return True
        name = host_name(host)
        if name is None:
            return False
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name in self.hosts or name == "localhost" or name.endswith(".localhost")

    def origin_allowed(self, origin: str | None, host: str | None) -> bool:
        """A browser's Origin: absent (not a browser, or a same-origin GET), this server's
        own (the page at /), or one of ``--cors-origins``."""
        if origin is None:
            return True
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        return host is not None and origin in (f"http://{host.lower()}", f"https://{host.lower()}")


def not_kept(rid: str) -> RequestError:
    return RequestError(404, f"no response {rid[:100]!r} is kept here (made with store false, "
                             "deleted, or dropped: serve --responses-store-mb, "
                             "--responses-store-hours)", "not_found_error")  # fmt: skip


def query(path: str) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(path.partition("?")[2])[:20])


def page_of(items: list[dict], args: dict[str, str]) -> dict:
    """A list object of ``items`` as OpenAI pages them: ``order`` asc or desc (the
    default), at most ``limit`` (1-100, 20) after the item ``after``."""
    order = args.get("order", "desc")
    limit = args.get("limit", "20")
    if order not in ("asc", "desc"):
        raise RequestError(400, "'order' must be asc or desc")
    if not ascii_digits(limit) or not 1 <= int(limit) <= 100:
        raise RequestError(400, "'limit' must be an integer from 1 to 100")
    ordered = items if order == "asc" else items[::-1]
    if "after" in args:
        ids = [item.get("id") for item in ordered]
        if args["after"] not in ids:
            raise RequestError(400, f"'after': no item {args['after'][:100]!r} in this list")
        ordered = ordered[ids.index(args["after"]) + 1 :]
    data = ordered[: int(limit)]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(ordered) > len(data)}  # fmt: skip


def own_names(bound: str) -> set[str]:
    """The names this machine answers to: the address bound, its host name (and .local)."""
    names = {bound.lower().strip("[]")}
    try:
        hostname = socket.gethostname().lower()
    except OSError:
        hostname = ""
    if hostname:
        short = hostname.split(".")[0]
        names |= {hostname, short, f"{short}.local"}
    return names


def host_name(host: str) -> str | None:
    """The name in a Host header (``name``, ``name:port``, ``[v6]:port``), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name, _, port = host.partition(":")
    if port and not ascii_digits(port):
        return None
    return name.rstrip(".") or None


def raise_open_files(connections: int) -> str | None:
    """Let this process open a descriptor per connection and then some (macOS starts a
    shell's processes at 256); a sentence when it cannot."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    wanted = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return None
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target < wanted:
        return (f"this process may open {target} files, fewer than --max-connections "
                f"{connections} needs ({wanted}); raise it with `ulimit -n {wanted}`")  # fmt: skip
    return None


def raw(value: str) -> bytes:
    """A header value as the bytes that came (http.server decodes them as Latin-1)."""
    return value.encode("latin-1", "surrogateescape")


BUSY = json.dumps(
    error_body(RequestError(503, "too many open connections; retry shortly", "server_error"))
).encode()


class Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: past it a connection
    gets 503 and is closed, without a thread."""

    daemon_threads = True

    def __init__(self, address, handler, api: Api, max_connections: int):
        self.api = api
        self.slots = threading.BoundedSemaphore(max_connections)
        # clients connecting at once wait in the kernel's queue, not refused (socketserver's
        # default backlog is 5: a burst of 64 clients saw connections reset)
        self.request_queue_size = max(128, max_connections)
        self.stopping = False
        self.wake_r, self.wake_w = socket.socketpair()  # before: a failed bind closes them
        super().__init__(address, handler)

    def serve_until_stopped(self) -> None:
        """Accept connections until ``stop``. socketserver's serve_forever wakes every poll
        interval to look for a shutdown, on a server that idles for days; this one sleeps
        until a client connects or ``stop`` writes to its wake socket."""
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self.wake_r, selectors.EVENT_READ)
            while not self.stopping:
                for key, _ in selector.select():
                    if key.fileobj is self and not self.stopping:
                        self._handle_request_noblock()  # type: ignore[attr-defined]

    def stop(self) -> None:
        self.stopping = True
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def server_close(self) -> None:
        super().server_close()
        self.wake_r.close()
        self.wake_w.close()

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            head = (
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(BUSY)}\r\n\r\n"
            )
            try:
                request.settimeout(1.0)
                request.sendall(head.encode() + BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def readable(sock: socket.socket) -> bool:
    """Whether a read would not block (poll: select() cannot watch a descriptor past 1023,
    which a busy server's connections reach)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))
    readable, _, _ = select.select([sock], [], [], 0)  # Windows: no poll
    return bool(readable)


class Handler(BaseHTTPRequestHandler):
    """One connection. Reading a request (line, headers, body) has ``read_timeout`` in all;
    past it the connection is cut, so a slow client cannot hold a thread."""

    protocol_version = "HTTP/1.1"
    server: Server

    def setup(self):
        self.api = self.server.api
        self.service = self.api.service
        self.timeout = self.api.read_timeout  # each socket operation
        super().setup()

    def log_message(self, format, *args):  # noqa: A002 - stderr is for our own lines
        pass

    def handle_one_request(self):
        self.reading = threading.Timer(self.api.read_timeout, self.cut)
        self.reading.daemon = True
        self.reading.start()
        try:
            super().handle_one_request()
        except GONE:
            self.close_connection = True
        finally:
            self.reading.cancel()

    def cut(self) -> None:
        """The request did not arrive in time: end the connection (its thread then ends)."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send_response(self, code, message=None):
        self.responded = True
        super().send_response(code, message)

    def guarded(self, method) -> None:
        """Run a route. An exception no check foresaw is a 500 with a JSON body (when no
        answer began) and one traceback in serve's log, never a connection dropped without a
        word; the connection then closes (what was left of its request is not read)."""
        self.responded = False
        try:
            method()
        except GONE:
            raise
        except Exception as e:
            self.close_connection = True
            self.api.log(f"serve: internal error answering {self.command} {self.path[:200]} "
                         f"({type(e).__name__}); the server goes on\n"
                         + traceback.format_exc().rstrip())  # fmt: skip
            self.service.metrics.finished(500)
            if not self.responded:
                why = f"internal error in the server ({type(e).__name__}); its log has the details"
                self.error(RequestError(500, why, "server_error"))

    def do_GET(self):
        self.guarded(self.get)

    def do_POST(self):
        self.guarded(self.post)

    def do_OPTIONS(self):
        self.guarded(self.options)

    def do_DELETE(self):
        self.guarded(self.delete)

    def bodiless(self, pages: bool = False) -> str | None:
        """A GET's or DELETE's path once its host, origin and key pass (None: refused, and
        answered). ``pages``: the page's own files load without the key."""
        self.discard_body()
        self.reading.cancel()
        path = self.path.split("?")[0].rstrip("/")
        if not self.api.host_allowed(self.headers):
            self.refuse_host()
            return None
        if pages and (path == "" or path.startswith("/page/")):
            self.page(path.removeprefix("/page/") or "index.html")
            return None
        if not self.origin_ok(None) or not self.authorized(None):
            return None
        return path

    def get(self):
        path = self.bodiless(pages=True)
        if path is None:
            return
        service = self.service
        if path == "/v1/cluster":
            self.reply(200, service.cluster())
        elif path == "/v1/models":
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
        elif path in ("/api/tags", "/api/ps", "/api/version"):  # Ollama's
            card = self.api.model_card()
            answer = {"/api/tags": card.tags, "/api/ps": card.ps}.get(path)
            self.reply(200, answer() if answer else {"version": VERSION})
        elif path.startswith("/v1/responses/"):
            try:
                self.reply(200, self.stored_response(path, query(self.path)))
            except RequestError as e:
                self.error(e)
        else:
            self.not_found()

    def not_found(self) -> None:
        e = RequestError(404, f"no route {self.path[:200]}", "not_found_error")
        if is_ollama(self.path):
            return self.reply(404, ollama_error(e))
        self.error(e)

    def delete(self):
        """DELETE /v1/responses/{id}: the stored response is dropped."""
        path = self.bodiless()
        if path is None:
            return
        rid = path.removeprefix("/v1/responses/")
        if not path.startswith("/v1/responses/") or "/" in rid:
            return self.error(RequestError(404, f"no route {self.path[:200]}", "not_found_error"))
        if not self.responses_api.store.delete(rid):
            return self.error(not_kept(rid))
        self.reply(200, {"id": rid, "object": "response", "deleted": True})

    @property
    def responses_api(self) -> Responses:
        endpoint = self.api.routes["/v1/responses"]
        assert isinstance(endpoint, Responses)
        return endpoint

    def stored_response(self, path: str, args: dict[str, str]) -> dict:
        """GET /v1/responses/{id} (the response) or /v1/responses/{id}/input_items (its
        request's input items, a page of them: ``limit``, ``order``, ``after``)."""
        rid, _, rest = path.removeprefix("/v1/responses/").partition("/")
        if rest not in ("", "input_items"):
            raise RequestError(404, f"no route {self.path[:200]}", "not_found_error")
        stored = self.responses_api.store.get(rid)
        if stored is None:
            raise not_kept(rid)
        if not rest:
            return stored.response
        return page_of(stored.input_items, args)

    def post(self):
        path = self.path.split("?")[0].rstrip("/")
        if path == "/api/show":
            return self.show()
        endpoint = self.api.routes.get(path)
        if not self.api.host_allowed(self.headers):
            return self.refuse_host(endpoint)
        if not self.origin_ok(endpoint) or not self.authorized(endpoint):
            return
        service = self.service
        try:
            if endpoint is None:
                self.discard_body()
                raise RequestError(404, f"no route {self.path[:200]}", "not_found_error")
            kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if kind != "application/json" and not getattr(endpoint, "any_content_type", False):
                self.close_connection = True  # its body is not read
                raise RequestError(
                    415,
                    f"send the body as JSON with 'Content-Type: application/json' (got "
                    f"{kind[:60] or 'none'!r})",
                )
            body = loads(self.read_body())
            self.reading.cancel()
            request = endpoint.parse(body, service.door)
            if refusal := service.refused_grammar(request):
                raise refusal
            stream = body.get("stream")
            if stream is not None and not isinstance(stream, bool):
                raise RequestError(400, f"'stream' must be true or false, got {stream!r:.40}")
        except RequestError as e:
            service.metrics.finished(e.status)
            return self.error(e, endpoint)
        stream = bool(getattr(endpoint, "streams", False) if stream is None else stream)
        stream = stream and request.kind != "count"
        req = ApiRequest(endpoint, request, stream, service.model_id, endpoint.echo(body))
        req.session = session_of(body)
        del body  # what the answer repeats is in req.echo; the rest is not kept
        service.submit(req)
        try:
            if req.stream:
                self.stream(req)
            else:
                self.collect(req)
        except GONE:  # the client went away
            self.close_connection = True
            service.cancel(req)
        except Exception:  # answered with a 500 (guarded): the ranks stop decoding it
            service.cancel(req)
            raise

    def show(self) -> None:
        """Ollama's POST /api/show: the model's family, context and capabilities."""
        if not self.api.host_allowed(self.headers):
            return self.refuse_host()
        if not self.origin_ok(None) or not self.authorized(None):
            return
        try:
            body = loads(self.read_body())
            self.reading.cancel()
            self.reply(200, self.api.model_card().show(body, self.service.door))
        except RequestError as e:
            self.reply(e.status, ollama_error(e))

    def options(self):
        """A browser's preflight, answered for ``--cors-origins`` only."""
        self.discard_body()
        self.reading.cancel()
        origin = self.headers.get("Origin")
        if not self.api.host_allowed(self.headers):
            return self.refuse_host()
        if origin is None or not self.api.origin_allowed(origin, self.headers.get("Host")):
            why = "this origin may not call the API (serve --cors-origins)"
            return self.error(RequestError(403, why, "permission_error"))
        self.send_response(204)
        self.cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS")
        asked = self.headers.get("Access-Control-Request-Headers", "")
        self.send_header("Access-Control-Allow-Headers", asked[:1000] or "Content-Type")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def cors_headers(self) -> None:
        """Access-Control-Allow-Origin for an origin of ``--cors-origins`` only: a refusal
        (403) or any answer to another origin grants nothing."""
        origin = self.headers.get("Origin")
        if origin is None or not self.api.origins:
            return
        shown = origin.rstrip("/").lower()
        if "*" in self.api.origins or shown in self.api.origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def refuse_host(self, endpoint: Endpoint | None = None) -> None:
        self.close_connection = True  # its body (if any) is not read
        self.service.metrics.finished(403)
        shown = (self.headers.get("Host") or "")[:100]
        self.error(RequestError(
            403,
            f"this server does not answer to the host name {shown!r}; if that name is "
            "yours, start serve with --allowed-hosts NAME",
            "permission_error",
        ), endpoint)  # fmt: skip

    def origin_ok(self, endpoint: Endpoint | None) -> bool:
        """A web page of another origin may not use the API (unless --cors-origins)."""
        origin = self.headers.get("Origin")
        if self.api.origin_allowed(origin, self.headers.get("Host")):
            return True
        self.close_connection = True
        self.service.metrics.finished(403)
        self.error(RequestError(
            403,
            f"a web page of {(origin or '')[:100]!r} may not call this API; start serve with "
            "--cors-origins ORIGIN to allow it",
            "permission_error",
        ), endpoint)  # fmt: skip
        return False

    def framing(self) -> str | None:
        """The body's length as the headers give it (None: no body), or RequestError: a
        Transfer-Encoding (this server reads bodies by length only) or Content-Lengths that
        disagree, which a proxy in front may have read otherwise (one body read two ways
        is a second request smuggled in). Either closes the connection after the answer."""
        if self.headers.get_all("Transfer-Encoding"):
            self.close_connection = True
            codings = ", ".join(self.headers.get_all("Transfer-Encoding") or [])[:60]
            if "chunked" in codings.lower():
                raise RequestError(411, "send the body with a Content-Length, not chunked")
            raise RequestError(501, f"Transfer-Encoding {codings!r} is not implemented; send "
                                    "the body with a Content-Length")  # fmt: skip
        lengths = {text.strip() for text in self.headers.get_all("Content-Length") or []}
        if len(lengths) > 1:
            self.close_connection = True
            raise RequestError(400, "the request has Content-Length headers that disagree")
        text = lengths.pop() if lengths else None
        if text is not None and (not ascii_digits(text) or len(text) > 18):
            self.close_connection = True
            raise RequestError(400, f"bad Content-Length {text[:40]!r}")
        return text

    def discard_body(self) -> None:
        """A body that a route does not read is read and dropped when it is small, else the
        connection closes after the answer: its bytes never become the next request."""
        try:
            text = self.framing()
        except RequestError:
            self.close_connection = True
            return
        if text is None:
            return
        if int(text) > 1 << 20:
            self.close_connection = True
            return
        size = int(text)
        while size > 0 and (chunk := self.rfile.read(min(size, 1 << 16))):
            size -= len(chunk)
        if size:
            self.close_connection = True

    def page(self, name: str) -> None:
        """The page's own files (shipped in cluster/serve/page/; no CDN: a rig may have no
        internet). Every call it makes for data or a chat needs the key."""
        kind = PAGE_FILES.get(name)
        if kind is None:
            return self.error(RequestError(404, f"no route {self.path[:200]}", "not_found_error"))
        data = (PAGE_DIR / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(data)

    def authorized(self, endpoint: Endpoint | None) -> bool:
        if self.api.authorized(self.headers):
            return True
        self.service.metrics.finished(401)
        self.close_connection = True  # its body (if any) is not read
        self.error(RequestError(401, "missing or wrong API key", "authentication_error"), endpoint)
        return False

    def read_body(self) -> bytes:
        text = self.framing() or "0"
        size, most = int(text), self.api.max_body_bytes
        if size > most:
            self.close_connection = True
            if size <= 4 * most:  # read it, so the client is not cut off mid-send
                while size > 0 and (chunk := self.rfile.read(min(size, 1 << 20))):
                    size -= len(chunk)
            raise RequestError(
                413,
                f"the body is {text} bytes, over this server's {most} bytes (serve --max-body-mb)",
            )
        data = self.rfile.read(size)
        if len(data) < size:
            self.close_connection = True
            raise RequestError(400, f"the body ended after {len(data)} of {size} bytes")
        return data

    def send_bytes(self, status: int, data: bytes, content_type: str, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.cors_headers()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def reply(self, status: int, payload: dict, headers=()) -> None:
        self.send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def error(self, e: RequestError, endpoint: Endpoint | None = None) -> None:
        headers = [("Retry-After", str(e.retry_after))] if e.retry_after else []
        shape = endpoint.error_body if endpoint is not None else error_body
        if endpoint is None and is_ollama(self.path):  # /api/show, /api/tags, ...
            shape = ollama_error
        try:
            self.reply(e.status, shape(e), headers)
        except GONE:
            self.close_connection = True

    def next_item(self, req: ApiRequest, wait: float | None = None):
        """The request's next item (see cluster.serve.api.shared), looking every POLL_S whether the
        client is still there; a client that left raises ConnectionResetError. None once
        ``wait`` seconds passed without one."""
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            try:
                return req.chunks.get(timeout=POLL_S)
            except queue.Empty:
                if self.client_left():
                    raise ConnectionResetError("the client left") from None
                if deadline is not None and time.monotonic() >= deadline:
                    return None

    def client_left(self) -> bool:
        """The client closed its side: its socket reads as ended (no request of HTTP/1.1
        pipelining is waiting in front of the end)."""
        sock = self.connection
        try:
            return readable(sock) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def collect(self, req: ApiRequest) -> None:
        answer = Answer()
        while (item := self.next_item(req)) is not END:
            if isinstance(item, RequestError):
                return self.error(item, req.endpoint)
            if item is RESTART:
                answer = Answer()
            else:
                answer.add(item)
        answer.result = req.result or {}
        self.reply(200, req.endpoint.reply(req, answer))

    def stream(self, req: ApiRequest) -> None:
        """The answer as server-sent events. A refusal that comes first is a plain HTTP error;
        an answer that has not begun after ``keepalive_s`` (a long prompt being prefilled)
        gets its headers and the stream's opening, then a keep-alive every ``keepalive_s``,
        so that no client or proxy between gives up on an idle connection."""
        item = self.next_item(req, self.api.keepalive_s)
        while item is RESTART:  # nothing was sent yet: wait for the new answer
            item = self.next_item(req, self.api.keepalive_s)
        if isinstance(item, RequestError):
            return self.error(item, req.endpoint)
        events = req.endpoint.events(req)
        self.ndjson = getattr(events, "ndjson", False)  # Ollama's: a JSON object per line
        self.send_response(200)
        self.send_header(
            "Content-Type", "application/x-ndjson" if self.ndjson else "text/event-stream"
        )
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.cors_headers()
        self.end_headers()
        self.close_connection = True
        answer = Answer()
        self.send_events(events.start())
        while item is None or item is RESTART:  # still waiting for the first token
            if events.keepalive:
                self.wfile.write(events.keepalive)
                self.wfile.flush()
            item = self.next_item(req, self.api.keepalive_s)
        while item is not END:
            if isinstance(item, RequestError):  # the ranks failed mid-answer
                self.send_events(events.fail(item))
                break
            answer.add(item)
            if isinstance(item, Piece):
                self.send_events(events.piece(item))
            elif isinstance(item, ToolCall):
                self.send_events(events.tool_call(item))
            item = self.next_item(req)
        else:
            answer.result = req.result or {}
            self.send_events(events.end(answer))
        self.wfile.write(events.done)
        self.wfile.flush()

    def send_events(self, events: Iterable[SSE]) -> None:
        for name, payload in events:
            if getattr(self, "ndjson", False):
                self.wfile.write(json.dumps(payload).encode() + b"\n")
                continue
            head = f"event: {name}\n".encode() if name else b""
            self.wfile.write(head + b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()
