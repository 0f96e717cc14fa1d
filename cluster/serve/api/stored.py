"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in this
process's memory, bounded by bytes and by age (serve's --responses-store-mb and
--responses-store-hours), lost when serve stops.

Each response keeps only its own turn: the items its request sent (without ``instructions``,
which the spec says a chained turn does not carry over), the chat messages they became, and
what the model answered as chat messages. A chained request's conversation is its ancestors'
turns in order, so a 50-turn agent session holds each turn once, not 50 growing copies. An
ancestor evicted (by bytes or age) or deleted breaks the chain: the request naming a later
response is then a 404 that says so, never an answer from half a conversation.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_CHAIN = 10_000  # turns one conversation may chain (MAX_MESSAGES: each turn is at least one)


ENTRY_BYTES = 512  # what keeping one response costs besides its JSON (measured: ~350)


class ChainTooLong(ValueError):
    """A conversation that chains more than MAX_CHAIN responses."""


@dataclass
class Stored:
    """One kept response, held as its compact JSON (bytes held = what the bound counts):
    the response object as GET returns it, the request's input items (each with an id), this
    turn as chat messages (its input, then the answer), and previous_response_id."""

    data: bytes
    previous: str | None = None
    size: int = 0  # bytes it holds: its JSON and ENTRY_BYTES
    used: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, response: dict, input_items: list[dict], messages: list[dict],
           previous: str | None = None) -> Stored:  # fmt: skip
        data = json.dumps([response, input_items, messages], separators=(",", ":")).encode()
        return cls(data, previous, len(data) + ENTRY_BYTES)

    def parts(self) -> list:
        return json.loads(self.data)

    @property
    def response(self) -> dict:
        return self.parts()[0]

    @property
    def input_items(self) -> list[dict]:
        return self.parts()[1]

    @property
    def messages(self) -> list[dict]:
        return self.parts()[2]


class ResponseStore:
    """A bounded map of response id -> Stored, least recently used out first. Thread-safe:
    every HTTP thread reads and writes it."""

    def __init__(self, max_bytes: int, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock = clock
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, rid: str, stored: Stored) -> bool:
        """Keep a response (False when it alone is over the bound, or the store is off)."""
        if stored.size > self.max_bytes:
            return False
        with self.lock:
            self.drop(rid)
            stored.used = self.clock()
            self.items[rid] = stored
            self.bytes += stored.size
            self.evict()
        return True

    def get(self, rid: str) -> Stored | None:
        with self.lock:
            self.evict()
            stored = self.items.get(rid)
            if stored is not None:
                self.touch(rid, stored)
            return stored

    def delete(self, rid: str) -> bool:
        with self.lock:
            return self.drop(rid)

    def conversation(self, rid: str) -> list[dict]:
        """The chat messages of ``rid``'s chain, oldest turn first; KeyError naming the
        first response of the chain that is not kept, ChainTooLong past MAX_CHAIN turns.
        Every response of the chain counts as used now (a live session's turns are the last
        to go)."""
        with self.lock:
            self.evict()
            turns: list[tuple[str, Stored]] = []
            at: str | None = rid
            while at is not None:
                stored = self.items.get(at)
                if stored is None:
                    raise KeyError(at)
                if len(turns) >= MAX_CHAIN:
                    raise ChainTooLong(f"the conversation chains more than {MAX_CHAIN:,} "
                                       "responses")  # fmt: skip
                turns.append((at, stored))
                at = stored.previous
            for at, stored in reversed(turns):  # the newest turn ends up most recent
                self.touch(at, stored)
        return [m for _, stored in reversed(turns) for m in stored.messages]

    def touch(self, rid: str, stored: Stored) -> None:
        stored.used = self.clock()
        self.items.move_to_end(rid)

    def drop(self, rid: str) -> bool:
        stored = self.items.pop(rid, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True

    def evict(self) -> None:
        """Out: what is past its age, then the least recently used past the bytes."""
        now = self.clock()
        while self.items:
            rid, oldest = next(iter(self.items.items()))
            if self.bytes <= self.max_bytes and now - oldest.used <= self.max_age_s:
                break
            self.drop(rid)
