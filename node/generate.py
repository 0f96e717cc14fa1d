"""One request, decoded in lockstep on every rank; rank 0 writes the text as it comes.

Everything that must agree across ranks (prompt tokens, sampling settings, seed) is decided on
rank 0 and reaches the others through share_object, so every rank samples the same token.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler


def prompt_tokens(tokenizer, prompt: str) -> list[int]:
    """As mlx_lm.generate does: the chat template when the tokenizer has one, raw text otherwise."""
    if tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def make_request(tokenizer, prompt: str, max_tokens: int, temp: float, seed: int | None) -> dict:
    """Rank 0's work order, in the form share_object carries to the other ranks."""
    tokens = prompt_tokens(tokenizer, prompt)
    if not tokens:
        raise ValueError("the prompt is empty after tokenization")
    return {"tokens": tokens, **sampling(max_tokens, temp, seed)}


def sampling(max_tokens: int, temp: float, seed: int | None) -> dict:
    """The settings every rank must share; a random seed is drawn here, once, on rank 0."""
    return {
        "max_tokens": max_tokens,
        "temp": temp,
        "seed": secrets.randbits(31) if seed is None else seed,
    }


def generate(
    model, tokenizer, request: dict, write: Callable[[str], None] | None
) -> dict[str, Any]:
    """Decode ``request`` (identical on every rank); ``write`` gets text segments on rank 0."""
    mx.random.seed(request["seed"])
    sampler = make_sampler(temp=request["temp"])
    responses = stream_generate(
        model, tokenizer, mx.array(request["tokens"]), request["max_tokens"], sampler=sampler
    )
    return stream(responses, write)


def stream(responses: Iterable[Any], write: Callable[[str], None] | None) -> dict[str, Any]:
    """Hand each response's text to ``write``; the stats of the run (mlx-lm's and mlx-vlm's
    responses carry the same fields)."""
    start = time.perf_counter()
    first = None
    last = None
    for response in responses:
        if first is None:
            first = time.perf_counter()
        if write is not None and response.text:
            write(response.text)
        last = response
    return {
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": last.prompt_tps,
        "generation_tokens": last.generation_tokens,
        "generation_tps": last.generation_tps,
        "time_to_first_token_s": (first - start) if first else None,
        "peak_memory_gb": last.peak_memory,
        "finish_reason": last.finish_reason,
    }


def prompt_logits(model, tokens: list[int]) -> list[float]:
    """The next-token logits after the prompt, in float32: one forward pass on every rank
    (for comparing a sharded run with a single-process one)."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(tokens)[None], cache=make_prompt_cache(model))
    return logits[0, -1].astype(mx.float32).tolist()
