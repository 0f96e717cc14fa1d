"""The rank side of ``mlx-cluster bench``: timed runs of a synthetic prompt, in lockstep.

Every rank runs the same generations through the same code as ``launch`` (node.decode.loop), so
what is timed is what users get. Rank 0 reports each run; every rank reports the collectives
one decode step of its shard calls; rank 0 also times an all_sum of one token's activations.
The prompt is built as ``mlx_lm.benchmark`` builds its own (seed 0, uniform ids), so the
mlx-lm baseline decodes the very same tokens.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from cluster.core.protocol import BenchComm, BenchRun, FirstToken, Notice, Phase
from cluster.core.spec import Order, Sampling, SharedRequest
from node.decode.loop import draft_counts, stream, token_stream
from node.decode.sampling import seeded
from node.decode.text import AnswerText
from node.jobs import Job
from node.rank.numbers import host_ints, host_rows

COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min", "send", "recv", "recv_like")
ALLSUM_WARMUP = 5
ALLSUM_SAMPLES = 50


def synthetic_prompt(vocab_size: int, n: int) -> list[int]:
    """``n`` token ids, as mlx_lm.benchmark draws them (the same ids on every rank)."""
    mx.random.seed(0)
    return host_ints(mx.random.randint(0, vocab_size, (n,)))


class Clock:
    """Times a response stream: when it started, its first response, its last one."""

    def __init__(self, responses: Iterable, on_first: Callable[[], None] | None = None):
        self.responses = responses
        self.on_first = on_first
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0

    def __iter__(self) -> Iterator:
        for response in self.responses:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
                if self.on_first is not None:
                    self.on_first()
            self.last = now
            self.count += 1
            yield response


def run_figures(clock: Clock, prompt_tokens: int) -> dict:
    """One run's numbers; generation tok/s counts the n-1 tokens after the first."""
    if clock.first is None or clock.last is None:
        raise RuntimeError("the run produced no token")
    ttft = clock.first - clock.start
    decode_s = clock.last - clock.first
    return {
        "ttft_s": ttft,
        "prefill_tps": prompt_tokens / ttft,
        "generation_tps": (clock.count - 1) / decode_s if decode_s > 0 else None,
        "generated": clock.count,
    }


def count_collectives(model, token: int) -> Counter:
    """The collectives this rank's shard calls in one decode step, counted as the graph is
    built (every mx.distributed call goes through the module attribute at call time)."""
    from mlx_lm.models.cache import make_prompt_cache

    counts: Counter = Counter()
    originals = {name: getattr(mx.distributed, name) for name in COLLECTIVES}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(mx.distributed, name, counting(name, fn))
        logits = model(mx.array([[token]]), cache=make_prompt_cache(model))
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)
    mx.eval(logits)
    return counts


def allsum_latency(group, hidden_size: int, dtype) -> dict:
    """Median and fastest time of one all_sum of a token's hidden state, on every rank."""
    x = mx.zeros((1, 1, hidden_size), dtype=dtype)
    times = []
    for i in range(ALLSUM_WARMUP + ALLSUM_SAMPLES):
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        if i >= ALLSUM_WARMUP:
            times.append(time.perf_counter() - tic)
    return {
        "allsum_bytes": x.nbytes,
        "allsum_latency_s": statistics.median(times),
        "allsum_latency_min_s": min(times),
        "allsum_samples": len(times),
    }


def synthetic_prompts(vocab_size: int, n: int, streams: int) -> list[list[int]]:
    """``streams`` prompts of ``n`` ids, as mlx_lm.benchmark draws a batch's (seed 0)."""
    mx.random.seed(0)
    return host_rows(mx.random.randint(0, vocab_size, (streams, n)))


