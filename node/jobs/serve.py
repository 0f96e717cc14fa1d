"""`mlx-cluster serve`, the ranks' side: rank 0 schedules, every rank decodes in lockstep.

The HTTP API in_batch in the launcher (cluster/serve/http.py), so that it outlives the ranks. The
launcher sends rank 0 each request as one JSON line on its channel (stdin, through
node.rank.watchdog's watcher): ``{"op": "request", ...}`` (a cluster.core.spec.ServeRequest) or
``{"op": "cancel", "id": ...}``; END_OF_INPUT asks for a drain. Rank 0 answers with events:
``Piece`` (the next text of a request, in its channel: reasoning or content), ``ToolCall`` (a
tool call parsed from it, node.decode.parts), ``Stats`` (its end, with its id), ``Counted`` (the
prompt tokens of a request that only counts them) and ``Refused`` (a request it cannot take:
a template that does not render).

Rank 0's main thread turns requests into prompt tokens and, once a round, shares an order with
the other ranks (share_object, plain JSON: nothing from the network is ever unpickled): which
requests join the batch, which leave it. Every rank applies it to the same mlx-lm
BatchGenerator (node/jobs/batch.py), so all decode the batch in lockstep; between requests the
other ranks wait in share_object, and an idle rank 0 meets them every PING_S.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from cluster.core.grammar import Failures, digest
from cluster.core.handoff import tokens_digest
from cluster.core.modelcheck import model_id
from cluster.core.prefix import prefix_chain
from cluster.core.protocol import (
    END_OF_INPUT,
    MOST_CACHED,
    Admitted,
    Cached,
    Counted,
    Forgot,
    Handed,
    Memory,
    Notice,
    Prefill,
    Refused,
    Serving,
    Stats,
    Wake,
)
from cluster.core.spec import (
    Adopt,
    Expect,
    Grammar,
    JobSpec,
    Order,
    PrefillOrder,
    Sampling,
    ServeRequest,
    ServeSetup,
    SharedRequest,
    from_dict,
    to_dict,
)
from node.decode.grammar import Budget, Constrained, GrammarFailed, compiling
from node.decode.loop import answer_stats
from node.decode.parts import Parts, token_logprobs
from node.decode.sampling import RequestFailed, seeded, tried
from node.decode.text import AnswerText, answer_text
from node.decode.toolcalls import json_answer
from node.jobs import Job
from node.rank.watchdog import progress

PING_S = 2.0  # without a launcher to wake them, idle ranks meet this often (a ping)
ORDER_BYTES = 32 << 20  # an order's requests, encoded: more wait for the next round
MEMORY_EVERY_S = 5.0  # each rank reports its peak memory this often (the API's /metrics)
HANDOFF_WAIT_S = 120.0  # a decode group prefills a handed-off prompt itself when nothing of it
# came for this long (from the request, then from its last frame: a long prefill takes minutes)


@dataclass
class Flight:
    """Rank 0's side of a request's flight, from its line to its end (the launcher's side:
    cluster.serve.service.Flight)."""

    request: ServeRequest
    cancel: threading.Event = field(default_factory=threading.Event)
    parts: Parts | None = None  # its text as the API returns it (set once it is prepared)
    shared: SharedRequest | None = None  # what every rank gets (once prepared)
    size: int = 0  # bytes of ``shared`` as share_object sends it
    handed: str = ""  # a handed-off prompt's tokens_digest (made on the prepare thread)


class Inbox:
    """Rank 0's channel from the launcher, read on a thread: requests go to ``prepare`` (on a
    thread of its own: templates and tokenization never run on the decode loop), cancels onto
    their flights, END_OF_INPUT (or the end of the channel) into ``draining`` once every request
    before it is prepared."""

    def __init__(self, stream: IO[bytes], log: Callable[[str], None], prepare=None,
                 failed: Callable[[str, str], None] = lambda request, why: None):  # fmt: skip
        self.flights: queue.Queue[Flight | None] = queue.Queue()  # prepared; None wakes the loop
        self.known: dict[str, Flight] = {}  # not yet ended, by id
        # tickets whose KV will not come (issue 53), with when that came: a line may come before
        # its request does; kept HANDOFF_WAIT_S (the next such line prunes older ones)
        self.handoffs_failed: dict[str, float] = {}
        self.draining = threading.Event()
        self.prepared_all = threading.Event()  # every request before the drain is in ``flights``
        self.log = log
        # a Flight -> the Flight ready to schedule, or None
        self.prepare = prepare or (lambda flight: flight)
        self.failed = failed  # (request id, why): its answer is an error (500)
        self.lines: queue.Queue[Flight | None] = queue.Queue()  # to prepare; None: drain
        self.stream = stream  # held: its descriptor must stay ours while the reader reads it
        fd = stream.fileno()
        threading.Thread(target=self.read, args=(fd,), daemon=True, name="inbox").start()
        threading.Thread(target=self.prepare_all, daemon=True, name="prepare").start()

    def read(self, fd: int) -> None:
        """Lines until the channel ends, in order: the requests before END_OF_INPUT are
        served, the drain comes after them; cancels still count after it (a client that
        leaves while the drain finishes its answer)."""
        buffer = b""
        try:
            while data := os.read(fd, 65536):
                while END_OF_INPUT in data:
                    before, data = data.split(END_OF_INPUT, 1)
                    self.lines_of(buffer + before, final=True)
                    buffer = b""
                    self.drain()
                buffer = self.lines_of(buffer + data)
        except OSError:
            pass
        self.drain()

    def lines_of(self, data: bytes, final: bool = False) -> bytes:
        *lines, rest = data.split(b"\n")
        for line in [*lines, rest] if final else lines:
            self.take(line)
        return b"" if final else rest

    def drain(self) -> None:
        if not self.draining.is_set():
            self.draining.set()
            self.lines.put(None)

    def take(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            message = json.loads(line)
            if message.get("op") == "cancel":
                if flight := self.known.get(message["id"]):
                    flight.cancel.set()
                return
            if message.get("op") == "handoff_failed":  # its prompt is prefilled here instead
                now = time.monotonic()
                for ticket, at in list(self.handoffs_failed.items()):  # its request never came
                    if now - at > HANDOFF_WAIT_S:
                        self.handoffs_failed.pop(ticket, None)
                self.handoffs_failed[str(message["ticket"])[:64]] = now
                return
            request = from_dict(ServeRequest, message["request"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self.log(f"serve: a line from the launcher that is not a request ({e}); ignored")
            return
        if self.draining.is_set():
            return  # the launcher sends nothing after END_OF_INPUT
        flight = Flight(request)
        self.known[request.id] = flight
        self.lines.put(flight)

    def prepare_all(self) -> None:
        """Requests in the order they came; one with a grammar (its building and checking
        take a tenth of a second or more) on a thread of its own, so that the requests
        behind it are not held up. Every request before the drain is prepared before
        ``prepared_all``."""
        from concurrent.futures import ThreadPoolExecutor

        grammars = ThreadPoolExecutor(1, thread_name_prefix="prepare-grammar")
        while (flight := self.lines.get()) is not None:
            if flight.cancel.is_set():
                self.ended(flight)
            elif flight.request.constraint is not None:
                grammars.submit(self.prepare_one, flight)
            else:
                self.prepare_one(flight)
        grammars.shutdown(wait=True)
        self.prepared_all.set()
        self.flights.put(None)

    def prepare_one(self, flight: Flight) -> None:
        try:
            ready = self.prepare(flight)
        except Exception as e:  # a bug in preparing must not end the thread, nor the request
            self.log(f"serve: could not prepare request {flight.request.id}: {e!r}")
            self.failed(flight.request.id, f"rank 0 could not prepare it ({type(e).__name__})")
            ready = None
        if ready is None:
            self.ended(flight)
        else:
            self.flights.put(ready)

    def ended(self, flight: Flight) -> None:
        self.known.pop(flight.request.id, None)


def prompt_of(request: ServeRequest, tokenizer) -> list[int]:
    from node.decode.render import render

    if request.kind in ("chat", "count"):
        return render(tokenizer, request.messages, request.template)
    return tokenizer.encode(request.prompt)


class Refusal(ValueError):
    """A request rank 0 refuses once it has its tokens (the field and the limit named)."""


def constrained(tokenizer, r: ServeRequest, tokens: list[int]) -> Grammar | None:
    """The grammar every rank decodes ``r`` under (node.decode.grammar), checked against this
    model's tokens here, off the decode loop; Refusal naming the field otherwise."""
    from node.decode.grammar import GrammarError, shared_grammar

    try:
        return shared_grammar(tokenizer, r.constraint, r.template.tools, tokens)
    except GrammarError as e:
        raise Refusal(f"'{r.constraint.source if r.constraint else 'constraint'}': {e}") from None


