"""One request, decoded in lockstep on every rank; rank 0 writes the text as it comes.

Everything that must agree across ranks (prompt tokens, sampling settings, seed) is decided on
rank 0 and reaches the others through share_object, so every rank samples the same token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from cluster.core.spec import SharedRequest
from node.decode.prefill import (
    STAGES,
    STEP_ARGS,
    PrefillCancelled,
    prefill_step,
    prefill_watch,
)
from node.decode.sampling import processors, sampler
from node.decode.text import AnswerText, answer_text
from node.rank.dist import rank0_stopped
from node.rank.watchdog import progress

STOP_CHECK_EVERY = 4  # tokens between the ranks' checks of rank 0's stop decision


@dataclass
class Generated:
    text: str  # what rank 0 showed (rank 0 only)
    tokens: list[int]  # every token generated, the stop string's too
    stats: dict[str, Any]
    from_draft: list[bool] = field(default_factory=list)  # per token: a proposal accepted


def generate(
    model,
    tokenizer,
    request: SharedRequest,
    write: Callable[[str], None] | None,
    group=None,
    prompt_cache: list | None = None,
    feed: list[int] | None = None,
    cancelled: Callable[[], bool] | None = None,
    cancellable: bool = False,
    on_response: Callable[[Any], None] | None = None,
    speculation=None,
    on_prefill: Callable[[int, int], None] | None = None,
    first_logits: list | None = None,
    from_disk: int = 0,
    made: list | None = None,
) -> Generated:
    """Decode ``request`` (identical on every rank); ``write`` gets text segments on rank 0.

    With ``prompt_cache`` (holding the start of the prompt), only ``feed`` is prefilled; the
    stats count the rest as cached (``from_disk`` of them read from the disk tier).
    ``cancellable`` (chat, serve: the same on every rank) says rank 0 may cancel the answer,
    also during the prefill; ``cancelled`` is how rank 0 learns it; ``on_response`` (rank 0)
    sees each response before its text (serve's logprobs); ``on_prefill`` (rank 0) gets
    (prompt tokens done, of) after each prefill chunk. With ``speculation`` (node.model.draft), its
    proposer drafts and the model verifies K+1 tokens per pass. ``first_logits`` (a list) gets
    the next-token logits after the prompt, as the first step sees them (``launch --logits``:
    the prompt is prefilled once for both the logits and the text). ``made`` (a list) gets
    the request's logits processors as they are made (serve times its grammar's)."""
    if request.grammar is not None:  # drafts are not checked against a grammar: decoded alone
        speculation = None
    watch = prefill_watch(group, cancelled, cancellable, on_prefill)
    made = [] if made is None else made  # the request's processors (did its grammar fail?)
    try:
        answer = stream(
            token_stream(
                model,
                tokenizer,
                request,
                prompt_cache,
                feed,
                speculation,
                watch,
                first_logits,
                made,
            ),  # fmt: skip
            write,
            answer_text(tokenizer, request),
            group,
            cancelled,
            generation_stream,
            cancellable=cancellable,
            on_response=on_response,
        )
    except PrefillCancelled as e:
        mx.synchronize(generation_stream)
        stats = answer_stats(e.total, 0.0, 0, 0.0, 0, "cancelled", None)
        return Generated("", [], stats)
    if request.grammar is not None:
        from node.decode.grammar import GrammarFailed, failure_of

        if (why := failure_of(made)) is not None:  # on every rank alike, at the same token
            raise GrammarFailed(f"the answer's grammar failed after {len(answer.tokens)} "
                                f"tokens: {why}")  # fmt: skip
    cached = len(request.tokens) - len(feed) if feed is not None else 0
    answer.stats["timings"].update(cache_n=cached, cache_disk_n=from_disk)
    answer.stats["usage"]["prompt_tokens_details"]["cached_tokens"] = cached
    if speculation is not None:
        k, most = speculation.k, request.sampling.max_tokens
        drafted, accepted = draft_counts(answer.from_draft, k, most)
        answer.stats["timings"].update(draft_n=drafted, draft_n_accepted=accepted)
    return answer


def draft_counts(responses_from_draft: list[bool], k: int, max_tokens: int) -> tuple[int, int]:
    """(tokens drafted, tokens accepted) of an answer, from each token's ``from_draft``.

    Each round of mlx-lm's speculative step drafts min(K, tokens left) and ends with one token
    of the main model's own, so rounds start at the first token and after each of those."""
    drafted = accepted = 0
    generated = 0
    new_round = True
    for from_draft in responses_from_draft:
        if new_round:
            drafted += min(k, max_tokens - generated)
        accepted += from_draft
        generated += 1
        new_round = not from_draft
    return drafted, accepted


