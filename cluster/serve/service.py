"""The requests of `serve` and the running job's channel: the API (cluster/serve/http.py)
hands each request to ``Service``, which sends it to rank 0 once the ranks are ready and
routes rank 0's events back to it; the supervisor (cluster/serve/supervisor.py) starts the job
and starts it again when it fails.

Requests wait in ``pending`` while no job is ready (at start, during a restart); a ready rank 0
gets each one as a JSON line on its channel and answers with events (node/jobs/serve.py). When the
job fails, what rank 0 was answering is decided here: a request whose client has seen nothing
yet (any non-streaming one, a stream before its first text) is decoded again after the
restart; a stream under way ends with an error event and ``[DONE]`` (its tokens are not
resumed: a sampled answer could not be reproduced, and a greedy one may differ after a
re-plan). A request waits at most ``restart_wait`` for ranks, then gets 503 with Retry-After.

A host that stopped answering is left out of the restarted job when the model fits in the
``memory_gb`` of the hosts left (``/health`` then says degraded); otherwise the restart waits
for it with backoff. More than ``max_restarts`` failures within ``restart_window_s`` end
``serve`` with exit 1 and each failure named.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from cluster.core.grammar import Failures, digest
from cluster.core.hostfile import Hostfile
from cluster.core.modelcheck import model_id
from cluster.core.prefix import CHARS_PER_TOKEN
from cluster.core.protocol import (
    END_OF_INPUT,
    MOST_CACHED,
    Admitted,
    Cached,
    Counted,
    Event,
    Forgot,
    Handed,
    LinkReport,
    Piece,
    Prefill,
    Ready,
    Refused,
    Serving,
    Stats,
    ToolCall,
)
from cluster.core.spec import JobSpec, to_dict
from cluster.job.launcher import (
    LaunchError,
    log,
)
from cluster.job.signals import Running
from cluster.job.state import JobState
from cluster.serve.api.shared import END, RESTART, ApiRequest, Door, RequestError
from cluster.serve.metrics import Metrics

REAP_EVERY_S = 0.25
# the router's characters per prompt token: the median of the last LEARN_SAMPLES of rank 0's
# counts, each sample held to [MOST_DENSE, LEAST_DENSE] (one odd prompt cannot move it)
LEARN_SAMPLES = 32
MOST_DENSE, LEAST_DENSE = 0.5, 12.0
MOST_FAILURES_SEEN = 1  # a request under way at this many failures is not decoded again
ASK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Load:
    """What a group holds, as the fleet's router weighs it."""

    prompt_tokens: int = 0  # still to prefill
    streams: int = 0  # answers streaming
    requests: int = 0  # waiting or under way


