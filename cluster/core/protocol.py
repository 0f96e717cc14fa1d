"""What a rank tells the launcher besides its text: one typed event per stderr line.

Rank 0's stdout carries only the generated text; progress and stats travel as events on stderr so
the launcher can follow the phases (loading, ready, done) without parsing log prose. Each event
is a dataclass; ``encode_event`` and ``decode_event`` are the one encoder and decoder.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from cluster.core.spec import from_dict, to_dict

EVENT_PREFIX = "\x1emlx-cluster "
CANCEL = b"\x03"  # launcher -> rank 0's stdin: Ctrl-C in chat, end the current answer
# launcher -> rank 0's stdin: no more input, finish and quit. Chat: our stdin reached EOF (the
# pipe stays open, so a later Ctrl-C's CANCEL still arrives); serve: SIGINT/SIGTERM, drain.
# Serve's requests travel on the same channel as JSON lines (cluster.core.spec.ServeRequest); JSON
# escapes every control byte, so none of these can occur inside one.
END_OF_INPUT = b"\x04"
# launcher -> every rank's stdin, once a second: the launcher is still there (node.watchdog)
KEEPALIVE = b"\x16"
# launcher -> every rank's stdin, once every rank has said Phase("init"): join the group now.
# MLX's ring retries a refused connection after 1 s, then 2 s: ranks that reach it together
# (their imports done) connect at once instead of waiting out a peer still importing.
START = b"\x06"
# launcher -> every rank but rank 0, when rank 0 says Wake: leave the rest (node.rank.watchdog
# wait_for_wake), an order is coming. Resting ranks wait on this pipe, not in a collective,
# whose receive MLX's backends poll on a core.
WAKE = b"\x05"
KEEPALIVE_S = 1.0


@dataclass
class Beat:
    """Once a second, also while the main thread waits in a collective."""

    kind = "beat"
    progress: int = 0  # steps the rank's main loop finished: none for long is a stall
    idle: bool = False  # waiting for the user on purpose (chat): no progress is expected


@dataclass
class Phase:
    kind = "phase"
    phase: str  # init, loading, generating
    prompt_tokens: int | None = None


@dataclass
class Ready:
    """The shard is loaded and every rank met at the barrier."""

    kind = "ready"
    load_s: float
    layers: list[int] | None = None  # [first, end) of a pipeline stage; None: all layers
    files: list[str] = field(default_factory=list)
    door: int | None = None  # a decode group's rank: the port its handoff door listens on


@dataclass
class FirstToken:
    kind = "first_token"


@dataclass
class Prefill:
    """Rank 0, after each chunk of a prompt's prefill (launch, chat; serve: per request). In
    pipeline mode rank 0 runs the last stage, so a chunk done there is done on every stage."""

    kind = "prefill"
    done: int  # prompt tokens prefilled so far
    total: int
    request: str | None = None  # serve: the API request's id


@dataclass
class Stats:
    """One answer: llama-server's usage and timings fields."""

    kind = "stats"
    finish_reason: str | None
    usage: dict[str, Any]
    timings: dict[str, Any]
    time_to_first_token_s: float | None = None
    request: str | None = None  # serve: the id of the request it ends
    stop_sequence: str | None = None  # the stop string that ended the answer, if one did


@dataclass
class Serving:
    """Serve: rank 0 takes requests now (every rank loaded and in its serve loop)."""

    kind = "serving"
    model: str  # the id answers name
    batched: bool


@dataclass
class Piece:
    """Serve: the next text of one request's answer. A chat answer's text comes apart in
    ``channel``s: "reasoning" (inside the model's think block) and "content"; ``logprobs``
    holds one entry per token decoded since the last piece, when the request asked for them
    ({"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]})."""

    kind = "piece"
    request: str
    text: str
    channel: str = "content"
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class ToolCall:
    """Serve: one tool call of a chat answer, parsed by mlx-lm's tool parser of the model's
    family. ``arguments`` is a JSON object's text; ``id`` only when the model named one."""

    kind = "tool_call"
    request: str
    index: int
    name: str
    arguments: str
    id: str | None = None