def batch_run(job: Job, prompts: list[list[int]], gen_tokens: int,
              on_first: Callable[[], None] | None) -> tuple[dict, str]:  # fmt: skip
    """One run of ``len(prompts)`` greedy answers decoded together, the way serve decodes
    concurrent requests (node.jobs.batch.Lockstep: mlx-lm's BatchGenerator on every rank
    in lockstep); its figures (the prompts' prefill until every stream has its first token,
    then the aggregate decode rate) and a digest of every stream's tokens."""
    from node.decode.prefill import PREFILL_STEP
    from node.jobs.batch import Lockstep

    spec, loaded = job.spec, job.loaded
    streams = len(prompts)
    batch = Lockstep(loaded.model, loaded.tokenizer, streams, streams, 0, group=job.group,
                     prefill_step=spec.prefill_step or PREFILL_STEP,
                     stages=spec.stages,
                     micro_batches=spec.micro_batches)  # fmt: skip
    tokens: dict[int, list[int]] = {}
    firsts: dict[int, float] = {}
    last = 0.0

    def on_token(r) -> None:
        nonlocal last
        last = time.perf_counter()
        if r.uid not in firsts:
            firsts[r.uid] = last
            if on_first is not None and len(firsts) == 1:
                on_first()
        tokens.setdefault(r.uid, []).append(r.token)

    start = time.perf_counter()
    requests = [SharedRequest(Sampling(max_tokens=gen_tokens), p) for p in prompts]
    batch.apply(Order(insert=requests))
    while batch.live:
        batch.round(on_token)
    batch.close()
    generated = sum(len(t) for t in tokens.values())
    all_first = max(firsts.values())
    decode_s = last - all_first
    figures = {
        "ttft_s": all_first - start,
        "prefill_tps": sum(map(len, prompts)) / (all_first - start),
        "generation_tps": (generated - streams) / decode_s if decode_s > 0 else None,
        "generated": generated,
    }
    digest = hashlib.sha256(str([tokens[u] for u in sorted(tokens)]).encode()).hexdigest()[:16]
    return figures, digest


def lone_run(job: Job, request: SharedRequest, first: Callable[[], None] | None
             ) -> tuple[dict, str]:  # fmt: skip
    """One run of the synthetic prompt alone, through launch's decode loop; with a proposer,
    the drafted and accepted counts."""
    loaded, b = job.loaded, job.spec.bench
    job.emit(Phase("generating", prompt_tokens=len(request.tokens)))
    speculation = loaded.speculation
    clock = Clock(token_stream(loaded.model, loaded.tokenizer, request, speculation=speculation),
                  first)  # fmt: skip
    answer = stream(clock, None, AnswerText([]), job.group, None, generation_stream)
    figures = run_figures(clock, len(request.tokens)) if job.group.rank() == 0 else {}
    if speculation is not None and figures:
        drafted, accepted = draft_counts(answer.from_draft, speculation.k, b.gen_tokens)
        figures.update(draft_n=drafted, draft_n_accepted=accepted)
    return figures, hashlib.sha256(str(answer.tokens).encode()).hexdigest()[:16]


def run_bench(job: Job) -> None:
    """``warmup`` + ``repeat`` runs of the synthetic prompt (of ``streams`` prompts decoded
    together); EOS cannot end a run."""
    loaded, group, b, emit = job.loaded, job.group, job.spec.bench, job.emit
    rank = group.rank()
    model, tokenizer, config = loaded.model, loaded.tokenizer, loaded.config
    tokenizer.eos_token_ids = set()  # as mlx_lm.benchmark: every run is exactly gen_tokens
    text_config = config.get("text_config", config)
    vocab = config.get("vocab_size") or text_config["vocab_size"]
    prompt = synthetic_prompt(vocab, b.prompt_tokens)
    request = SharedRequest(seeded(Sampling(max_tokens=b.gen_tokens, seed=0)), prompt)
    prompts = synthetic_prompts(vocab, b.prompt_tokens, b.streams) if b.streams > 1 else None
    if prompts and rank == 0:
        from node.jobs.batch import micro_batches_note

        if note := micro_batches_note(model, job.spec.stages, job.spec.micro_batches):
            emit(Notice(note))
    for i in range(b.warmup + b.repeat):
        first = (lambda: emit(FirstToken())) if i == 0 and rank == 0 else None
        if prompts:
            emit(Phase("generating", prompt_tokens=b.prompt_tokens * b.streams))
            figures, digest = batch_run(job, prompts, b.gen_tokens, first)
        else:
            figures, digest = lone_run(job, request, first)
        if rank == 0:
            emit(BenchRun(run=i, warmup=i < b.warmup, tokens_sha=digest, **figures))
    counts = count_collectives(model, prompt[-1])
    comm: dict[str, Any] = {"counts": dict(counts)}
    if group.size() > 1:
        hidden = text_config["hidden_size"]
        comm.update(allsum_latency(group, hidden, _activation_dtype(model)))
    emit(BenchComm(**comm))


def _activation_dtype(model):
    """The dtype the hidden state travels in: what the embedding gives (float16 for a model
    quantized from float16), else the first floating parameter's."""
    from mlx.utils import tree_flatten

    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None:
        return embed(mx.array([[0]])).dtype
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