def needed(shared: SharedRequest, grammar_tokens: int = 0) -> int:
    """Tokens of KV cache a request may come to hold: its prompt and its answer, and with a
    grammar what its matcher may hold at most, in tokens of KV (``grammar_tokens``)."""
    extra = grammar_tokens if shared.grammar is not None else 0
    return len(shared.tokens) + shared.sampling.max_tokens + extra


def shared_size(shared: SharedRequest) -> int:
    """Bytes of a request as share_object sends it; one that cannot be encoded, or could not
    travel in an order, is refused here, alone, instead of failing an order on every rank."""
    from node.rank.share import encode

    try:
        size = len(encode(to_dict(shared, raw_bytes=True)))
    except (ValueError, TypeError, RecursionError) as e:
        raise Refusal(f"the request cannot be passed to the other ranks ({e})") from None
    if size > ORDER_BYTES:
        raise Refusal(f"the request is {size} bytes as the ranks get it, over {ORDER_BYTES}")
    return size


@dataclass
class Admission:
    """What rank 0 checks of a request once its prompt is tokens: the prompt against the
    model's context and the server's limit, max_tokens lowered to what the context leaves,
    top_k at or past the vocabulary meaning "off", logit_bias ids inside the vocabulary."""

    vocab: int | None
    context: int | None
    max_prompt_tokens: int | None
    kv_room: int | None = None  # tokens of KV the answers under way may hold (node.serve.kv_room)
    grammar_tokens: int = 0  # a request's matcher at its most, in tokens of KV (kv_room)

    @classmethod
    def of(cls, config: dict, settings) -> Admission:
        from cluster.core.modelcheck import text_config

        text = text_config(config)
        return cls(
            text.get("vocab_size") or config.get("vocab_size"),
            text.get("max_position_embeddings") or config.get("max_position_embeddings"),
            settings.max_prompt_tokens,
        )

    def request(self, tokens: list[int], sampling: Sampling) -> SharedRequest:
        """What every rank gets of the request (its seed drawn), or Refusal."""
        n = len(tokens)
        most = self.max_prompt_tokens or self.context
        if most and n > most:
            whose = (
                "this server's --max-prompt-tokens"
                if self.max_prompt_tokens
                else ("the model's context")
            )
            raise Refusal(f"the prompt is {n} tokens, over {whose} ({most})")
        changes: dict[str, Any] = {}
        if self.context:
            left = self.context - n
            if left < 1:
                raise Refusal(f"the prompt is {n} tokens and fills the model's context "
                              f"({self.context}); nothing is left for the answer")  # fmt: skip
            if sampling.max_tokens > left:
                changes["max_tokens"] = left
        if self.kv_room is not None:
            room = self.kv_room - n
            if room < 1:
                raise Refusal(f"the prompt is {n} tokens; the ranks' memory holds the KV cache "
                              f"of {self.kv_room} tokens at most")  # fmt: skip
            if changes.get("max_tokens", sampling.max_tokens) > room:
                changes["max_tokens"] = room
        if self.vocab and sampling.top_k >= self.vocab:
            changes["top_k"] = 0
        if self.vocab and sampling.logit_bias:
            outside = [k for k in sampling.logit_bias if int(k) >= self.vocab]
            if outside:
                raise Refusal(f"'logit_bias': token id {outside[0]} is outside the "
                              f"vocabulary (0 to {self.vocab - 1})")  # fmt: skip
        if changes:
            sampling = dataclasses.replace(sampling, **changes)
        return SharedRequest(seeded(sampling), tokens)


