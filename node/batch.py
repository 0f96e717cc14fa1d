"""Continuous batching in lockstep: every rank runs the same mlx-lm BatchGenerator.

mlx-lm's BatchGenerator is deterministic: the same inserts, removals and ``next()`` calls give
the same tokens on every rank (pipeline stages and tensor shards compute the same logits, and the
random state is seeded alike). So rank 0 decides, once a round, which requests join (prompt
tokens and sampling settings) and which leave (a stop string rank 0 saw, a client gone), shares
that order (plain JSON, share_object), and every rank applies it and steps the generator for the
round. Only rank 0 turns tokens into text.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from .generate import STOP_CHECK_EVERY
from .memory import reapply_wired_limit
from .sampling import processors, sampler

ROUND_STEPS = STOP_CHECK_EVERY  # generator steps between two orders of rank 0


def batchable(model) -> bool:
    """Whether every cache slot of this model can be batched (mlx-lm's own test)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


class Lockstep:
    """One rank's batch. Every rank holds the same uids: they come from the same orders."""

    def __init__(self, model, tokenizer, decode_concurrency: int, prompt_concurrency: int):
        self.generator = BatchGenerator(
            model,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
            completion_batch_size=decode_concurrency,
            prefill_batch_size=prompt_concurrency,
            stream=generation_stream,
        )
        reapply_wired_limit()
        self.live: set[int] = set()  # inserted and not yet finished or removed

    def apply(self, order: dict) -> list[int]:
        """Insert ``order['insert']`` (requests as node.sampling.settings makes them, with
        ``tokens``) and drop ``order['remove']``; returns the new uids in order."""
        uids = []
        for r in order.get("insert", ()):
            (uid,) = self.generator.insert(
                [r["tokens"]],
                max_tokens=[r["max_tokens"]],
                samplers=[sampler(r)],
                logits_processors=[processors(r, len(r["tokens"]))],
            )
            uids.append(uid)
        self.live.update(uids)
        gone = [u for u in order.get("remove", ()) if u in self.live]
        if gone:
            self.generator.remove(gone)
            self.live.difference_update(gone)
        return uids

    def round(self, on_token: Callable | None) -> None:
        """Step the generator ROUND_STEPS times (fewer once nothing is left); ``on_token`` (rank
        0) gets every generated token's response. Ends with no step in flight, so the next
        collective on another stream cannot interleave with the generator's."""
        for _ in range(ROUND_STEPS):
            if not self.live:
                break
            _, responses = self.generator.next()
            for r in responses:
                if r.finish_reason is not None:
                    self.live.discard(r.uid)
                if on_token is not None:
                    on_token(r)
        mx.synchronize(generation_stream)

    def close(self) -> None:
        self.generator.close()
