"""A single stream's cache between its prompts: chat's turns, and serve's requests decoded
alone (a model whose caches cannot batch, such as DeepSeek V4's ``LayerCache``). The batch's
many streams have their own (node.jobs.batch: mlx-lm's LRU prompt cache)."""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from node.cache.disk import BLOCK_TOKENS
from node.cache.snapshots import trimmable
from node.model.stage import SkippedCache


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
        self.scope: str | None = None  # whose prompts the cache holds (``prepare``)

    def forget(self) -> None:
        """Hold nothing (every rank alike: a turn that failed left the cache unknown)."""
        self.cache, self.tokens, self.snapshot = None, [], None

    def make(self) -> list:
        cache = make_prompt_cache(self.model)
        self.layers = len(cache)
        return cache + (make_prompt_cache(self.proposer) if self.proposer else [])

    def prepare(self, tokens: list[int], scope: str | None = None) -> tuple[list, list[int]]:
        """(cache to decode with, tokens still to prefill); ``from_disk``: how many of those
        before them were read from the disk tier. ``scope`` (serve's prompt_cache_key): a
        prompt of another scope starts afresh, as the batch's cache keeps scopes apart."""
        if scope != self.scope:
            self.forget()
            self.scope = scope
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


def _offset(cache: list) -> int | None:
    """Tokens the cache holds (a layer this rank runs; None if no cache says)."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) and not isinstance(c, SkippedCache):
            return offset
    return None


def _nbytes(cache: list) -> int:
    return sum(getattr(c, "nbytes", 0) for c in cache)