@dataclass
class InBatch:
    """Rank 0's view of one request in the batch."""

    flight: Flight
    detokenizer: Any
    text: AnswerText
    prompt_n: int
    inserted: float
    cached: int = 0  # prompt tokens that came from the prompt cache
    from_disk: int = 0  # of those, read from the disk tier
    first: float | None = None
    last: float | None = None
    n: int = 0
    need: int = 0  # tokens of KV it may come to hold: prompt and max_tokens


class Scheduler:
    """Rank 0's half of the lockstep batch: which requests join, which leave, and the text.

    A request with a seed is decoded alone, as mlx-lm's server does: its tokens depend on the
    random state, which a batch shares. So are all requests of a model whose caches cannot be
    batched."""

    def __init__(self, tokenizer, emit, batched: bool, drain_timeout: float, admission: Admission,
                 rests: bool = False, role: str = "both"):  # fmt: skip
        self._inbox: Inbox | None = None  # set by ``listen``
        # handoffs (issue 53): a prefill group's prompts to prefill and hand off; a decode
        # group's requests waiting for their KV, by ticket (with when they came), the tickets
        # to announce to every rank, and those every rank holds whole (``handed``)
        self.role = role
        self.prefills: deque[Flight] = deque()
        self.awaiting: dict[str, tuple[Flight, SharedRequest, float]] = {}
        self.expecting: list[Expect] = []
        self.handed_now: list[str] = []
        self.failed_now: list[str] = []  # tickets some rank's door failed (agree_handed)
        self.adopted: dict[str, dict] = {}  # ticket -> its figures, until its answer ends
        self.rests = rests  # idle: every rank rests (Order.rest) instead of pinging
        self.tokenizer = tokenizer
        self.admission = admission
        self.emit = emit
        self.batched = batched
        self.drain_timeout = drain_timeout
        self.waiting: deque[tuple[Flight, SharedRequest]] = deque()
        self.inserting: list[tuple[Flight, SharedRequest]] = []  # in the order just shared
        self.in_batch: dict[int, InBatch] = {}
        self.removals: list[int] = []
        self.drain_deadline: float | None = None
        self.reserved = 0  # tokens of KV the requests in the batch may come to hold
        # requests whose matchers every rank builds before they join (Order.compile)
        self.compiling: dict[int, tuple[Flight, SharedRequest]] = {}
        self.tickets = 0  # tickets handed out
        self.dropped: list[int] = []  # tickets of requests that will not come
        self.grammars: dict[int, Any] = {}  # uid -> its Constrained (the batch's, shared)
        self.budget = Budget()
        self.failures = Failures()  # grammars that failed lately: refused at once
        self.spent: dict[int, tuple[float, int]] = {}  # uid -> (spent, steps) when judged
        self.ended_requests: dict[int, ServeRequest] = {}  # uid -> request, until its cache is
        # told (CachedPrefixes)
        self.report_cached: Callable[[], None] | None = None

    def listen(self, stream: IO[bytes], log: Callable[[str], None]) -> None:
        self.inbox = Inbox(stream, log, self.prepare,
                           lambda rid, why: self.emit(Refused(rid, 500, why)))  # fmt: skip

    @property
    def inbox(self) -> Inbox:
        if self._inbox is None:
            raise RuntimeError("the scheduler has no inbox: listen() first")
        return self._inbox

    @inbox.setter
    def inbox(self, inbox: Inbox) -> None:
        self._inbox = inbox

    def piece(self, flight: Flight, text: str) -> None:
        if flight.parts is not None:  # set when it was prepared
            flight.parts.feed(text)

    def logprobs(self, flight: Flight, response) -> None:
        """Rank 0 keeps a token's logprobs when its request asked for them."""
        top = flight.request.logprobs
        if top is not None and response.logprobs is not None and flight.parts is not None:
            flight.parts.token(
                token_logprobs(self.tokenizer, response.token, response.logprobs, top)
            )

    def prepare(self, flight: Flight) -> Flight | None:
        """On the inbox's prepare thread: the request's tokens and its shared settings
        (``flight.shared``), or its refusal or count sent back (None)."""
        r = flight.request
        try:
            tokens = prompt_of(r, self.tokenizer)
            if not tokens:
                raise ValueError("the prompt is empty after tokenization")
        except Exception as e:  # a template that cannot render these messages
            self.emit(Refused(r.id, 400, f"cannot build the prompt: {e}"))
            return None
        if r.kind == "count":
            self.emit(Counted(r.id, len(tokens)))
            return None
        try:
            shared = self.admission.request(tokens, r.sampling)
            if r.constraint is not None:
                shared.grammar = constrained(self.tokenizer, r, tokens)
                known = shared.grammar and self.failures.why(digest(shared.grammar.text).hex())
                if known:
                    raise Refusal(f"'{r.constraint.source or 'grammar'}': {known}")
            shared.cache_key = r.cache_key
            flight.shared, flight.size = shared, shared_size(shared)
            if r.handoff is not None:  # what its handed-off KV must stand for: not on the loop
                flight.handed = tokens_digest(tokens[:-1])
        except Refusal as e:
            self.emit(Refused(r.id, 400, str(e)))
            return None
        choice = r.constraint.tools if r.constraint is not None else None
        flight.parts = Parts(r.id, self.tokenizer, r.template.tools, r.kind == "chat", self.emit,
                             json_calls=choice if json_answer(self.tokenizer, choice)
                             else None)  # fmt: skip
        return flight

    def take(self, flight: Flight | None) -> None:
        """A prepared request into the waiting line."""
        if flight is None:  # a wake-up (drain)
            return
        if flight.cancel.is_set() or flight.shared is None:
            self.inbox.ended(flight)
            return
        handoff = flight.request.handoff
        if handoff is not None and self.role == "prefill":
            self.prefills.append(flight)
        elif handoff is not None and self.role == "decode" and self.batched:
            why = None
            if handoff.doors:
                why = "a prefill group's copy of a request came to a decode group"
            elif handoff.ticket in self.awaiting or handoff.ticket in self.adopted:
                why = f"handoff ticket {handoff.ticket} is already waiting here"
            if why is not None:  # the launcher's fault: this request fails alone
                self.emit(Refused(flight.request.id, 500, why))
                self.inbox.ended(flight)
                return
            self.awaiting[handoff.ticket] = (flight, flight.shared, time.monotonic())
            self.expecting.append(Expect(handoff.ticket, flight.handed))
        else:
            self.waiting.append((flight, flight.shared))

    def order(self, live: int) -> Order | None:
        """The next order for every rank: an empty one is a ping (nothing to do, all still
        here), None means go on as before. Blocks while there is nothing to do."""
        inbox = self.inbox
        if not live and not self.waiting and not self.compiling and not self.awaiting \
                and not self.prefills:  # fmt: skip
            if inbox.prepared_all.is_set() and inbox.flights.empty():
                return Order(quit=True)
            try:
                self.take(inbox.flights.get(timeout=0 if self.rests else PING_S))
            except queue.Empty:
                return Order(rest=self.rests)
        while True:
            try:
                self.take(inbox.flights.get_nowait())
            except queue.Empty:
                break
        self.cut_drain()
        for uid, one in list(self.in_batch.items()):  # a client gone while its prompt prefills
            if one.first is None and one.flight.cancel.is_set():
                self.finish(uid, one, "cancelled")
        if self.prefills and not live and not self.removals:  # a prefill group's next prompt
            return self.prefill_order()
        order = Order(remove=self.removals)
        self.removals = []
        self.announce(order)
        self.handoffs(order)
        insert: list[SharedRequest] = []
        size = tokens = 0
        room = self.admission.kv_room
        while self.waiting:
            flight, request = self.waiting[0]
            if flight.cancel.is_set():
                self.waiting.popleft()
                self.inbox.ended(flight)
                continue
            if not self.batched or flight.request.seeded:
                if live or insert or order.remove:
                    break  # alone: once the batch is empty
                self.waiting.popleft()
                self.inserting = [(flight, request)]
                return Order(single=request, compile=order.compile, dropped=order.dropped)
            if insert and size + flight.size > ORDER_BYTES:
                break  # the rest join at the next round: one order stays far under the limit
            need = needed(request, self.admission.grammar_tokens)
            if room is not None and (live or insert) and self.reserved + tokens + need > room:
                break  # it waits until answers under way end and leave memory for it
            size += flight.size
            tokens += need
            insert.append(request)
            self.inserting.append(self.waiting.popleft())
        order.insert = insert
        busy = order.expect or order.adopt or order.forget
        return order if insert or order.remove or order.compile or order.dropped or busy else None

    def prefill_order(self) -> Order | None:
        """A prefill group: the next prompt to prefill and hand off (all but its last token:
        the decode group runs that one, as it runs a cached prompt's)."""
        flight = self.prefills.popleft()
        if flight.cancel.is_set() or flight.shared is None or flight.request.handoff is None:
            self.inbox.ended(flight)
            return None
        self.inserting = [(flight, flight.shared)]
        return Order(prefill=PrefillOrder(flight.request.handoff, flight.shared.tokens[:-1],
                                          flight.request.id))  # fmt: skip

    def prefill_cancelled(self) -> bool:
        """A prefill group's rank 0, between chunks: the client of the prompt under way left."""
        return bool(self.inserting) and self.inserting[0][0].cancel.is_set()

    def handed(self, order: PrefillOrder, nbytes: int, seconds: float, error: str | None,
               lasting: bool = False) -> None:  # fmt: skip
        """A prefill group's rank 0: the handoff done (or not), told to the launcher."""
        flight, _ = self.inserting[0]
        self.inserting = []
        self.emit(Handed(order.request, order.handoff.ticket, len(order.tokens), nbytes,
                         round(seconds, 4), error, lasting))  # fmt: skip
        self.inbox.ended(flight)

    def handoffs(self, order: Order) -> None:
        """A decode group: tickets every rank is to expect, those every rank holds whole
        (adopted: their requests join as cached prompts) and those that will not come (a
        failed prefill group, a cancel, nothing of it for HANDOFF_WAIT_S: forgotten, their
        requests prefill here)."""
        if not (self.expecting or self.handed_now or self.awaiting):
            return
        from node.cache.handoff import heard

        failed = self.inbox.handoffs_failed
        now = time.monotonic()

        order.expect, self.expecting = self.expecting, []
        for ticket in self.handed_now:
            flight, shared, _ = self.awaiting.pop(ticket)
            order.adopt.append(Adopt(ticket, shared.cache_key))
            self.waiting.appendleft((flight, shared))
        self.handed_now = []
        refused, self.failed_now = set(self.failed_now), []
        for ticket, (flight, shared, since) in list(self.awaiting.items()):
            quiet = now - max(since, heard(ticket) or since)
            if flight.cancel.is_set():
                why = "cancelled"
            elif ticket in failed:
                why = "the prefill group failed"
            elif ticket in refused:
                why = "a rank's door refused what came"
            elif quiet > HANDOFF_WAIT_S:
                why = f"nothing came for {HANDOFF_WAIT_S:g} s"
            else:
                continue
            del self.awaiting[ticket]
            failed.pop(ticket, None)
            order.forget.append(ticket)
            self.emit(Forgot(flight.request.id, ticket, why))
            if flight.cancel.is_set():
                self.inbox.ended(flight)
            else:
                self.waiting.append((flight, shared))

    def announce(self, order: Order) -> None:
        """Requests with a grammar go to every rank's Compiling first (``order.compile``),
        and wait in ``compiling`` until ``compiled`` says every rank built their matchers;
        a cancelled one's ticket is dropped everywhere."""
        for flight, request in [w for w in self.waiting if w[1].grammar is not None]:
            grammar = request.grammar
            if grammar is None or grammar.ticket is not None:
                continue
            grammar.ticket = self.tickets
            self.tickets += 1
            self.waiting.remove((flight, request))
            self.compiling[grammar.ticket] = (flight, request)
            order.compile.append(Grammar(grammar.text, ticket=grammar.ticket))
        for ticket, (flight, _) in list(self.compiling.items()):
            if flight.cancel.is_set():
                del self.compiling[ticket]
                self.dropped.append(ticket)
                self.inbox.ended(flight)
        order.dropped, self.dropped = self.dropped, []

    def compiled(self, tickets: list[int]) -> None:
        """Every rank holds these tickets' matchers: their requests may join (first in line,
        in the order they came)."""
        for ticket in sorted(tickets, reverse=True):
            if ticket in self.compiling:
                self.waiting.appendleft(self.compiling.pop(ticket))

    def police(self, step: tuple[float, int]) -> None:
        """Every request's grammar within its Budget: ``step`` is the last round's (seconds,
        steps). One over it ends with an error, and every rank drops it at the next order."""
        seconds, steps = step
        if not steps or not self.grammars:
            return
        spent = {
            uid: c.spent - self.spent.get(uid, (0.0, 0))[0] for uid, c in self.grammars.items()
        }
        model_step = max(0.0, seconds - sum(spent.values())) / steps
        for uid, c in list(self.grammars.items()):
            before = self.spent.get(uid, (0.0, 0))
            why = self.budget.over(c.spent - before[0], c.steps - before[1], model_step)
            if c.steps - before[1] >= self.budget.window:
                self.spent[uid] = (c.spent, c.steps)  # the next window starts here
            one = self.in_batch.get(uid)
            if why is not None and one is not None:
                self.finish(uid, one, "grammar", error=why)

    def rest(self) -> None:
        """Every rank rests (Order.rest): rank 0 waits, using no CPU, for a prepared request
        or the drain, then wakes the others (Wake: the launcher writes WAKE to each)."""
        self.take(self.inbox.flights.get())
        self.emit(Wake())

    def cut_drain(self) -> None:
        """Draining past its deadline: what is still being decoded is cancelled."""
        if not self.inbox.draining.is_set():
            return
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_timeout
        if time.monotonic() < self.drain_deadline:
            return
        for uid, one in list(self.in_batch.items()):
            self.finish(uid, one, "cancelled")
        for flight, _ in [*self.waiting, *self.compiling.values()]:
            self.emit(Refused(flight.request.id, 503, "the server is shutting down"))
        self.waiting.clear()
        self.dropped += list(self.compiling)
        self.compiling.clear()

    def bind(self, joined: list[tuple[int | None, int, str | None]],
             from_disk: dict[int, int] | None = None) -> None:  # fmt: skip
        """The requests just inserted: (uid, prompt tokens taken from the cache, why it
        failed), in order; ``from_disk``: uid -> of those, read from disk. One that failed on
        the ranks is answered with a 500 alone."""
        now = time.perf_counter()
        for (uid, cached, failed), (flight, request) in zip(joined, self.inserting, strict=True):
            if failed is not None:
                self.failed(flight, failed)
                continue
            text = answer_text(self.tokenizer, request)
            if text.opening:
                self.piece(flight, text.start())
            assert uid is not None  # joined: a uid; failed: a reason
            self.in_batch[uid] = InBatch(flight, self.tokenizer.detokenizer, text,
                                   len(request.tokens), now, cached,
                                   (from_disk or {}).get(uid, 0),
                                   need=needed(request, self.admission.grammar_tokens))  # fmt: skip
            self.reserved += self.in_batch[uid].need
            self.emit(Admitted(flight.request.id, len(request.tokens), cached))
        self.inserting = []

    def prefill_progress(self, prefilling: dict[int, tuple[int, int]]) -> None:
        """How far each request being prefilled has come (/health shows it)."""
        for uid, (done, total) in prefilling.items():
            one = self.in_batch.get(uid)
            if one is not None and done:
                self.emit(Prefill(done + one.cached, total + one.cached, one.flight.request.id))

    def grammar_failed(self, flight: Flight, why: str, text: str | None = None) -> None:
        constraint = flight.request.constraint
        source = constraint.source if constraint is not None and constraint.source else "grammar"
        key = digest(text).hex() if text is not None else None
        if key is not None:
            self.failures.add(key, why)
        self.emit(
            Refused(flight.request.id, 400, f"'{source}': the answer was ended: {why}", grammar=key)
        )
        log_line = f"serve: request {flight.request.id}: its grammar failed: {why}"
        self.inbox.log(log_line)
        self.inbox.ended(flight)

    def failed(self, flight: Flight, why: str) -> None:
        self.emit(Refused(flight.request.id, 500, f"the request failed on the ranks ({why}); "
                                               "the server goes on"))  # fmt: skip
        self.inbox.ended(flight)

    def on_token(self, r) -> None:
        """One generated token of one request: its text to the client, its end if it ends."""
        one = self.in_batch.get(r.uid)
        if one is None:
            return
        now = time.perf_counter()
        one.first = one.first or now
        one.last, one.n = now, one.n + 1
        self.logprobs(one.flight, r)
        if r.finish_reason != "stop":  # an end-of-sequence token has no text
            one.detokenizer.add_token(r.token)
        if r.finish_reason is not None:
            one.detokenizer.finalize()
        shown, hit = one.text.feed(one.detokenizer.last_segment)
        self.piece(one.flight, shown)
        if hit:
            self.finish(r.uid, one, "stop")
        elif r.finish_reason is not None:
            self.piece(one.flight, one.text.finish())
            grammar = self.grammars.get(r.uid)
            failed = grammar.failure if grammar is not None else None
            self.finish(r.uid, one, r.finish_reason, ended=True, error=failed)
        elif one.flight.cancel.is_set():
            self.finish(r.uid, one, "cancelled")

    def finish(self, uid: int, one: InBatch, reason: str, ended: bool = False,
               error: str | None = None) -> None:  # fmt: skip
        """The request's answer is complete; unless the generator ended it, every rank drops
        it at the next order. ``error``: its grammar failed (a limit, its budget): the answer
        is an error (400; a stream under way ends with an error event), never a stop."""
        del self.in_batch[uid]
        if ended:
            self.ended_requests[uid] = one.flight.request
            if self.report_cached is not None:  # before its Stats: a client's next turn,
                self.report_cached()  # sent as soon as this one ends, finds it cached
        self.reserved -= one.need
        self.spent.pop(uid, None)
        if not ended:
            self.removals.append(uid)
        if error is not None:
            shared = one.flight.shared
            text = shared.grammar.text if shared is not None and shared.grammar else None
            self.grammar_failed(one.flight, error, text)
            return
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
            one.text.stop.hit,
            one.from_disk,
        )
        handoff = one.flight.request.handoff
        if handoff is not None and handoff.ticket in self.adopted:
            stats["timings"].update(self.adopted.pop(handoff.ticket))
        self.answered(one.flight, stats)

    def answered(self, flight: Flight, stats: dict) -> None:
        """The end of an answer: what its parts still hold, then its stats (a tool call
        that ended the answer makes it finish with "tool_calls", as OpenAI's do)."""
        cut = stats["finish_reason"] == "length"
        if (
            flight.parts is not None
            and flight.parts.finish(cut)
            and stats["finish_reason"] == "stop"
        ):
            stats = {**stats, "finish_reason": "tool_calls"}
        self.emit(Stats(**stats, request=flight.request.id))
        self.inbox.ended(flight)