@dataclass
class Counted:
    """Serve: the prompt tokens of a request that only counts them (count_tokens)."""

    kind = "counted"
    request: str
    prompt_tokens: int


@dataclass
class Admitted:
    """Serve: a request joined the ranks' batch (or began alone): its prompt's tokens, and
    how many of them came from the prompt cache. An Anthropic stream's message_start reports
    them, as Anthropic's does, before the first token."""

    kind = "admitted"
    request: str
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass
class Refused:
    """Serve: a request rank 0 cannot take (found with the tokenizer: a template that does not
    render, an empty prompt); the API answers it with this status."""

    kind = "refused"
    request: str
    status: int
    message: str
    grammar: str | None = None  # its grammar failed: that grammar's digest (Failures)


@dataclass
class Memory:
    kind = "memory"
    peak_memory_gb: float
    disk_read_bytes: int | None = None  # the prompt cache's disk tier on this rank, so far
    disk_written_bytes: int | None = None
    handoff_bytes: int | None = None  # a decode rank's: handed-off KV its door holds now


@dataclass
class Notice:
    """A line for the user's stderr."""

    kind = "notice"
    message: str


@dataclass
class LinkReport:
    """``doctor --links``: each link the backend uses, and all_sum over the whole group."""

    kind = "link_report"
    links: list[dict[str, Any]]  # a, b, rtt_4b_us, ..., gbps, bad_words (node.links.FIELDS)
    allsum_4b_us: float
    allsum_8kb_us: float
    allsum_bad_words: float
    pattern_bytes: int = 64 * 2**20  # sent one way per link: the bandwidth and exactness check


@dataclass
class AwaitingInput:
    """Chat: rank 0 waits for the next turn (the launcher shows a prompt on a terminal)."""

    kind = "awaiting_input"


@dataclass
class Gpu:
    """A rank on a host with NVIDIA GPUs: the GPU its MLX device is (the first of
    CUDA_VISIBLE_DEVICES, else 0) as nvidia-smi names it, and whether MLX runs on the GPU
    (its CUDA build). Said once, as the rank starts (cluster.core.gpus)."""

    kind = "gpu"
    index: int
    name: str
    memory_gb: float
    mlx_cuda: bool


@dataclass
class Wake:
    """Rank 0 has work after a rest (serve's idle rounds, chat's wait for the user): the
    launcher writes WAKE to every other rank."""

    kind = "wake"


@dataclass
class Error:
    kind = "error"
    message: str
    t: float  # the rank's clock: who failed first
    peer: bool = False  # an effect of another rank's failure, never the cause
    cause: str | None = None  # "model": the model cannot be served as asked (bad input);
    # "setup": this host cannot run the job as asked (its message says what to do)


@dataclass
class BenchRun:
    kind = "bench_run"
    run: int
    warmup: bool
    tokens_sha: str
    ttft_s: float
    prefill_tps: float
    generation_tps: float | None
    generated: int
    draft_n: int | None = None  # with speculative decoding: tokens drafted, and accepted
    draft_n_accepted: int | None = None


@dataclass
class BenchComm:
    kind = "bench_comm"
    counts: dict[str, int]
    allsum_bytes: int | None = None
    allsum_latency_s: float | None = None
    allsum_latency_min_s: float | None = None
    allsum_samples: int | None = None


@dataclass
class Cached:
    """Serve: the prompt prefixes rank 0's prompt cache holds now (cluster.core.prefix's
    link names; at most ``MOST_CACHED`` each tier), for the fleet's router.
    Sent when they change, whole (a router that missed one is right again at the next)."""

    kind = "cached"
    links: list[str]
    disk: list[str] = field(default_factory=list)  # of prompts written to the disk tier
    # since the ranks started (they stay there across restarts)


@dataclass
class Handed:
    """Serve, a prefill group's rank 0: a prompt prefilled and its KV sent to the decode
    group's ranks (``error``: it was not, and the decode group prefills it itself, unless
    the error is CANCELLED: its client left, and the prefill stopped at a chunk's end)."""

    kind = "handed"
    request: str
    ticket: str
    tokens: int
    nbytes: int
    seconds: float
    error: str | None = None
    lasting: bool = False  # the error holds for every prompt: these groups cannot hand off


