"""`mlx-cluster chat`: a multi-turn session on every rank.

Rank 0 reads the user's turns from its stdin (the launcher forwards its own), keeps the history
and turns it into prompt tokens through the chat template; each turn reaches the other ranks
through share_object, and None ends the session. Every rank keeps the KV cache of its own layers
from turn to turn and prefills only the tokens past the longest prefix it already holds, so a
follow-up question costs its own tokens, not the whole conversation again.
"""

from __future__ import annotations

import copy
import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import IO

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from cluster.core.protocol import (
    CANCEL,
    END_OF_INPUT,
    AwaitingInput,
    Notice,
    Phase,
    Prefill,
    Stats,
    Wake,
)
from cluster.core.spec import SharedRequest, Template
from node.cache.disk import BLOCK_TOKENS
from node.cache.snapshots import trimmable
from node.jobs import Job
from node.model.stage import SkippedCache

COMMANDS_HELP = "/reset forgets the conversation, /exit (or Ctrl-D) ends the session"


class Input:
    """Rank 0's stdin, read on a thread: lines go to a queue (None at the end of input); a
    CANCEL byte anywhere sets ``cancel`` at once, even while the main thread is generating.
    The input ends at END_OF_INPUT (the launcher's stdin reached EOF) or at EOF; CANCEL bytes
    still count after END_OF_INPUT."""

    def __init__(self, stream: IO[bytes]):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.cancel = threading.Event()
        threading.Thread(target=self._read, args=(stream.fileno(),), daemon=True).start()

    def _read(self, fd: int) -> None:
        pending = b""
        ended = False
        try:
            while chunk := os.read(fd, 65536):
                if CANCEL in chunk:
                    self.cancel.set()
                    chunk = chunk.replace(CANCEL, b"")
                if ended:
                    continue
                chunk, sep, _ = chunk.partition(END_OF_INPUT)
                ended = bool(sep)
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    self.lines.put(line.decode("utf-8", "replace"))
                if ended:
                    self._end(pending)
        except OSError:
            pass
        if not ended:
            self._end(pending)

    def _end(self, pending: bytes) -> None:
        if pending.strip():
            self.lines.put(pending.decode("utf-8", "replace"))
        self.lines.put(None)


class Conversation:
    """Rank 0's history, and the prompt tokens of the next turn."""

    def __init__(self, tokenizer, template: Template):
        self.tokenizer = tokenizer
        self.template = template  # system prompt, tools, reasoning switches
        self.messages: list[dict[str, str]] = []
        self.templated = bool(tokenizer.has_chat_template)

    def reset(self) -> None:
        self.messages = []

    def tokens_for(self, user: str) -> list[int]:
        """Without a template the conversation goes as plain running text."""
        from node.decode.render import render

        messages = [*self.messages, {"role": "user", "content": user}]
        return render(self.tokenizer, messages, self.template)

    def add(self, user: str, answer: str) -> None:
        self.messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer},
        ]


class TurnCache:
    """One rank's KV cache between turns, bounded by ``budget_bytes``. With a speculative
    proposer, the list holds the model's layers, then the proposer's (as mlx-lm's speculative
    step takes them), and both are trimmed alike."""

    def __init__(self, model, budget_bytes: float, proposer=None, disk=None, group=None):
        self.model = model
        self.group = group  # the job's: whether to keep the cache is decided by every rank
        self.proposer = proposer
        self.budget = budget_bytes
        self.disk = disk  # node.cache.disk.DiskCache: the tier under this one (no proposer)
        self.cache: list | None = None
        self.tokens: list[int] = []  # what the cache holds, in order
        self.from_disk = 0  # of the last prepared turn's tokens
        # a cache that cannot be cut back (node.cache.snapshots) keeps its state at the end of
        # each prompt less its last token: the next turn repeats the prompt, not always the
        # answer as it was generated (a template may render it otherwise)
        self.snapshots = proposer is None and not trimmable(model)
        self.snapshot: tuple[list[int], list] | None = None
        self.turn: list[int] = []  # the tokens of the turn being prefilled

    def make(self) -> list:
        cache = make_prompt_cache(self.model)
        self.layers = len(cache)
        return cache + (make_prompt_cache(self.proposer) if self.proposer else [])

    def prepare(self, tokens: list[int]) -> tuple[list, list[int]]:
        """(cache to decode with, tokens still to prefill); ``from_disk``: how many of those
        before them were read from the disk tier."""
        if self.cache is None:
            self.cache, self.tokens = self.make(), []
        held = self.tokens
        reused = 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            reused += 1
        reused = min(reused, len(tokens) - 1)  # at least one token must be fed
        surplus = len(held) - reused
        if surplus and not can_trim_prompt_cache(self.cache):
            self.cache, reused = self.make(), 0
            if self.snapshot is not None:
                before, state = self.snapshot
                if len(before) < len(tokens) and tokens[: len(before)] == before:
                    self.cache, reused = copy.deepcopy(state), len(before)
        elif surplus:
            trim_prompt_cache(self.cache, surplus)
        self.turn = tokens
        self.from_disk = 0
        if self.disk is not None and len(tokens) - 1 - reused >= BLOCK_TOKENS:
            cache, n = self.disk.restore(self.model, tokens)  # every rank: the same state
            if n > reused:
                self.cache, self.tokens, reused, self.from_disk = cache, tokens[:n], n, n
        return self.cache, tokens[reused:]

    def prefilled(self, done: int, total: int) -> None:
        """Every rank, after each prefill chunk (``done`` of the ``total`` tokens fed this
        turn): at the end of the prompt less its last token, the snapshot."""
        if self.snapshots and self.cache is not None and 0 < done == total - 1:
            held = len(self.turn) - total + done
            self.snapshot = (self.turn[:held], copy.deepcopy(self.cache))

    def save(self, tokens: list[int], generated: list[int]) -> None:
        """After a turn, before ``done``: its blocks to the disk tier."""
        if self.disk is not None and self.cache is not None:
            self.disk.save(tokens + generated, self.cache)

    def done(self, tokens: list[int], generated: list[int]) -> None:
        """After a turn (every rank at once): note what the cache now holds, or drop it when
        any rank is over its budget. Ranks hold different layers, so their bytes differ: a
        rank that dropped its cache alone would prefill another length than the others at
        the next turn."""
        from node.cache.disk import agree_min

        cache = self.cache
        offset = None if cache is None else _offset(cache)
        snapshot = _nbytes(self.snapshot[1]) if self.snapshot is not None else 0
        keep = cache is not None and offset is not None and _nbytes(cache) + snapshot <= self.budget
        if not agree_min(int(keep), self.group) or cache is None or offset is None:
            self.cache, self.tokens, self.snapshot = None, [], None
            return
        self.tokens = (tokens + generated)[:offset]
        draft = cache[self.layers :]
        if draft:  # the proposer's cache must hold the same tokens as the model's
            held = _offset(draft) or 0
            if held > offset:  # its last proposals, rejected
                trim_prompt_cache(draft, held - offset)
            elif held < offset:  # the last accepted tokens it never saw
                self.proposer(mx.array(self.tokens[held:offset])[None], cache=draft)
                mx.eval([c.state for c in draft])