class CachedPrefixes:
    """Rank 0: the prompt prefixes its prompt cache holds (cluster.core.prefix's links of the
    requests whose caches it kept), told to the launcher (``Cached``) when they change: a
    fleet's router sends a request to the group holding its longest prefix. An entry the
    cache dropped is forgotten at the next report."""

    def __init__(self, emit: Callable):
        self.emit = emit
        self.entries: dict[int, tuple[list[int], list[str]]] = {}  # id(tokens) -> (tokens, links)
        self.disk: dict[str, None] = {}  # links of prompts the disk tier was given, oldest first
        self.told: tuple[list[str], list[str]] = ([], [])

    def report(self, batch, ended: dict[int, ServeRequest]) -> None:
        for uid, kept in batch.kept_now.items():
            request = ended.pop(uid, None)
            if request is not None and request.kind != "count":
                names = [x.name for x in prefix_chain(request)]
                for tokens in kept:  # the request's prefix is held while any of them is
                    self.entries[id(tokens)] = (tokens, names)
                if batch.disk is not None and request.cache_key is None:  # as Lockstep.keep
                    for name in names:
                        self.disk.pop(name, None)
                        self.disk[name] = None
                    while len(self.disk) > MOST_CACHED:
                        self.disk.pop(next(iter(self.disk)))
        batch.kept_now.clear()
        ended.clear()
        held = batch.cached_ids()
        if held is not None:
            self.entries = {k: v for k, v in self.entries.items() if k in held}
        links: dict[str, None] = {}  # the most recent entry's first
        for _, names in reversed(self.entries.values()):
            links.update(dict.fromkeys(reversed(names)))
        told = (list(links)[:MOST_CACHED], list(reversed(self.disk)))
        if told != self.told:
            self.told = told
            self.emit(Cached(*told))


