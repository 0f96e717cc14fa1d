"""`mlx-cluster serve`: an OpenAI-compatible HTTP API on rank 0.

HTTP threads on rank 0 only parse requests and queue them. Rank 0's main thread turns them into
prompt tokens and, once a round, shares an order with the other ranks (share_object, plain JSON:
nothing from the network is ever unpickled): which requests join the batch, which leave it. Every
rank applies it to the same mlx-lm BatchGenerator (node/batch.py), so all decode the batch in
lockstep; between requests the other ranks wait in share_object. A client that goes away
mid-stream sets its job's cancel flag, and rank 0 drops its request at the next order.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cluster.protocol import Notice, Stats
from cluster.spec import JobSpec, Sampling, ServeSettings, Template, default

from .generate import AnswerText, answer_stats, answer_text
from .sampling import settings
from .watchdog import progress

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
PING_S = 2.0  # an idle rank 0 shows every rank it is still there this often
STALE_S = 60.0  # /health says "stalled" when the ranks have not met for this long


class RequestError(ValueError):
    """A request the API refuses: HTTP status, OpenAI error type and message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class ApiRequest:
    kind: str  # "chat" or "completion"
    body: dict
    stream: bool
    chunks: queue.Queue = field(default_factory=queue.Queue)  # text, then an end marker
    cancel: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    result: dict | None = None  # the answer's stats, set before END
    model: str | None = None  # the id answers name


END = object()


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


def request_template(body: dict) -> Template:
    return Template(tools=body.get("tools") or None)


def _text(content) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def prompt_of(job: ApiRequest, tokenizer) -> list[int]:
    from .generate import render

    if job.kind == "chat":
        messages = [
            {"role": m["role"], "content": _text(m.get("content"))} for m in job.body["messages"]
        ]
        return render(tokenizer, messages, request_template(job.body))
    return tokenizer.encode(job.body["prompt"])


class Server:
    """Rank 0's HTTP side: a queue of jobs for the main thread."""

    def __init__(self, host: str, port: int, model_id: str, info: dict, api_key: str | None):
        self.jobs: queue.Queue[ApiRequest | None] = queue.Queue()  # None wakes the main thread
        self.model_id = model_id
        self.info = info
        self.api_key = api_key
        self.draining = threading.Event()  # no new requests; quit once the last one is done
        self.drain_timeout = default(ServeSettings, "drain_timeout")
        self.last_contact = time.monotonic()  # when every rank last met in a collective
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - stderr is for our events
                pass

            def do_GET(self):
                if not server.authorized(self):
                    return
                if self.path.rstrip("/") == "/v1/models":
                    data = [{"id": model_id, "object": "model", "owned_by": "mlx-cluster"}]
                    self.reply(200, {"object": "list", "data": data})
                elif self.path.rstrip("/") == "/health":
                    health = server.health()
                    self.reply(200 if health["status"] == "ok" else 503, health)
                else:
                    self.error(RequestError(404, f"no route {self.path}", "not_found_error"))

            def do_POST(self):
                if not server.authorized(self):
                    return
                routes = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
                kind = routes.get(self.path.rstrip("/"))
                try:
                    if kind is None:
                        raise RequestError(404, f"no route {self.path}", "not_found_error")
                    body = self.read_json()
                    check_body(kind, body, {model_id, server.info.get("model")})
                except RequestError as e:
                    return self.error(e)
                if server.draining.is_set():
                    return self.error(
                        RequestError(503, "the server is shutting down", "server_error")
                    )
                job = ApiRequest(kind, body, bool(body.get("stream")), model=model_id)
                server.jobs.put(job)
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

            def reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def error(self, e: RequestError) -> None:
                self.reply(e.status, {"error": {"message": str(e), "type": e.kind, "code": None}})

            def collect(self, job: ApiRequest) -> None:
                parts = []
                while (item := job.chunks.get()) is not END:
                    if isinstance(item, RequestError):
                        return self.error(item)
                    parts.append(item)
                self.reply(200, completion_body(job, "".join(parts), job.result))

            def stream(self, job: ApiRequest) -> None:
                first = job.chunks.get()
                if isinstance(first, RequestError):
                    return self.error(first)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                item = first
                try:
                    if job.kind == "chat":
                        self.event(chunk_body(job, {"role": "assistant", "content": ""}))
                    while item is not END:
                        self.event(chunk_body(job, item))
                        item = job.chunks.get()
                    self.event(chunk_body(job, None, job.result["finish_reason"]))
                    options = job.body.get("stream_options") or {}
                    if options.get("include_usage"):
                        self.event(chunk_body(job, None, usage=job.result["usage"]))
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    job.cancel.set()
                    while item is not END:
                        item = job.chunks.get()

            def event(self, payload: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="http").start()

    def health(self) -> dict:
        """Every rank took part in a collective ``last_contact_s`` ago (an idle server meets
        every PING_S); a rank that is gone stops the whole job, so "ok" means all are up."""
        since = time.monotonic() - self.last_contact
        if self.draining.is_set():
            status = "draining"
        else:
            status = "ok" if since < STALE_S else "stalled"
        return {
            "status": status,
            **self.info,
            "ranks_up": self.info["ranks"] if since < STALE_S else None,
            "last_contact_s": round(since, 3),
        }

    def authorized(self, handler) -> bool:
        if self.api_key is None:
            return True
        given = handler.headers.get("Authorization", "")
        if secrets.compare_digest(given, f"Bearer {self.api_key}"):
            return True
        handler.error(RequestError(401, "missing or wrong API key", "authentication_error"))
        return False


