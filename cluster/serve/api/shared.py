"""What `serve`'s API dialects share: the request as it travels (ApiRequest), the answer as
rank 0's events build it (Answer), errors (RequestError) and the checks of a body's fields.

The HTTP server is cluster/serve/http.py. Each of its routes is an endpoint of one API
dialect (openai.py beside this file: chat completions and completions; responses.py: OpenAI's
Responses; anthropic.py: Anthropic's Messages). An endpoint turns a body into the request rank
0 decodes (a cluster.core.spec.ServeRequest: OpenAI chat messages, tools, sampling) and rank
0's answer back into its own shapes; everything between is shared.

HTTP threads parse and check a request, hand it to the service and wait on its ``chunks``:
rank 0's events (Piece, ToolCall), then END; or a RequestError (a 4xx from rank 0, a
503 after the restart wait, an error that ends a stream under way); or RESTART, which tells a
non-streaming request that its answer so far is void and will be decoded again.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import queue
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.core.params import Range, ranges
from cluster.core.prefix import Link
from cluster.core.protocol import Piece, ToolCall
from cluster.core.spec import Sampling, ServeRequest, normalized

MAX_TOKENS_CAP = 32768  # serve's --max-tokens-cap default
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 1000  # characters per stop string
MAX_MESSAGES = 10_000  # messages (or input items) per request
MAX_PARTS = 1_000  # content parts (blocks) per message, tools per request
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_DEPTH = 64  # nesting of objects and lists in a body (tool schemas are the deepest)
MAX_VALUES = 1_000_000  # JSON values in a body: each is ~60 bytes as a Python object
SCAN_VALUES_FROM = 1 << 20  # bodies from this size are counted before they are parsed
END = object()  # the answer is complete (its stats are in ApiRequest.result)
RESTART = object()  # the ranks restarted: a non-streaming answer starts again


class RequestError(ValueError):
    """A request the API refuses: HTTP status, error type (OpenAI's names; each dialect maps
    them to its own), message, and the field at fault (``param``: OpenAI's ``error.param``;
    by default the field the message starts with, ``'top_k' must be ...`` or
    ``output_config: ...``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        retry_after: int | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.retry_after = status, kind, retry_after
        self.param = param if param is not None else named_field(message)


FIELD_FIRST = re.compile(r"^'([A-Za-z_][\w.\[\]-]*)'|^([a-z_][\w.\[\]]*): ")


def named_field(message: str) -> str | None:
    """The request field a refusal names first (None when it names none)."""
    m = FIELD_FIRST.match(message)
    return (m[1] or m[2]) if m else None


SSE = tuple[str | None, dict]  # (event name or None, payload): one server-sent event


class Endpoint(Protocol):
    """One route's dialect."""

    def parse(self, body: Any, door: Door) -> ServeRequest:
        """The request rank 0 decodes, or RequestError (the field named)."""

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        """The whole answer as one JSON body."""

    def events(self, req: ApiRequest) -> Stream:
        """A stream's events, one answer's worth."""

    def error_body(self, e: RequestError) -> dict: ...

    def echo(self, body: dict) -> dict:
        """What of the (parsed, checked) body its answer repeats: the body itself is not
        kept while the request lives."""


SSE_KEEPALIVE = b": keepalive\n\n"  # an SSE comment: every client's parser skips it


class Stream(Protocol):
    done: bytes  # what ends the stream after the last event (b"" for none)
    keepalive: bytes  # sent while the answer has not begun (a long prefill)

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


@dataclass(eq=False)  # one request is itself only: never compared field by field
class ApiRequest:
    endpoint: Endpoint
    request: ServeRequest  # what rank 0 gets (its id is set from ours)
    stream: bool
    model: str  # the id answers name
    echo: dict = field(default_factory=dict)  # the body's fields its answer repeats
    chunks: queue.Queue = field(default_factory=queue.Queue)  # events, then END (see above)
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)
    result: dict | None = None  # the answer's stats, set before END
    status: int | None = None  # how it ended, for /metrics (None while under way)
    failures_seen: int = 0  # failures of the ranks while rank 0 held it
    admitted: tuple[int, int] | None = None  # (prompt tokens, from the cache) once it joined
    # a fleet's (cluster.serve.fleet): the prompt's prefixes, the session it belongs to
    # (prompt_cache_key, user, metadata.user_id) and the group it was sent to
    chain: list[Link] = field(default_factory=list)
    session: str | None = None
    group: int = 0
    to_prefill: int | None = None  # its prompt tokens the router reckoned its group prefills
    # a prompt prefilled by a prefill group (issue 53): that request's end (the fleet's), and
    # the handoff's figures, added to the answer's timings
    on_handed: Callable[[Any], None] | None = None
    handed: dict | None = None
    # cancels the prefill group's copy: called once, when this request ends for any reason,
    # when its decode group forgets its ticket, or when it is replayed without its handoff
    drop_copy: Callable[[], None] | None = None

    @property
    def is_prefill_copy(self) -> bool:
        """A prefill group's copy of a client's request: never rerouted, never answered."""
        return self.on_handed is not None

    def let_go(self) -> None:
        """Its prefill group's copy is no longer wanted (see ``drop_copy``)."""
        drop, self.drop_copy = self.drop_copy, None
        if drop is not None:
            drop()

    def to_rank0(self) -> ServeRequest:
        return dataclasses.replace(self.request, id=self.id)