def cache_budget(gb: float | None, left: float) -> tuple[float, float]:
    """(bytes this rank's kept caches may take, bytes its answers under way may take), of
    ``left`` (node.memory.memory_left): ``gb`` as asked and the rest, else half each."""
    if gb is not None:
        return gb * 1e9, max(0.0, left - gb * 1e9)
    return left / 2, left / 2


def kv_token_bytes(config: dict, cache: list, mode: str, world: int) -> int | None:
    """Bytes of KV cache one more token takes on this rank (keys and values of its own layers,
    or its own heads), from the config; None when the config does not say. ``cache``: a
    fresh cache list of this rank's model (other stages' slots hold no keys)."""
    from cluster.core.modelcheck import text_config
    from node.model.stage import SkippedCache

    text = text_config(config)
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (hidden // heads if heads and hidden else None)
    if text.get("kv_lora_rank"):  # MLA (DeepSeek): the latent and the rope part, not split
        per_layer = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
    elif kv and head_dim:
        per_layer = 2 * int(kv) * int(head_dim)
        if mode == "tensor":
            per_layer = -(-per_layer // world)
    else:
        return None
    layers = sum(1 for c in cache if not isinstance(c, SkippedCache) and hasattr(c, "keys"))
    if not layers:
        return None
    itemsize = 4 if str(text.get("torch_dtype", "")).endswith("float32") else 2
    return layers * per_layer * itemsize


def kv_room(loaded, spec: JobSpec, live_bytes: float, group) -> tuple[int | None, int]:
    """Every rank at once: the tokens of KV cache the answers under way may hold on every
    rank (the smallest room over the ranks; None when a rank cannot tell, its config does
    not say, and then nothing is admitted by memory), and what one request's grammar matcher
    may hold (MATCHER_BYTES) in tokens of KV on the rank where that is most."""
    from mlx_lm.models.cache import make_prompt_cache

    from node.decode.grammar import MATCHER_BYTES
    from node.rank.dist import gather_ints

    per_token = kv_token_bytes(
        loaded.config, make_prompt_cache(loaded.model), spec.mode, spec.world_size
    )
    room = int(min(live_bytes / per_token, 2**31 - 1)) if per_token else -1
    grammar = int(min(-(-MATCHER_BYTES // per_token), 2**31 - 1)) if per_token else 0
    rooms, grammars = gather_ints(room, group), gather_ints(grammar, group)
    return (None if min(rooms) < 0 else min(rooms)), max(grammars)


def run_serve(job: Job) -> None:
    """Every rank's loop: rank 0 says what to do each round, every rank does it; returns once
    rank 0 says quit (a drain ended)."""
    loaded, group, spec, emit, log, disk = (job.loaded, job.group, job.spec, job.emit, job.log,
                                            job.disk)  # fmt: skip
    import mlx.core as mx

    from node.cache import handoff
    from node.decode.prefill import PREFILL_STEP
    from node.jobs.batch import Lockstep, batchable, micro_batches_note
    from node.rank.memory import memory_left
    from node.rank.share import share_order, share_typed
    from node.rank.watchdog import can_rest, launcher_input, wait_for_wake

    rank0 = group.rank() == 0
    options = spec.serve  # rank 0's; the others get what they need in ``setup``

    def setup() -> ServeSetup:
        return ServeSetup(secrets.randbits(31), options.decode_concurrency,
                          options.prompt_concurrency, spec.prefill_step or PREFILL_STEP,
                          options.prompt_cache_size, spec.prompt_cache_gb)  # fmt: skip

    agreed = share_typed(ServeSetup, setup if rank0 else None, group, "start serving")
    if agreed is None:  # rank 0 always makes one
        raise RuntimeError("rank 0 shared no serve setup")
    mx.random.seed(agreed.seed)
    batched = batchable(loaded.model)
    vocab = Admission.of(loaded.config, options).vocab or loaded.tokenizer.vocab_size
    cache_bytes, live_bytes = cache_budget(agreed.cache_gb, memory_left(spec.ranks_on_host))
    room, grammar_tokens = kv_room(loaded, spec, live_bytes, group)
    if batched:
        log(f"serve: kept answers' caches take at most {cache_bytes / 1e9:.1f} GB on this rank")
    if room is not None and rank0:
        log(f"serve: answers under way may hold {room} tokens of KV cache (every rank has room)")
    batch = (
        Lockstep(
            loaded.model,
            loaded.tokenizer,
            agreed.decode_concurrency,
            agreed.prompt_concurrency,
            agreed.prompt_cache_size,
            cache_bytes,
            group,
            vocab,
            agreed.prefill_step,
            options.max_stall,  # rank 0's pace decides; the others follow its orders
            spec.stages,
            disk,
            spec.micro_batches,
        )
        if batched
        else None
    )
    # a model whose caches cannot batch decodes each request alone: one stream's cache between
    # them (its prompt and, where it cannot be cut back, the prompt's snapshot; memory only)
    alone = None
    if not batched and agreed.prompt_cache_size:
        from node.cache.turns import TurnCache

        proposer = getattr(loaded.speculation, "proposer", None)
        alone = TurnCache(loaded.model, cache_bytes, proposer, None, group)
    note = micro_batches_note(loaded.model, spec.stages, spec.micro_batches) if batched else None
    if note is not None and rank0:
        emit(Notice(note))
    scheduler = None  # rank 0's; rank 0 alone decides what every rank does
    if rank0:
        admission = Admission.of(loaded.config, options)
        admission.kv_room, admission.grammar_tokens = room, grammar_tokens
        scheduler = Scheduler(loaded.tokenizer, emit, batched, options.drain_timeout, admission,
                              rests=can_rest(), role=spec.handoff.role)  # fmt: skip
        scheduler.listen(launcher_input(), log)
        if batch is not None:
            scheduler.grammars = batch.grammars
            batch.report_kept = True
        emit(Serving(model_id(spec.model), batched))
    prefixes = CachedPrefixes(emit)  # rank 0's; other ranks' batches keep kept_now unread
    if scheduler is not None and batch is not None:
        scheduler.report_cached = lambda: prefixes.report(batch, scheduler.ended_requests)
    live = 0
    memory_at = 0.0

    def report_memory() -> None:
        nonlocal memory_at
        memory_at = time.monotonic()
        io = (None, None) if disk is None else (disk.stats.bytes_read, disk.stats.bytes_written)
        emit(Memory(mx.get_peak_memory() / 1e9, io[0], io[1], handoff.held_bytes()))

    while True:
        progress.tick()  # a round, or an idle ping every PING_S: all ranks met
        if time.monotonic() - memory_at > MEMORY_EVERY_S:
            report_memory()
        if compiling.pending:  # the same tickets on every rank: they came in the orders
            built = agree_built(group, wait=0.0 if live else 0.02)
            if scheduler is not None:
                scheduler.compiled(built)
        if handoff.PENDING:  # the same on every rank too
            done, failed = handoff.agree_handed(group, wait=0.0 if live else 0.02)
            if scheduler is not None:
                scheduler.handed_now, scheduler.failed_now = done, failed
        order = scheduler.order(live) if scheduler is not None else None
        if scheduler is not None and batch is not None:
            joining = [len(r.tokens) for r in order.insert] if order is not None else []
            step = batch.next_prefill_step(joining)
            if step is not None:
                order = order or Order()
                order.prefill_step = step
        order = share_order(order, group)
        if order is not None:
            compiling.submit(order.compile)
            compiling.drop(order.dropped)
            if order.quit:
                break
            handoff.expect(order.expect)
            handoff.forget(order.forget)
            if order.prefill is not None:
                step = agreed.prefill_step
                cancelled = (lambda: False) if scheduler is None else scheduler.prefill_cancelled
                sent = handoff.prefill_and_send(order.prefill, loaded, spec, group, step,
                                                progress.tick, cancelled)  # fmt: skip
                if scheduler is not None:
                    scheduler.handed(order.prefill, *sent)
                continue
            if batch is not None:
                for adopt in order.adopt:
                    figures = batch.adopt(adopt.ticket, adopt.cache_key)
                    if scheduler is not None:
                        scheduler.adopted[adopt.ticket] = figures
            if order.single is not None:
                decode_alone(order.single, scheduler, loaded, group, vocab, emit, alone)
                continue
            if batch is not None:  # not batched: every request comes alone, the rest are pings
                joined = batch.apply(order)
                if scheduler is not None:
                    scheduler.bind(joined, batch.from_disk)
        if batch is not None:
            batch.round(scheduler.on_token if scheduler is not None else None)
            live = len(batch.live)
            if scheduler is not None:
                if batch.kept_now or scheduler.ended_requests:
                    prefixes.report(batch, scheduler.ended_requests)
                scheduler.prefill_progress(batch.prefilling)
                scheduler.police(batch.last_round)
        if order is not None and order.rest:  # nothing to do: no collective until rank 0 wakes us
            report_memory()  # what the last answers read and wrote, before a rest of any length
            with progress.waiting():
                scheduler.rest() if scheduler is not None else wait_for_wake()
    if batch is not None:
        batch.close()
    if disk is not None:
        disk.flush()  # what the last answers left to write, before the ranks end


def agree_built(group, wait: float) -> list[int]:
    """Every rank at once: the tickets whose matchers every rank has built (one all_sum of
    a flag per pending ticket); ``wait``: how long a rank with nothing to decode waits for
    its builds first, so an idle batch does not spin in collectives."""
    import mlx.core as mx

    from node.rank.dist import control_stream
    from node.rank.numbers import host_ints

    pending = compiling.pending
    flags = compiling.ready(wait)
    if group is None or group.size() == 1:
        return [t for t, done in zip(pending, flags, strict=True) if done]
    counts = mx.distributed.all_sum(mx.array(flags, dtype=mx.int32), group=group,
                                    stream=control_stream())  # fmt: skip
    return [t for t, n in zip(pending, host_ints(counts), strict=True) if n == group.size()]


def decode_alone(
    request: SharedRequest, scheduler: Scheduler | None, loaded, group, vocab: int, emit,
    turns=None,
) -> None:  # fmt: skip
    """A request decoded alone (it has a seed, or the model's caches cannot be batched), on
    every rank; rank 0 (``scheduler``) streams its text and ends it. ``turns``
    (node.cache.turns.TurnCache): the cache kept between such requests, where one is."""
    from node.decode.loop import generate

    flight = scheduler.inserting[0][0] if scheduler is not None else None
    try:
        tried(request, vocab)
    except RequestFailed as e:  # on every rank alike
        if request.grammar is not None and request.grammar.ticket is not None:
            compiling.drop([request.grammar.ticket])
        if scheduler is not None and flight is not None:
            scheduler.inserting = []
            scheduler.failed(flight, str(e))
        return
    made: list = []  # the request's processors, as generate makes them
    over: list[str] = []  # rank 0: why its grammar went over its budget
    began = time.perf_counter()

    def stop_now() -> bool:
        """Rank 0: the client left, or the grammar is over its budget (the others learn it
        as they learn any cancel: agreed every few tokens)."""
        if flight is not None and flight.cancel.is_set():
            return True
        grammar = next((p for p in made if isinstance(p, Constrained)), None)
        if scheduler is None or grammar is None or not grammar.steps or over:
            return bool(over)
        model_step = max(0.0, time.perf_counter() - began - grammar.spent) / grammar.steps
        if why := scheduler.budget.over(grammar.spent, grammar.steps, model_step):
            over.append(why)
        return bool(over)

    rid = flight.request.id if flight is not None else None
    if rid is not None:
        emit(Admitted(rid, len(request.tokens)))

    def on_prefill(done: int, total: int) -> None:  # every rank: the cache's snapshot
        if turns is not None:
            turns.prefilled(done, total)
        if rid is not None and done:
            emit(Prefill(done, total, rid))

    prompt_cache, feed = None, None
    if turns is not None:
        prompt_cache, feed = turns.prepare(request.tokens, request.cache_key)

    try:
        answer = generate(
            loaded.model,
            loaded.tokenizer,
            request,
            functools.partial(scheduler.piece, flight) if scheduler and flight else None,
            group,
            cancelled=stop_now if flight is not None else None,
            cancellable=True,
            on_response=(
                functools.partial(scheduler.logprobs, flight) if scheduler and flight else None
            ),
            prompt_cache=prompt_cache,
            feed=feed,
            speculation=loaded.speculation,
            on_prefill=on_prefill if turns is not None or rid is not None else None,
            made=made,
        )
        if turns is not None:
            turns.done(request.tokens, answer.tokens)
    except GrammarFailed as e:  # on every rank alike, at the same token
        if turns is not None:
            turns.forget()
        if scheduler is not None and flight is not None:
            scheduler.inserting = []
            scheduler.grammar_failed(
                flight, str(e), request.grammar.text if request.grammar else None
            )
        return
    finally:
        if request.grammar is not None and request.grammar.ticket is not None:
            compiling.drop([request.grammar.ticket])
    if scheduler is not None and flight is not None:
        scheduler.inserting = []
        if over:
            text = request.grammar.text if request.grammar is not None else None
            scheduler.grammar_failed(flight, over[0], text)
        else:
            scheduler.answered(flight, answer.stats)
