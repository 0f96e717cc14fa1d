"""Sampling settings that every rank shares, and penalties that see only generated tokens.

Every rank computes the same logits (pipeline: the last stage's hidden state is shared; tensor:
all_sum gives every rank the same sums), so with the same settings and the same random seed
every rank samples the same token; rank 0 decides the settings and the seed once.

mlx-lm's penalty processors look at the prompt as well as the answer, and index the logits with
whatever ids they get. Ours penalise only what was generated (a prompt that mentions a word must
not make the answer avoid it) and ignore ids outside the logits (tokenizers with added tokens
beyond the model's vocabulary).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from cluster.core.spec import Sampling, SharedRequest


def seeded(s: Sampling) -> Sampling:
    """The settings as every rank gets them (rank 0 only): empty stop strings dropped, a
    missing seed drawn here."""
    seed = secrets.randbits(31) if s.seed is None else s.seed
    return dataclasses.replace(s, stop=[x for x in s.stop or [] if x], seed=seed)


class RequestFailed(ValueError):
    """A request's settings failed on this rank; being the same on every rank, they fail
    alike everywhere, so the request fails alone and the ranks go on."""


def tried(request: SharedRequest, vocab: int) -> tuple[Callable, list]:
    """The request's sampler and processors, run once on a row of zero logits, so that a
    setting that would raise in the middle of a batch's step raises here, before the request
    joins (RequestFailed). Every rank does the same, in the same order: the random state
    they draw from stays alike."""
    try:
        chosen = sampler(request)
        chain = processors(request, len(request.tokens))
        logits = mx.zeros((1, vocab))
        history = mx.array(request.tokens[-1:])
        for process in chain:
            logits = process(history, logits)
        mx.eval(chosen(logits))
        for process in chain:  # a grammar's matcher back to its start
            if hasattr(process, "reset"):
                process.reset()
    except Exception as e:
        # mlx-lm's samplers are compiled with the random state as input and output: one that
        # raises leaves the state without a value, and every later draw would fail. Every
        # rank fails here alike, so every rank seeds again alike (the request's shared seed).
        mx.random.seed(int(request.sampling.seed or 0))
        raise RequestFailed(f"{type(e).__name__}: {e}") from None
    return chosen, chain


def sampler(request: SharedRequest) -> Callable[[mx.array], mx.array]:
    s = request.sampling
    return make_sampler(
        temp=s.temp,
        top_p=s.top_p,
        min_p=s.min_p,
        min_tokens_to_keep=s.min_tokens_to_keep,
        top_k=s.top_k,
    )


def _counts(tokens: mx.array, prompt_len: int, vocab: int, context: int) -> mx.array | None:
    """How often each id came among the last ``context`` generated tokens; None if none.
    Stays lazy: no host round trip per token."""
    generated = tokens[prompt_len:][-context:]
    if generated.shape[0] == 0:
        return None
    valid = (generated >= 0) & (generated < vocab)
    ids = mx.where(valid, generated, 0)
    return mx.zeros((vocab,)).at[ids].add(valid.astype(mx.float32))


def _seen(tokens: mx.array, prompt_len: int, vocab: int, context: int) -> mx.array | None:
    """1.0 at each id among the last ``context`` generated tokens, else 0.0; None if none."""
    counts = _counts(tokens, prompt_len, vocab, context)
    return None if counts is None else mx.minimum(counts, 1.0)


def frequency_penalty(penalty: float, prompt_len: int, context: int = 20):
    """Subtract ``penalty`` times each token's count so far (OpenAI's frequency_penalty)."""

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        counts = _counts(tokens, prompt_len, logits.shape[-1], context)
        return logits if counts is None else logits - penalty * counts.astype(logits.dtype)

    return apply


def presence_penalty(penalty: float, prompt_len: int, context: int = 20):
    """Subtract ``penalty`` from each token already generated (OpenAI's presence_penalty)."""

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        seen = _seen(tokens, prompt_len, logits.shape[-1], context)
        return logits if seen is None else logits - penalty * seen.astype(logits.dtype)

    return apply


def repetition_penalty(penalty: float, prompt_len: int, context: int = 20):
    """Make tokens already generated less likely by ``penalty`` (sign-aware, as mlx-lm)."""

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        seen = _seen(tokens, prompt_len, logits.shape[-1], context)
        if seen is None:
            return logits
        penalized = mx.where(logits < 0, logits * penalty, logits / penalty)
        return mx.where(seen > 0, penalized, logits)

    return apply


def logit_bias(bias: dict[str, float]):
    """Add each bias to its token's logit (OpenAI's logit_bias; ids checked on rank 0)."""
    ids = mx.array([int(k) for k in bias])
    values = mx.array(list(bias.values()))

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[..., ids].add(values.astype(logits.dtype))

    return apply


def processors(request: SharedRequest, prompt_len: int) -> list:
    """The request's logits processors, in order: bias, penalties, and last the grammar's
    mask (node.decode.grammar), so that what it forbids stays forbidden."""
    s = request.sampling
    chosen = [logit_bias(s.logit_bias)] if s.logit_bias else []
    if s.repetition_penalty not in (None, 1.0):
        chosen.append(
            repetition_penalty(s.repetition_penalty, prompt_len, s.repetition_context_size)
        )
    if s.presence_penalty not in (None, 0.0):
        chosen.append(presence_penalty(s.presence_penalty, prompt_len, s.repetition_context_size))
    if s.frequency_penalty not in (None, 0.0):
        chosen.append(frequency_penalty(s.frequency_penalty, prompt_len, s.repetition_context_size))
    if request.grammar is not None:
        from node.decode.grammar import Constrained

        chosen.append(Constrained(request.grammar))
    return chosen