def start_drain_listener(server: Server) -> None:
    """The launcher asks for a drain by writing END_OF_INPUT to rank 0 (on SIGINT/SIGTERM);
    a launcher that is gone ends the rank (node.watchdog)."""
    from cluster.protocol import END_OF_INPUT

    from .watchdog import launcher_input

    def listen():
        stream = launcher_input()
        while (data := stream.read(64)) and END_OF_INPUT not in data:
            pass
        server.draining.set()
        server.jobs.put(None)

    threading.Thread(target=listen, daemon=True, name="drain").start()


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


@dataclass
class Live:
    """Rank 0's view of one request in the batch."""

    job: ApiRequest
    detokenizer: Any
    text: AnswerText
    prompt_n: int
    inserted: float
    cached: int = 0  # prompt tokens that came from the prompt cache
    first: float | None = None
    last: float | None = None
    n: int = 0


class Scheduler:
    """Rank 0's half of the lockstep batch: which requests join, which leave, and the text.

    A request with a seed is decoded alone, as mlx-lm's server does: its tokens depend on the
    random state, which a batch shares. So are all requests of a model whose caches cannot be
    batched."""

    def __init__(self, server: Server, tokenizer, emit, batched: bool):
        self.server = server
        self.tokenizer = tokenizer
        self.emit = emit
        self.batched = batched
        self.waiting: deque[tuple[ApiRequest, dict]] = deque()
        self.inserting: list[tuple[ApiRequest, dict]] = []  # in the order just shared
        self.lives: dict[int, Live] = {}
        self.removals: list[int] = []
        self.drain_deadline: float | None = None

    def take(self, job: ApiRequest | None) -> None:
        """A job from the HTTP side into the waiting line, or its 4xx to the client."""
        if job is None:  # a wake-up (drain)
            return
        try:
            tokens = prompt_of(job, self.tokenizer)
            if not tokens:
                raise RequestError(400, "the prompt is empty after tokenization")
            request = {"tokens": tokens, **settings(request_sampling(job.body))}
            request["seeded"] = job.body.get("seed") is not None
            self.waiting.append((job, request))
        except RequestError as e:
            job.chunks.put(e)
        except Exception as e:  # a template that cannot render these messages
            job.chunks.put(RequestError(400, f"cannot build the prompt: {e}"))

    def order(self, live: int) -> dict | None:
        """The next order for every rank: {} is a ping (nothing to do, all still here), None
        means go on as before. Blocks while there is nothing to do."""
        server = self.server
        if not live and not self.waiting:
            if server.draining.is_set():
                return {"quit": True}
            try:
                self.take(server.jobs.get(timeout=PING_S))
            except queue.Empty:
                return {}
        while True:
            try:
                self.take(server.jobs.get_nowait())
            except queue.Empty:
                break
        self.cut_drain()
        order: dict[str, Any] = {}
        if self.removals:
            order["remove"], self.removals = self.removals, []
        insert = []
        while self.waiting:
            job, request = self.waiting[0]
            if not self.batched or request["seeded"]:
                if live or insert or order:
                    break  # alone: once the batch is empty
                self.waiting.popleft()
                self.inserting = [(job, request)]
                return {"single": request}
            insert.append(request)
            self.inserting.append(self.waiting.popleft())
        if insert:
            order["insert"] = insert
        return order or None

    def cut_drain(self) -> None:
        """Draining past its deadline: what is still being decoded is cancelled."""
        if not self.server.draining.is_set():
            return
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.server.drain_timeout
        if time.monotonic() < self.drain_deadline:
            return
        for uid, one in list(self.lives.items()):
            self.finish(uid, one, "cancelled")
        for job, _ in self.waiting:
            job.chunks.put(RequestError(503, "the server is shutting down", "server_error"))
        self.waiting.clear()

    def bind(self, joined: list[tuple[int, int]]) -> None:
        """The requests just inserted: (uid, prompt tokens taken from the cache), in order."""
        now = time.perf_counter()
        for (uid, cached), (job, request) in zip(joined, self.inserting, strict=True):
            text = answer_text(self.tokenizer, request)
            if text.opening:
                job.chunks.put(text.start())
            self.lives[uid] = Live(
                job, self.tokenizer.detokenizer, text, len(request["tokens"]), now, cached
            )
        self.inserting = []

    def on_token(self, r) -> None:
        """One generated token of one request: its text to the client, its end if it ends."""
        one = self.lives.get(r.uid)
        if one is None:
            return
        now = time.perf_counter()
        one.first = one.first or now
        one.last, one.n = now, one.n + 1
        if r.finish_reason != "stop":  # an end-of-sequence token has no text
            one.detokenizer.add_token(r.token)
        if r.finish_reason is not None:
            one.detokenizer.finalize()
        shown, hit = one.text.feed(one.detokenizer.last_segment)
        if shown:
            one.job.chunks.put(shown)
        if hit:
            self.finish(r.uid, one, "stop")
        elif r.finish_reason is not None:
            if rest := one.text.finish():
                one.job.chunks.put(rest)
            self.finish(r.uid, one, r.finish_reason, ended=True)
        elif one.job.cancel.is_set():
            self.finish(r.uid, one, "cancelled")

    def finish(self, uid: int, one: Live, reason: str, ended: bool = False) -> None:
        """The request's answer is complete; unless the generator ended it, every rank drops
        it at the next order."""
        del self.lives[uid]
        if not ended:
            self.removals.append(uid)
        decode_s = (one.last - one.first) if one.last and one.first else 0.0
        stats = answer_stats(
            one.prompt_n,
            one.prompt_n / (one.first - one.inserted) if one.first else 0.0,
            one.n,
            (one.n - 1) / decode_s if decode_s > 0 else 0.0,
            one.n,
            reason,
            (one.first - one.inserted) if one.first else None,
            one.cached,
        )
        one.job.result = stats
        one.job.chunks.put(END)
        self.emit(Stats(**stats))

    def single(self, answer) -> None:
        job, _ = self.inserting.pop()
        job.result = answer.stats
        job.chunks.put(END)
        self.emit(Stats(**answer.stats))


