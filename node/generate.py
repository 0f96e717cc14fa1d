"""One request, decoded in lockstep on every rank; rank 0 writes the text as it comes.

Everything that must agree across ranks (prompt tokens, sampling settings, seed) is decided on
rank 0 and reaches the others through share_object, so every rank samples the same token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import stream_generate

from .sampling import processors, sampler, settings

STOP_CHECK_EVERY = 4  # tokens between the ranks' checks of rank 0's stop decision


def prompt_tokens(tokenizer, prompt: str) -> list[int]:
    """As mlx_lm.generate does: the chat template when the tokenizer has one, raw text otherwise."""
    if tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def make_request(tokenizer, r: dict) -> dict:
    """Rank 0's work order, in the form share_object carries to the other ranks."""
    tokens = prompt_tokens(tokenizer, r["prompt"])
    if not tokens:
        raise ValueError("the prompt is empty after tokenization")
    return {"tokens": tokens, **settings(r)}


def generate(
    model, tokenizer, request: dict, write: Callable[[str], None] | None, group=None
) -> dict[str, Any]:
    """Decode ``request`` (identical on every rank); ``write`` gets text segments on rank 0."""
    mx.random.seed(request["seed"])
    tokens = request["tokens"]
    responses = stream_generate(
        model,
        tokenizer,
        mx.array(tokens),
        request["max_tokens"],
        sampler=sampler(request),
        logits_processors=processors(request, len(tokens)),
    )
    return stream(responses, write, request.get("stop") or [], group)


class StopText:
    """Rank 0's view of the text against the stop strings: text that could still be the start
    of a stop string is held back until it is clearly not."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text to show now, whether a stop string was reached)."""
        self.pending += text
        hits = [i for i in (self.pending.find(x) for x in self.stops) if i >= 0]
        if hits:
            shown, self.pending = self.pending[: min(hits)], ""
            return shown, True
        held = next(
            (
                k
                for k in range(min(len(self.pending), self.hold), 0, -1)
                if any(x.startswith(self.pending[-k:]) for x in self.stops)
            ),
            0,
        )
        cut = len(self.pending) - held
        shown, self.pending = self.pending[:cut], self.pending[cut:]
        return shown, False

    def flush(self) -> str:
        shown, self.pending = self.pending, ""
        return shown


def rank0_stopped(stopped: bool, group) -> bool:
    """Every rank learns whether rank 0 has stopped: a one-number all_sum (rank 0 gives 1)."""
    flag = mx.distributed.all_sum(mx.array(1.0 if stopped else 0.0), group=group, stream=mx.cpu)
    return flag.item() > 0


def stream(
    responses: Iterable[Any],
    write: Callable[[str], None] | None,
    stops: list[str] | None = None,
    group=None,
) -> dict[str, Any]:
    """Hand each response's text to ``write`` (rank 0) and return the answer's stats.

    Rank 0 alone sees the text, so it alone decides that a stop string was reached; every
    STOP_CHECK_EVERY tokens all ranks agree on it through ``rank0_stopped`` and leave the loop
    at the same token (they cannot stop alone: the next token needs every rank). mlx-lm's and
    mlx-vlm's responses carry the same fields."""
    text = StopText(stops or [])
    distributed = group is not None and group.size() > 1
    start = time.perf_counter()
    first = last = None
    stopped_at = None  # tokens generated when rank 0 reached a stop string
    for n, response in enumerate(responses, start=1):
        if first is None:
            first = time.perf_counter()
        last = response
        if stopped_at is None and write is not None:
            shown, hit = text.feed(response.text)
            if shown:
                write(shown)
            if hit:
                stopped_at = response.generation_tokens
        if distributed and n % STOP_CHECK_EVERY == 0:
            if rank0_stopped(stopped_at is not None, group):
                break
        elif not distributed and stopped_at is not None:
            break
    else:
        if write is not None and stopped_at is None:
            rest = text.flush()
            if rest:
                write(rest)
    if last is None:
        raise RuntimeError("the model produced no response")
    generated = stopped_at or last.generation_tokens
    finish = "stop" if stopped_at else last.finish_reason
    return answer_stats(last, generated, finish, (first - start) if first else None)


def answer_stats(last, generated: int, finish: str | None, ttft: float | None) -> dict:
    """usage and timings in the shape llama-server reports them."""
    prompt_n = last.prompt_tokens
    prompt_ms = 1000 * prompt_n / last.prompt_tps if last.prompt_tps else 0.0
    predicted_ms = (
        1000 * last.generation_tokens / last.generation_tps if last.generation_tps else 0.0
    )
    return {
        "finish_reason": finish,
        "usage": {
            "prompt_tokens": prompt_n,
            "completion_tokens": generated,
            "total_tokens": prompt_n + generated,
        },
        "timings": {
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_second": last.prompt_tps,
            "predicted_n": generated,
            "predicted_ms": predicted_ms,
            "predicted_per_second": last.generation_tps,
            "cache_n": 0,
        },
        "time_to_first_token_s": ttft,
    }


def prompt_logits(model, tokens: list[int]) -> list[float]:
    """The next-token logits after the prompt, in float32: one forward pass on every rank
    (for comparing a sharded run with a single-process one)."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(tokens)[None], cache=make_prompt_cache(model))
    return logits[0, -1].astype(mx.float32).tolist()