SESSION_FIELDS = ("prompt_cache_key", "user")  # and Anthropic's metadata.user_id
MOST_SESSION_CHARS = 256


def session_of(body: dict) -> str | None:
    """The session a request belongs to, as its client names it: OpenAI's prompt_cache_key or
    user, Anthropic's metadata.user_id (a fleet keeps a session on one group)."""
    names = [body.get(f) for f in SESSION_FIELDS]
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        names.append(metadata.get("user_id"))
    for name in names:
        if isinstance(name, str) and name:
            return name[:MOST_SESSION_CHARS]
    return None


def call_id(call: ToolCall, prefix: str, req: ApiRequest) -> str:
    """A tool call's id: the model's, else one made from the request's id and its index."""
    return call.id or f"{prefix}{req.id}{call.index}"


# Checks and conversions every dialect uses


@dataclass(frozen=True)
class Door:
    """What a dialect checks a body against: the model ids served here and the server's caps
    (serve's options). ``shown`` is the id an error names (never a local path: the model may
    be served from one, and a client needs no folder of the server's)."""

    model_ids: frozenset[str]
    max_tokens_cap: int = MAX_TOKENS_CAP
    shown: str = ""
    aliases: tuple[str, ...] = ()  # other names the served model answers to (globs: claude-*)
    default_max_tokens: int | None = None  # serve --default-max-tokens (None: the context's)

    def answer_tokens(self, asked: int | None) -> int:
        """max_tokens as rank 0 gets it: what the client asked, lowered to the cap; without
        one, --default-max-tokens or the cap, which rank 0 lowers to what the model's context
        leaves after the prompt (OpenAI's and vLLM's default: the rest of the context)."""
        if asked is None:
            asked = self.default_max_tokens or self.max_tokens_cap
        return min(asked, self.max_tokens_cap)

    def serves(self, model: str) -> bool:
        return model in self.model_ids or any(fnmatch.fnmatchcase(model, a) for a in self.aliases)


RANGES = ranges(Sampling)  # our Sampling field -> the values a request may give it
LOGIT_BIAS = Range(-100, 100)


def loads(data: bytes) -> Any:
    """A request body as JSON: NaN and Infinity (which Python's json takes) are refused, and
    so are bodies nested deeper than MAX_DEPTH, holding more than MAX_VALUES values (a 16 MiB
    body of ``[[],[],...]`` is ~20x that in Python objects) or a string that is not valid
    Unicode (a lone surrogate escape, which JSON allows: it could not be encoded on the way to
    the ranks). The field is named."""

    def constant(name: str):
        raise RequestError(400, f"the body is not valid JSON: {name} is not a JSON number")

    if len(data) >= SCAN_VALUES_FROM and (n := count_values(data)) > MAX_VALUES:
        raise RequestError(400, f"the body holds {n} JSON values; at most {MAX_VALUES} are allowed")
    try:
        value = json.loads(data or b"null", parse_constant=constant)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError(400, f"the body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, bad UTF-8, huge integers
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    check_depth(value)
    return value


# A JSON string, or what is left of one that never closes: the loop takes any byte after a
# backslash (newlines too) and every byte but a quote or a backslash, so what follows it is a
# quote, a last backslash or the end, and the match never fails. A pattern that can fail
# (r'"[^"\\]*(?:\\.[^"\\]*)*"') is tried again from every quote inside an unclosed string: a
# body of '"' and then '\\"' x 500k took hours, holding the GIL.
STRINGS = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)')


def count_values(data: bytes) -> int:
    """About how many values a JSON text holds (its strings taken out: a comma, a bracket or
    a brace outside them starts one), without building them; linear in the text."""
    bare = STRINGS.sub(b"", data)
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1


def check_depth(value: Any, where: str = "the body", most: int = MAX_DEPTH) -> None:
    """Nesting at most ``most`` deep, and every string (keys too) valid Unicode; a 400 naming
    the field otherwise."""
    todo: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    while todo:
        item, depth, path = todo.pop()
        if depth > most:
            shown = where if where == "the body" else f"'{where}'"
            raise RequestError(400, f"{shown} is nested deeper than {most} levels")
        if isinstance(item, str):
            if not item.isascii() and not valid_unicode(item):
                raise RequestError(400, f"{field_path(where, path)}: {LONE_SURROGATE}")
        elif isinstance(item, dict):
            for k, v in item.items():
                if not k.isascii() and not valid_unicode(k):
                    raise RequestError(400, f"{field_path(where, path)}: a key {LONE_SURROGATE}")
                todo.append((v, depth + 1, (*path, k)))
        elif isinstance(item, list):
            todo += [(v, depth + 1, (*path, i)) for i, v in enumerate(item)]


LONE_SURROGATE = (
    "holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which is not a "
    "character; send valid Unicode"
)


def valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def field_path(where: str, path: tuple) -> str:
    """('messages', 0, 'content') as 'messages[0].content' (after ``where``, unless that is
    the whole body)."""
    out = "" if where == "the body" else where
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return f"'{out}'" if out else where


def ascii_digits(text: str) -> bool:
    """0-9 only: str.isdigit() also takes "²" and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def check_count(items: list, most: int, name: str) -> list:
    if len(items) > most:
        raise RequestError(400, f"'{name}' has {len(items)} items; at most {most} are allowed")
    return items


def check_model(body: dict, door: Door) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string")
    if model is not None and not door.serves(model):
        served = door.shown or ", ".join(sorted(door.model_ids))
        also = f", and answers to {', '.join(door.aliases)}" if door.aliases else ""
        raise RequestError(
            404,
            f"model {model[:200]!r} is not served here (this server serves {served!r}{also}); "
            "GET /v1/models lists it; serve --served-model-name NAME (globs: 'claude-*') "
            "answers other names",
            "not_found_error",
            param="model",
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


def max_tokens(body: dict, door: Door, *names: str) -> int | None:
    """The first of ``names`` present, a positive integer (None if none is). Above the
    server's cap it is lowered to it, not refused: agents ask the most their own vendor's
    model allows (Claude Code 128000) and want an answer, which ends with finish_reason
    'length' if it reaches the cap, as it would at the context's end."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(400, f"'{name}' must be a positive integer")
        return value
    return None


def include_usage(body: dict) -> bool:
    """OpenAI's ``stream_options``: an object whose ``include_usage`` is a boolean."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise RequestError(400, "'stream_options.include_usage' must be a boolean")
    return bool(value)


def stop_strings(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise RequestError(400, f"'{name}' must be a string or a list of strings")
    check_count(value, MAX_STOPS, name)
    if any(len(x) > MAX_STOP_CHARS for x in value):
        raise RequestError(400, f"'{name}': a stop string is at most {MAX_STOP_CHARS} characters")
    return list(value)


def logit_bias(value: Any) -> dict[str, float] | None:
    """OpenAI's logit_bias: token ids (as JSON keys) to a bias from -100 to 100. Rank 0
    checks the ids against the vocabulary."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(400, "'logit_bias' must be an object of token ids to biases")
    check_count(list(value), MAX_LOGIT_BIAS, "logit_bias")
    out = {}
    for key, bias in value.items():
        if not ascii_digits(key) or len(key) > 10:
            raise RequestError(400, f"'logit_bias': {key[:20]!r} is not a token id")
        if not LOGIT_BIAS.admits(bias):
            raise RequestError(400, f"'logit_bias' of {key}: must be {LOGIT_BIAS.describe()}")
        out[str(int(key))] = float(bias)
    return out or None


def sampling(body: dict, fields: dict[str, str], door: Door, max_tokens: int | None,
             stop: list[str], bias: dict[str, float] | None = None) -> Sampling:  # fmt: skip
    """The Sampling of a body, every value checked against RANGES (the one table of what a
    request may ask): ``fields`` maps the dialect's names to ours. -1 means "off" for top_k
    and "a random seed" for seed, as llama.cpp and vLLM take them."""
    chosen = {}
    for name, ours in fields.items():
        value = body.get(name)
        if value is None:
            continue
        allowed = RANGES[ours]
        if not allowed.admits(value):
            shown = json.dumps(value)[:40] if not isinstance(value, str) else repr(value[:40])
            raise RequestError(400, f"'{name}' must be {allowed.describe()}; got {shown}")
        chosen[ours] = value
    return normalized(
        Sampling(
            max_tokens=door.answer_tokens(max_tokens),
            stop=stop,
            logit_bias=bias,
            **chosen,
        )
    )


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


def arguments_object(arguments: Any, where: str = "a tool call's arguments") -> Any:
    """A tool call's arguments as templates render them: the object, not its JSON text (as
    mlx_lm.server passes them); text that is not JSON stays as it is. The text is a JSON
    document of its own inside the body: its nesting and strings are checked as the body's
    (a 500-deep one would fail later, on serve's loop, where no client hears of it)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except RecursionError:
            raise RequestError(400, f"'{where}' is nested deeper than {MAX_DEPTH} levels") from None
        except ValueError:
            return arguments
        check_depth(value, where)
        return value
    return arguments


def assistant_calls(calls: list[tuple[str | None, str, Any]], where: str = "tool_calls",
                    indexed: bool = True) -> list[dict]:  # fmt: skip
    """(id, name, arguments) into the assistant message's ``tool_calls`` (``where``: the
    field that holds them, for an error; ``indexed``: a list of calls, not one)."""
    return [
        {
            "id": cid,
            "type": "function",
            "function": {
                "name": name,
                "arguments": arguments_object(
                    arguments, f"{where}[{i}].arguments" if indexed else f"{where}.arguments"
                ),
            },
        }
        for i, (cid, name, arguments) in enumerate(calls)
    ]


def error_body(e: RequestError) -> dict:
    """OpenAI's error shape (chat completions, completions, Responses, and the shared
    routes)."""
    return {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": None}}