def run_serve(loaded, group, spec: JobSpec, emit) -> None:
    """Every rank's loop: rank 0 says what to do each round, every rank does it; returns once
    rank 0 says quit (a drain ended)."""
    import mlx.core as mx

    from .batch import Lockstep, batchable
    from .generate import generate
    from .share import share_from_rank0, share_object

    rank0 = group.rank() == 0
    options = spec.serve  # rank 0's; the others get what they need in ``setup``
    server = scheduler = None

    def start_server() -> dict:
        """Rank 0: listen, then share the setup every rank must agree on: the random state,
        batch limits and prompt cache (generators with other limits would schedule
        differently)."""
        nonlocal server
        local = Path(spec.model).expanduser()
        model_id = local.name if local.exists() else spec.model
        info = {"model": model_id, "mode": spec.mode, "ranks": group.size()}
        try:
            server = Server(options.host, options.port, model_id, info, options.api_key)
        except OSError as e:
            from cluster.modelcheck import ModelError

            raise ModelError(
                f"cannot listen on {options.host}:{options.port} ({e.strerror}); "
                "pass another --port"
            ) from None
        server.drain_timeout = options.drain_timeout
        start_drain_listener(server)
        return {
            "seed": secrets.randbits(31),
            "decode_concurrency": options.decode_concurrency,
            "prompt_concurrency": options.prompt_concurrency,
            "prompt_cache_size": options.prompt_cache_size,
        }

    setup = share_from_rank0(start_server if rank0 else None, group, "start the server")
    mx.random.seed(setup["seed"])
    batched = batchable(loaded.model)
    batch = (
        Lockstep(
            loaded.model,
            loaded.tokenizer,
            setup["decode_concurrency"],
            setup["prompt_concurrency"],
            setup["prompt_cache_size"],
        )
        if batched
        else None
    )
    if rank0:
        scheduler = Scheduler(server, loaded.tokenizer, emit, batched)
        host, port = server.httpd.server_address[:2]
        how = "batched" if batched else "one request at a time (its caches cannot be batched)"
        emit(Notice(f"serving {server.model_id} on http://{host}:{port}/v1, {how}"))
    live = 0
    while True:
        progress.tick()  # a round, or an idle ping every PING_S: all ranks met
        order = scheduler.order(live) if rank0 else None
        order = share_object(order, group)
        if rank0:
            server.last_contact = time.monotonic()
        if order:
            if order.get("quit"):
                break
            if "single" in order:
                job = scheduler.inserting[0][0] if rank0 else None
                answer = generate(
                    loaded.model,
                    loaded.tokenizer,
                    order["single"],
                    job.chunks.put if rank0 else None,
                    group,
                    cancelled=job.cancel.is_set if rank0 else None,
                    cancellable=True,
                )
                if rank0:
                    scheduler.single(answer)
                continue
            joined = batch.apply(order)
            if rank0:
                scheduler.bind(joined)
        if batch is not None:
            batch.round(scheduler.on_token if rank0 else None)
            live = len(batch.live)
    if batch is not None:
        batch.close()
    if rank0:
        server.httpd.shutdown()