CANCELLED = "cancelled"  # Handed.error of a prefill stopped because its client left


@dataclass
class Forgot:
    """Serve, a decode group's rank 0: it gave up waiting for a request's handed-off KV (the
    prefill group failed, the request was cancelled, nothing came in time, a rank's door
    refused it) and forgot its ticket on every rank; the launcher cancels the prefill
    group's copy, so no one prefills and sends what no one will take."""

    kind = "forgot"
    request: str
    ticket: str
    why: str


MOST_CACHED = 4096  # links one Cached event names (the most recent first)


Event = (
    Beat
    | Phase
    | Ready
    | FirstToken
    | Prefill
    | Stats
    | Serving
    | Piece
    | ToolCall
    | Counted
    | Admitted
    | Refused
    | Handed
    | Forgot
    | Memory
    | Notice
    | AwaitingInput
    | Gpu
    | Wake
    | Error
    | BenchRun
    | BenchComm
    | LinkReport
    | Cached
)
EVENTS: dict[str, type] = {cls.kind: cls for cls in typing.get_args(Event)}
# What only rank 0 says: the answers' text and ends, the serve and chat loop's own events.
# The same from another rank is that rank's fault (a Wake from rank k would write WAKE into
# rank 0's request channel, and the launcher would take its Pieces as an answer's).
RANK0_ONLY = (Piece, ToolCall, Counted, Admitted, Refused, Serving, Wake, Stats, Prefill,
              FirstToken, AwaitingInput, BenchRun, LinkReport, Cached, Forgot)  # fmt: skip


class BadEvent(ValueError):
    """A stderr line that starts as an event but is none: unknown, malformed, of the wrong
    types, or sent by a rank that may not send it. The rank that sent it is at fault."""


def encode_event(event: Event) -> str:
    return EVENT_PREFIX + json.dumps({"event": event.kind, **to_dict(event)}) + "\n"


def decode_event(line: str, rank: int = 0) -> Event | None:
    """The event of ``rank``'s stderr line, or None for an ordinary log line; BadEvent for
    a line that starts as an event and is not a valid one (checked here, once, so that no
    part of the launcher meets a field it cannot use)."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        data = json.loads(line[len(EVENT_PREFIX) :])
        if not isinstance(data, dict) or not isinstance(data.get("event"), str):
            raise BadEvent("not an object naming its event")
        name = data.pop("event")
        if name not in EVENTS:
            raise BadEvent(f"no event {name[:40]!r}")
        event: Event = from_dict(EVENTS[name], data)
    except BadEvent:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise BadEvent(str(e)[:300]) from None
    if rank != 0 and isinstance(event, RANK0_ONLY):
        raise BadEvent(f"a {event.kind} event, which only rank 0 may send")
    if isinstance(event, Stats):
        check_stats(event)
    return event


STATS_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
STATS_TIMINGS = ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                 "predicted_per_second", "cache_n")  # fmt: skip
STATS_OPTIONAL = ("cache_disk_n", "draft_n", "draft_n_accepted")


def check_stats(stats: Stats) -> None:
    """The usage and timings an answer's stats must hold (node.decode.loop.answer_stats
    writes them), each a number: the stats line, /metrics and the API's usage read them."""

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0

    for where, names, got in (("usage", STATS_USAGE, stats.usage),
                              ("timings", STATS_TIMINGS, stats.timings)):  # fmt: skip
        missing = [n for n in names if not number(got.get(n))]
        if missing:
            raise BadEvent(f"stats: {where}.{missing[0]} is not a number")
    for name in STATS_OPTIONAL:
        if name in stats.timings and not number(stats.timings[name]):
            raise BadEvent(f"stats: timings.{name} is not a number")
    details = stats.usage.get("prompt_tokens_details", {})
    if not isinstance(details, dict) or not number(details.get("cached_tokens", 0)):
        raise BadEvent("stats: usage.prompt_tokens_details.cached_tokens is not a number")


def event_fields(event: Event) -> dict[str, Any]:
    """The fields of an event as a dict (bench rows keep them)."""
    return dataclasses.asdict(event)