def token_stream(
    model,
    tokenizer,
    request: SharedRequest,
    prompt_cache=None,
    feed=None,
    speculation=None,
    on_progress: Callable[[int, int], None] | None = None,
    first_logits: list | None = None,
    made: list | None = None,
) -> Iterable[Any]:
    """mlx-lm's stream of responses for ``request``: its seed, sampler and processors; with
    ``speculation``, mlx-lm's speculative step (the prompt cache then holds the model's
    layers, then the proposer's). ``on_progress``: mlx-lm's prompt_progress_callback;
    ``first_logits``: see ``generate``."""
    s = request.sampling
    mx.random.seed(int(s.seed or 0))  # rank 0 drew it (seeded): never None here
    feed = request.tokens if feed is None else feed
    extra = dict(STEP_ARGS)
    extra.setdefault("prefill_step_size", prefill_step(len(feed), STAGES[0]))
    chain = processors(request, len(feed))
    if made is not None:
        made += chain

    def responses(model, proposer=None) -> Iterable[Any]:
        if proposer is not None:  # mlx-lm's speculative step takes --kv-bits too
            extra.update(draft_model=proposer, num_draft_tokens=speculation.k)
        return stream_generate(
            model,
            tokenizer,
            mx.array(feed),
            s.max_tokens,
            sampler=sampler(request),
            logits_processors=[
                *([record_first(first_logits)] if first_logits is not None else []),
                *chain,
            ],
            prompt_cache=prompt_cache,
            prompt_progress_callback=on_progress or (lambda *_: progress.tick()),
            **extra,
        )

    if speculation is None:
        return responses(model)
    from node.cache.rewind import speculating

    model = Ticking(model)  # mlx-lm drops the prefill callback when it speculates
    if prompt_cache is None:  # as mlx-lm makes it: the model's layers, then the proposer's
        prompt_cache = make_prompt_cache(model) + make_prompt_cache(speculation.proposer)
    return speculating(model, speculation.proposer, prompt_cache, responses)


class Ticking(nn.Module):
    """The model, ticking the rank's progress at each call: a long prefill in chunks is
    progress, not a stalled collective (node.rank.watchdog). A Module holding the model, so that
    mlx-lm still counts its weights (wired_limit)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def __call__(self, *args, **kwargs):
        progress.tick()
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "model" not in self:  # while __init__ sets it
                raise
            return getattr(self["model"], name)


def stream(
    responses: Iterable[Any],
    write: Callable[[str], None] | None,
    text: AnswerText,
    group=None,
    cancelled: Callable[[], bool] | None = None,
    gen_stream=None,
    cancellable: bool = False,
    on_response: Callable[[Any], None] | None = None,
) -> Generated:
    """Hand each response's text to ``write`` (rank 0) and return the answer.

    Rank 0 alone sees the text and the user, so it alone decides to stop (a stop string, or
    ``cancelled()``: Ctrl-C in chat); every STOP_CHECK_EVERY tokens all ranks agree on it
    through ``rank0_stopped`` and leave the loop at the same token (they cannot stop alone: the
    next token needs every rank). The check (a stream sync and an all_sum) runs only when rank 0
    can stop early at all: stop strings, or ``cancellable``. ``text`` (AnswerText) says what
    the client sees.
    mlx-lm's and mlx-vlm's responses carry the same fields."""
    distributed = group is not None and group.size() > 1
    agree = distributed and (bool(text.stop.stops) or cancellable)  # the same on every rank
    start = time.perf_counter()
    first = last = None
    stopped_at = None  # tokens generated when rank 0 decided to stop
    reason = "stop"
    tokens: list[int] = []
    drafted: list[bool] = []  # each token: whether it was a proposal the model accepted
    if write is not None and text.opening:
        write(text.start())
    for n, response in enumerate(responses, start=1):
        if first is None:
            first = time.perf_counter()
        last = response
        progress.tick()
        tokens.append(response.token)
        drafted.append(bool(getattr(response, "from_draft", False)))
        if stopped_at is None and write is not None:
            if on_response is not None:
                on_response(response)
            shown, hit = text.feed(response.text)
            if shown:
                write(shown)
            if hit:
                stopped_at = response.generation_tokens
            elif cancelled is not None and cancelled():
                stopped_at, reason = response.generation_tokens, "cancelled"
        if agree and n % STOP_CHECK_EVERY == 0:
            if rank0_stopped(stopped_at is not None, group, gen_stream):
                break
        elif not distributed and stopped_at is not None:
            break
    else:
        if write is not None and stopped_at is None and (rest := text.finish()):
            write(rest)
    # the generator may have a step in flight; let it finish before any other collective
    mx.synchronize(gen_stream)
    if last is None:
        raise RuntimeError("the model produced no response")
    generated = stopped_at or last.generation_tokens
    finish = reason if stopped_at else last.finish_reason
    stats = answer_stats(
        last.prompt_tokens,
        last.prompt_tps,
        last.generation_tokens,
        last.generation_tps,
        generated,
        finish,
        (first - start) if first else None,
        stop_sequence=text.stop.hit,
    )
    return Generated(text.text, tokens, stats, drafted)


def answer_stats(
    prompt_n: int,
    prompt_tps: float,
    decoded: int,
    generation_tps: float,
    generated: int,
    finish: str | None,
    ttft: float | None,
    cached: int = 0,
    stop_sequence: str | None = None,
    from_disk: int = 0,
) -> dict:
    """usage and timings in the shape llama-server reports them. ``decoded`` tokens ran at
    ``generation_tps``; ``generated`` of them count for the answer (not those after a stop);
    ``cached`` of the prompt's tokens came from a prompt cache, not a prefill."""
    prompt_ms = 1000 * prompt_n / prompt_tps if prompt_tps else 0.0
    predicted_ms = 1000 * decoded / generation_tps if generation_tps else 0.0
    return {
        "finish_reason": finish,
        "usage": {
            "prompt_tokens": prompt_n,
            "completion_tokens": generated,
            "total_tokens": prompt_n + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
        "timings": {
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_second": prompt_tps,
            "predicted_n": generated,
            "predicted_ms": predicted_ms,
            "predicted_per_second": generation_tps,
            "cache_n": cached,
            "cache_disk_n": from_disk,
        },
        "time_to_first_token_s": ttft,
        "stop_sequence": stop_sequence,
    }


def record_first(into: list) -> Callable:
    """A logits processor that keeps (in float32, before any other processor) the logits of
    the first step: the next token's after the prompt."""

    def record(tokens, logits):
        if not into:
            into.append(logits[0].astype(mx.float32))
        return logits

    return record
