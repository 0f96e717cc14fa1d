"""`mlx-cluster chat`: a multi-turn session on every rank.

Rank 0 reads the user's turns from its stdin (the launcher forwards its own), keeps the history
and turns it into prompt tokens through the chat template; each turn reaches the other ranks
through share_object, and None ends the session. Every rank keeps the KV cache of its own layers
from turn to turn and prefills only the tokens past the longest prefix it already holds, so a
follow-up question costs its own tokens, not the whole conversation again.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import IO

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
from node.cache.turns import TurnCache
from node.jobs import Job

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


def prefilled(cache: TurnCache, emit: Callable | None, done: int, total: int) -> None:
    """After each prefill chunk, on every rank: the turn cache's snapshot; rank 0 (``emit``)
    reports the progress."""
    cache.prefilled(done, total)
    if emit is not None:
        emit(Prefill(done, total))


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