def estimate_tokens(req: ApiRequest, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """A request's prompt tokens to prefill before rank 0 counts them: what the router
    reckoned (its characters less the prefix its group caches, over the group's characters
    per token), else its characters over ``chars_per_token``."""
    if req.to_prefill is not None:
        return req.to_prefill
    return int(req.chain[-1].chars / chars_per_token) if req.chain else 0


@dataclass
class Failure:
    at: float  # time.time()
    message: str  # the launcher's report, first line
    back_after_s: float | None = None  # until the ranks served again
    in_flight: list[str] = field(default_factory=list)  # requests rank 0 held then
    dropped: list[str] = field(default_factory=list)  # of those, given up (not replayed)


ANSWERS_KEPT = 2000  # the last answers /v1/cluster's rates and latencies come from


@dataclass
class Answered:
    """One answered request, as the page's figures need it."""

    at: float  # time.time() of its end
    prompt_tokens: int
    prompt_s: float  # its prefill
    completion_tokens: int
    decode_s: float
    ttft_s: float | None
    handoff_bytes: int = 0  # its KV cache as a prefill group sent it (issue 53); 0: none
    handoff_s: float | None = None  # from the first frame to its adoption

    @classmethod
    def of(cls, stats: Stats, at: float) -> Answered:
        t = stats.timings
        handed = "handoff_n" in t
        return cls(at, t.get("prompt_n", 0), t.get("prompt_ms", 0.0) / 1000,
                   t.get("predicted_n", 0), t.get("predicted_ms", 0.0) / 1000,
                   stats.time_to_first_token_s, int(t.get("handoff_bytes", 0)) if handed else 0,
                   t.get("handoff_ms", 0.0) / 1000 if handed else None)  # fmt: skip


@dataclass
class Flight:
    """The launcher's side of a request's flight, from the line sent to rank 0 to its end
    (rank 0's side: node.jobs.serve.Flight)."""

    req: ApiRequest
    shown: bool = False  # text reached the client's queue
    last: float = 0.0  # when the last text came
    gone: bool = False  # the client left; its end is dropped
    sent: float = field(default_factory=time.monotonic)  # when it went to rank 0
    prefill: tuple[int, int] | None = None  # prompt tokens prefilled, of: while rank 0 does


@dataclass
class MeasuredLinks:
    """The links of the running ranks as they measured them at start-up, and each rank's host."""

    report: LinkReport
    hosts: list[str]
    at: float  # when (time.time())


class Service:
    """The requests, the running job's channel and what /health and /metrics say.

    One thread (``loop``) owns all of it: the HTTP threads (submit, cancel, health), the
    launcher (attach, on_event, draining) and the supervisor (job_ended, close) post calls
    to ``calls`` and the loop runs them one at a time, in the order they came, so the order
    of events is the order of the code (a drain after a request reaches rank 0 after it).
    Tests make it with ``thread=False``: each call then runs at once, on the caller's
    thread, so a test is a plain sequence of events."""

    def __init__(self, hostfile: Hostfile, spec: JobSpec, stderr: IO[str], thread: bool = True,
                 metrics: Metrics | None = None, group: int = 0):  # fmt: skip
        self.group = group  # its index in a fleet (cluster.serve.fleet); 0 alone
        self.model_id = model_id(spec.model)
        self.spec = spec
        self.settings = spec.serve
        self.door = Door(
            frozenset({self.model_id, spec.model}),
            spec.serve.max_tokens_cap,
            self.model_id,
            tuple(spec.serve.served_model_name),
            spec.serve.default_max_tokens,
        )
        self.private = private_paths(spec.model, self.model_id)
        self.stderr = stderr
        self.hosts_total = len(hostfile.hosts)
        self.all_hosts = list(hostfile.hosts)  # the hostfile's, those left out included
        self.hostfile = hostfile  # the hosts of the current job
        self.answers: deque[Answered] = deque(maxlen=ANSWERS_KEPT)  # for /v1/cluster's figures
        self.doors: dict[int, int] = {}  # a decode group's ranks' handoff ports (issue 53)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()  # reentrant: signal handlers post
        self.pending: deque[ApiRequest] = deque()
        self.waiting_since: dict[str, float] = {}
        self.inflight: dict[str, Flight] = {}
        self.outbox: queue.Queue[bytes | None] | None = None
        self.state: JobState | None = None
        self.ready = False
        self.draining_now = False
        self.closed = False
        self.failures: list[Failure] = []
        self.links: MeasuredLinks | None = None  # the current ranks' (--measure-links)
        self.bad_grammars = Failures()  # grammars whose answers failed lately: refused at the door
        self.failed_at: float | None = None
        self.served = False  # the ranks were ready once: a later failure is restarted
        self.url = ""
        self.metrics = metrics or Metrics(lambda: list(self.state.ranks) if self.state else [])
        # for a fleet's router (cluster.serve.fleet), read from other threads: each is
        # replaced whole, never changed in place
        self.cached: frozenset[str] = frozenset()  # rank 0's cached prefixes (Cached)
        self.on_disk: dict[str, None] = {}  # links rank 0 wrote to its disk tier, oldest first
        self.answered = 0  # answers that ended with their stats
        # the model's characters per prompt token, learned from rank 0's counts (Admitted):
        # the router's estimate of a prompt's tokens before rank 0 counts them
        self.chars_per_token = float(CHARS_PER_TOKEN)
        self.density: deque[float] = deque(maxlen=LEARN_SAMPLES)  # rank 0's recent counts
        self.load = Load()  # the work it holds, measured after each call on its loop
        # a fleet's: the requests a failed or closed group cannot answer now go to the others
        # (called on this loop with them; returns those it could not place)
        self.reroute: Callable[[Service, list[ApiRequest]], list[ApiRequest]] | None = None
        self.running: Running | None = None  # the job's of the job under way (fleet: signals)
        self.threaded = thread
        if thread:
            threading.Thread(target=self.loop, daemon=True, name="serve").start()

    # posting (any thread)

    def post(self, fn, *args) -> None:
        if not self.threaded:
            return self.run_one((fn, args, None))
        self.calls.put((fn, args, None))

    def ask(self, fn, *args):
        """Run ``fn`` on the loop and return its result (what another thread may read)."""
        if not self.threaded:
            return fn(*args)
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self.calls.put((fn, args, answer))
        return answer.get(timeout=ASK_TIMEOUT_S)

    def loop(self) -> None:
        while True:
            try:
                self.run_one(self.calls.get(timeout=REAP_EVERY_S))
            except queue.Empty:
                pass
            self.reap(time.monotonic())

    def run_one(self, call) -> None:
        fn, args, answer = call
        try:
            result = fn(*args)
        except Exception as e:  # a bug here must not stop the loop that every request needs
            log(self.stderr, f"serve: internal error in {fn.__name__}: {e!r}")
            result = e
        if answer is not None:
            answer.put(result)
        self.load = self.measure_load()

    def measure_load(self) -> Load:
        """The prompt tokens it still has to prefill (estimated from the characters until
        rank 0 counted them) and the answers it is streaming."""
        cpt = self.chars_per_token
        tokens, streams = sum(estimate_tokens(r, cpt) for r in self.pending), 0
        for flight in self.inflight.values():
            req = flight.req
            if flight.shown:
                streams += 1
            elif flight.prefill is not None:
                tokens += max(0, flight.prefill[1] - flight.prefill[0])
            elif req.admitted is not None:
                tokens += max(0, req.admitted[0] - req.admitted[1])
            else:
                tokens += estimate_tokens(req, cpt)
        return Load(tokens, streams, len(self.pending) + len(self.inflight))

    # the API's side

    def submit(self, req: ApiRequest) -> None:
        self.post(self.take, req)

    def refused_grammar(self, request) -> RequestError | None:
        """A 400 for a request whose grammar's answer failed lately (any thread: Failures
        holds its own lock); None otherwise."""
        constraint = request.constraint
        if constraint is None or constraint.grammar is None:
            return None
        why = self.bad_grammars.why(digest(constraint.grammar).hex())
        return None if why is None else RequestError(400, f"'{constraint.source}': {why}")

    def cancel(self, req: ApiRequest, counted: bool = True) -> None:
        """The client went away: rank 0 drops its request at its next round (``counted``:
        in /metrics; a prefill group's copy of a request is not counted again)."""
        self.post(self.drop, req, counted)

    def health(self) -> dict:
        return self.ask(self.describe)

    def cluster(self) -> dict:
        """/v1/cluster: /health's and the page's figures (cluster.serve.overview)."""
        return self.ask(self.overview)

    # the job's side (cluster.job.launcher.JobLink)

    def attach(self, send, state: JobState) -> None:
        outbox: queue.Queue[bytes | None] = queue.Queue()

        def pump() -> None:
            while (line := outbox.get()) is not None:
                try:
                    send(line)
                except (OSError, ValueError, EOFError, AttributeError):
                    return  # rank 0 is gone: the launcher reports it and the job ends

        threading.Thread(target=pump, daemon=True, name="to-rank0").start()
        self.ask(self.attached, outbox, state)

    def draining(self, tell: bool = False) -> None:
        """Refuse new requests; with ``tell``, ask rank 0 to drain after what it was sent."""
        self.post(self.start_drain, tell)

    def handoff_doors(self) -> list[list] | None:
        """Where a prefill group sends this group's KV: each rank's [address, port], once
        every rank of the running job opened its door (None until then)."""
        hosts = [h.address for h in self.hostfile.hosts for _ in range(h.slots)]
        if not self.ready or sorted(self.doors) != list(range(len(hosts))):
            return None
        return [[hosts[r], self.doors[r]] for r in range(len(hosts))]

    def on_event(self, rank: int, event: Event) -> None:
        self.post(self.event, rank, event, time.monotonic())

    # the supervisor's side

    def job_ended(self, error: LaunchError | None) -> None:
        """The ranks are all stopped: decide the fate of what rank 0 held (waits for it)."""
        self.ask(self.ended, error)

    def close(self, why: str) -> None:
        """No more jobs: whatever waits gets 503."""
        self.ask(self.closing, why)

    # the loop's own: every change of state is here

    def take(self, req: ApiRequest) -> None:
        if self.draining_now or self.closed:
            self.refuse(req, RequestError(503, "the server is shutting down", "server_error"))
        elif self.ready:
            self.send(req)
        else:
            self.pending.append(req)
            self.waiting_since[req.id] = time.monotonic()
            self.metrics.waiting(self.group, len(self.pending))

    def drop(self, req: ApiRequest, counted: bool = True) -> None:
        req.let_go()
        if req in self.pending:
            self.pending.remove(req)
            self.metrics.waiting(self.group, len(self.pending))
        flight = self.inflight.get(req.id)
        if flight is not None and not flight.gone:
            flight.gone = True
            self.write({"op": "cancel", "id": req.id})
        if counted:
            self.metrics.finished("cancelled")

    def describe(self) -> dict:
        if self.draining_now:
            status = "draining"
        elif self.ready:
            status = "degraded" if len(self.hostfile.hosts) < self.hosts_total else "ok"
        else:
            status = "restarting" if self.failures else "starting"
        now = time.monotonic()
        ranks = [
            {
                "rank": s.rank,
                "host": s.host,
                "phase": s.phase if s.exit_code is None else f"exited {s.exit_code}",
                "heartbeat_age_s": round(now - s.last_seen, 3) if s.last_seen else None,
                "peak_memory_gb": s.peak_memory_gb,
            }
            for s in (self.state.ranks if self.state else [])
        ]
        last = self.failures[-1] if self.failures else None
        return {
            "status": status,
            "model": self.model_id,
            "mode": self.spec.mode,
            "ranks": len(ranks),
            "ranks_up": sum(1 for r in ranks if r["phase"] in ("ready", "generating")),
            "hosts": len(self.hostfile.hosts),
            "hosts_in_hostfile": self.hosts_total,
            "rank_states": ranks,
            "restarts": len(self.failures),
            "last_failure": dataclasses.asdict(last) if last else None,
            "dropped_after_failures": [i for f in self.failures for i in f.dropped],
            "waiting": len(self.pending),
            "in_flight": len(self.inflight),
            "prefilling": [
                {"id": f.req.id, "done": f.prefill[0], "total": f.prefill[1]}
                for f in self.inflight.values()
                if f.prefill is not None and not f.shown
            ],
        }

    def overview(self) -> dict:
        from cluster.serve.overview import overview

        return overview(self, time.time())

    def attached(self, outbox: queue.Queue, state: JobState) -> None:
        self.outbox, self.state = outbox, state

    def start_drain(self, tell: bool) -> None:
        self.draining_now = True
        if tell and self.outbox is not None:
            self.outbox.put(END_OF_INPUT)

    def event(self, rank: int, event: Event, now: float) -> None:
        if isinstance(event, Ready) and event.door is not None:
            self.doors[rank] = event.door
            return
        if isinstance(event, Forgot):  # the decode group prefills it itself, or it ended
            forgot = self.inflight.get(event.request)
            if forgot is not None and forgot.req.drop_copy is not None:
                log(self.stderr, f"request {event.request}: its handoff was given up "
                    f"({event.why}); its prefill group's copy is cancelled")  # fmt: skip
                forgot.req.let_go()
            return
        if isinstance(event, Handed):
            handed = self.inflight.pop(event.request, None)
            if handed is not None:
                if handed.req.on_handed is not None:
                    handed.req.on_handed(event)
                handed.req.chunks.put(END)
            return
        if isinstance(event, Serving):
            self.became_ready(event, now)
            return
        if isinstance(event, Cached):
            for name in event.disk:  # the disk tier outlives a restart: kept until then
                self.on_disk.pop(name, None)
                self.on_disk[name] = None
            while len(self.on_disk) > MOST_CACHED:
                self.on_disk.pop(next(iter(self.on_disk)))
            self.cached = frozenset(event.links) | frozenset(self.on_disk)
            return
        if isinstance(event, LinkReport):
            hosts = [s.host for s in self.state.ranks] if self.state else []
            self.links = MeasuredLinks(event, hosts, time.time())
            return
        flight = self.inflight.get(getattr(event, "request", None) or "")
        if flight is None:
            return
        req = flight.req
        if isinstance(event, Prefill):
            flight.prefill = (event.done, event.total)
        elif isinstance(event, Admitted):
            req.admitted = (event.prompt_tokens, event.cached_tokens)
            if req.chain and event.prompt_tokens > 0 and req.chain[-1].chars > 0:
                seen = req.chain[-1].chars / event.prompt_tokens
                self.density.append(min(LEAST_DENSE, max(MOST_DENSE, seen)))
                self.chars_per_token = statistics.median(self.density)
        elif isinstance(event, (Piece, ToolCall)):
            if not flight.shown:
                self.metrics.ttft.observe(now - req.arrived)
            else:
                self.metrics.token_latency.observe(now - flight.last)
            flight.shown, flight.last = True, now
            req.chunks.put(event)
        elif isinstance(event, Counted):
            del self.inflight[req.id]
            req.let_go()
            req.result = {"prompt_tokens": event.prompt_tokens}
            req.chunks.put(END)
            self.metrics.finished(200)
        elif isinstance(event, Stats):
            del self.inflight[req.id]
            req.let_go()
            req.result = to_dict(event)
            if req.handed and "handoff_n" in req.result.get("timings", {}):
                req.result["timings"].update(req.handed)  # which group prefilled it
            req.chunks.put(END)
            self.answered += 1
            if not flight.gone:
                self.metrics.answered(event.usage, event.timings)
                self.answers.append(Answered.of(event, time.time()))
        elif isinstance(event, Refused):
            del self.inflight[req.id]
            if event.grammar is not None:
                self.bad_grammars.add(event.grammar, event.message)
            kind = "server_error" if event.status >= 500 else "invalid_request_error"
            self.refuse(req, RequestError(event.status, event.message, kind))

    def became_ready(self, event: Serving, now: float) -> None:
        self.ready = self.served = True
        how = "batched" if event.batched else "one request at a time (its caches cannot be batched)"
        back = ""
        if self.failed_at is not None:
            self.failures[-1].back_after_s = round(now - self.failed_at, 2)
            back = f"; back {now - self.failed_at:.1f} s after the failure"
            self.failed_at = None
        hosts = len(self.hostfile.hosts)
        fewer = (
            f", degraded: {hosts} of {self.hosts_total} hosts" if hosts < self.hosts_total else ""
        )
        log(self.stderr, f"serving {self.model_id} on {self.url}, {how}{fewer}{back}")
        while self.pending:
            self.send(self.pending.popleft())
        self.waiting_since.clear()
        self.metrics.waiting(self.group, 0)

    def ended(self, error: LaunchError | None) -> None:
        """A request rank 0 held whose client has seen nothing yet (any non-streaming one,
        a stream before its first text) is decoded again after the restart, once: one that
        was under way at an earlier failure too gets an error instead (it may be what makes
        the ranks fail). A stream under way ends with an error event."""
        self.ready = False
        self.links = None  # the next ranks measure theirs
        self.doors = {}  # and open their own doors
        self.cached = frozenset(self.on_disk)  # the memory tier is gone with the ranks
        if self.outbox is not None:
            self.outbox.put(None)
        self.outbox = None
        if error is None:
            return
        why = first_line(error) or "the ranks failed"
        self.failed_at = time.monotonic()
        failure = Failure(time.time(), first_line(error), in_flight=list(self.inflight))
        self.failures.append(failure)
        again, cut = [], 0
        for flight in self.inflight.values():
            req = flight.req
            if flight.gone:
                continue
            if req.on_handed is not None:  # a prefill group's: its decode group prefills it
                self.refuse(req, RequestError(502, f"the prefill group failed: {why}"))
                continue
            req.failures_seen += 1
            req.let_go()  # its KV went to ranks that are gone, or it ends here
            if req.stream and flight.shown:
                message = f"the answer was cut: {why}; the ranks restart; send the request again"
                req.chunks.put(self.public(RequestError(502, message, "server_error")))
                self.metrics.finished("stream_error")
                cut += 1
            elif req.failures_seen > MOST_FAILURES_SEEN:
                failure.dropped.append(req.id)
                message = (
                    f"the ranks failed {req.failures_seen} times while this request was under "
                    f"way (last: {why}); it is not decoded again"
                )
                self.refuse(req, RequestError(500, message, "server_error"))
                log(
                    self.stderr,
                    f"request {req.id} was under way at {req.failures_seen} failures of the "
                    "ranks: answered with an error, not replayed",
                )
            else:
                if flight.shown:
                    req.chunks.put(RESTART)
                if req.request.handoff is not None:  # the KV went to ranks that are gone
                    req.request = dataclasses.replace(req.request, handoff=None)
                    req.handed = None
                again.append(req)
        self.inflight.clear()
        now = time.monotonic()
        for req in reversed(again):  # first in line, in their order of arrival
            self.pending.appendleft(req)
            self.waiting_since[req.id] = now
        self.hand_over()
        if again or cut or failure.dropped:
            log(
                self.stderr,
                f"of the answers under way: {len(again)} request(s) to decode again, "
                f"{cut} stream(s) cut, {len(failure.dropped)} given up",
            )

    def hand_over(self) -> None:
        """A fleet's group that cannot answer now gives its waiting requests to the others."""
        if self.reroute is not None and self.pending:
            kept = self.reroute(self, list(self.pending))
            stay = {id(r) for r in kept}
            for req in self.pending:
                if id(req) not in stay:
                    self.waiting_since.pop(req.id, None)
            self.pending = deque(kept)
        self.metrics.waiting(self.group, len(self.pending))

    def closing(self, why: str) -> None:
        self.closed = True
        self.hand_over()
        for req in self.pending:
            self.refuse(req, RequestError(503, why, "server_error"))
        self.pending.clear()
        for flight in self.inflight.values():
            self.refuse(flight.req, RequestError(503, why, "server_error"))
        self.inflight.clear()

    def reap(self, now: float) -> None:
        """Requests past the restart wait get 503 with Retry-After; requests under way past
        --request-timeout get 504 and are dropped on the ranks."""
        for flight in list(self.inflight.values()):
            if now - flight.sent > self.settings.request_timeout:
                req = flight.req
                del self.inflight[req.id]
                if flight.gone:  # its client left and rank 0 was told: nobody waits for it
                    continue
                self.write({"op": "cancel", "id": req.id})
                why = (f"no complete answer within {self.settings.request_timeout:g} s "
                       "(serve --request-timeout); the ranks dropped it")  # fmt: skip
                self.refuse(req, RequestError(504, why, "server_error"))
                log(self.stderr, f"request {req.id}: {why}")
        late = [
            j
            for j in self.pending
            if now - self.waiting_since.get(j.id, now) > self.settings.restart_wait
        ]
        for req in late:
            self.pending.remove(req)
            status = "restarting" if self.failures else "starting"
            message = (
                f"the ranks are not ready after {self.settings.restart_wait:g} s "
                f"({status}); retry later"
            )
            self.refuse(req, RequestError(503, message, "server_error", retry_after=10))
        if late:
            self.metrics.waiting(self.group, len(self.pending))

    def send(self, req: ApiRequest) -> None:
        """To rank 0; a request that cannot be written as a line fails alone (before it is
        in flight: nothing would ever end it)."""
        try:
            line = json.dumps({"op": "request", "request": to_dict(req.to_rank0())})
        except (ValueError, TypeError, RecursionError) as e:
            message = f"the request cannot be passed to the ranks ({type(e).__name__})"
            self.refuse(req, RequestError(400, message))
            return
        self.inflight[req.id] = Flight(req)
        if self.outbox is not None:
            self.outbox.put(line.encode() + b"\n")

    def write(self, message: dict) -> None:
        if self.outbox is not None:
            self.outbox.put(json.dumps(message).encode() + b"\n")

    def refuse(self, req: ApiRequest, e: RequestError) -> None:
        req.let_go()
        if req.on_handed is not None:  # a handoff that will not come: told to its decode group
            req.on_handed(Handed(req.id, "", 0, 0, 0.0, str(e)))
        req.chunks.put(self.public(e))
        self.metrics.finished(e.status)

    def public(self, e: RequestError) -> RequestError:
        """The error as a client may read it: no folder of this machine in it (the model's
        path becomes its id, the home folder ~)."""
        text = str(e)
        for path, shown in self.private:
            text = text.replace(path, shown)
        if text == str(e):
            return e
        return RequestError(e.status, text, e.kind, e.retry_after)


def private_paths(model: str, shown: str) -> list[tuple[str, str]]:
    """(text, what a client sees instead): the model's folder, as given and resolved, and
    the home folder; longest first, so a folder inside another is replaced whole."""
    out = {}
    folder = Path(model).expanduser()
    if folder.exists():
        for p in {model, str(folder), str(folder.resolve())}:
            if len(p) > 1:
                out[p] = shown
    home = str(Path.home())
    if len(home) > 1:
        out[home] = "~"
    return sorted(out.items(), key=lambda item: -len(item[0]))


def first_line(error: LaunchError) -> str:
    lines = [x for x in str(error).splitlines() if x.strip()]
    return lines[0].removeprefix("error: ") if lines else ""