def prefilled(cache: TurnCache, emit: Callable | None, done: int, total: int) -> None:
    """After each prefill chunk, on every rank: the turn cache's snapshot; rank 0 (``emit``)
    reports the progress."""
    cache.prefilled(done, total)
    if emit is not None:
        emit(Prefill(done, total))


def _offset(cache: list) -> int | None:
    """Tokens the cache holds (a layer this rank runs; None if no cache says)."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) and not isinstance(c, SkippedCache):
            return offset
    return None


def _nbytes(cache: list) -> int:
    return sum(getattr(c, "nbytes", 0) for c in cache)


def next_turn(inp: Input, conversation: Conversation, log: Callable[[str], None]) -> str | None:
    """The next user turn from rank 0's stdin; None ends the session."""
    while True:
        line = inp.lines.get()
        if line is None:
            return None
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return None
        if line == "/reset":
            conversation.reset()
            log("conversation reset")
            continue
        if line.startswith("/") and " " not in line:
            log(f"unknown command {line}; {COMMANDS_HELP}")
            continue
        inp.cancel.clear()  # a Ctrl-C while idle does not cancel the next answer
        return line


def run_chat(job: Job) -> None:
    """The session loop of every rank; rank 0 (``write`` given) reads, the others follow."""
    loaded, group, spec, emit, write, disk = (job.loaded, job.group, job.spec, job.emit,
                                              job.write, job.disk)  # fmt: skip
    from node.decode.loop import generate
    from node.decode.render import shared_request
    from node.rank.share import share_typed
    from node.rank.watchdog import can_rest, launcher_input, progress, wait_for_wake

    rank0 = group.rank() == 0
    resting = can_rest() and group.size() > 1
    speculation = loaded.speculation
    from node.rank.memory import memory_left

    budget = (
        spec.prompt_cache_gb * 1e9
        if spec.prompt_cache_gb is not None
        else memory_left(spec.ranks_on_host) / 2  # as serve's kept caches
    )
    cache = TurnCache(loaded.model, budget, speculation and speculation.proposer, disk, group)
    said: list[str] = []  # rank 0: this turn's text, once the user wrote it
    if rank0:
        inp = Input(launcher_input())
        conversation = Conversation(loaded.tokenizer, spec.request.template)
        if not conversation.templated:
            emit(
                Notice("the model has no chat template; the conversation goes to it as plain text")
            )

        def notice(message: str) -> None:
            emit(Notice(message))

        def next_request() -> SharedRequest | None:
            emit(AwaitingInput())
            with progress.waiting():  # the user thinking is not a stalled collective
                user = next_turn(inp, conversation, notice)
            if resting:
                emit(Wake())  # the others rest meanwhile; the launcher wakes them
            if user is None:
                return None
            said.append(user)
            return shared_request(loaded.tokenizer, spec.request, conversation.tokens_for(user))

    while True:
        if resting and not rank0:
            wait_for_wake()  # not in a collective, whose receive polls a core while one waits
        request = share_typed(SharedRequest, next_request if rank0 else None, group,
                              "prepare the turn")  # fmt: skip
        if request is None:
            if disk is not None:
                disk.flush()  # the session ends: its blocks are on disk before it does
            return
        prompt_cache, feed = cache.prepare(request.tokens)
        emit(Phase("generating", prompt_tokens=len(request.tokens)))
        answer = generate(
            loaded.model,
            loaded.tokenizer,
            request,
            write,
            group,
            prompt_cache=prompt_cache,
            feed=feed,
            cancelled=inp.cancel.is_set if rank0 else None,
            cancellable=True,
            speculation=speculation,
            on_prefill=functools.partial(prefilled, cache, emit if rank0 else None),
            from_disk=cache.from_disk,
        )
        cache.save(request.tokens, answer.tokens)
        cache.done(request.tokens, answer.tokens)
        if rank0:
            if write is not None:
                write("\n")
            conversation.add(said.pop(), answer.text)
            emit(Stats(**answer.stats))
