"""Where a constrained step's time goes on a GPU: mlx-lm's own decode loops (``generate_step``
for one stream, ``BatchGenerator`` for several, as serve runs it) on a random
Llama-3-8B-shaped bf16 model with a real tokenizer's vocabulary, each stream under a
processor that does one part of a grammar's work, in alternated rounds (median [min-max] of
--repeat), against the same loop with no processor:

- ``read-view``: reads the unseen token as a slice of the history (the code before 2026-12-07);
- ``read-copy``: reads it as an array of its own (``node.decode.grammar.own_copy``);
- ``mask-fixed``: read-copy, then a fixed bitmask sent and expanded on the device
  (``device_mask``): the mask's transfer without the matcher;
- ``grammar-view``: the whole ``Constrained`` (llguidance, a JSON schema) reading a slice;
- ``grammar``: the whole ``Constrained`` in mlx-lm's per-stream calls;
- ``grammar-grouped``: several streams: the batch's grammars masked together, as serve's
  ranks run them (node.jobs.batch.grouped_step); one stream: as ``grammar``.

    python -m tests.bench.token_read --model /tmp/m8b --streams 1,8 --tokens 128 --repeat 3

--model: a model folder (tests/bench/gpu.py's make_8b makes one with --tokenizer's
vocabulary). Prints a markdown table; each read variant also prints the mean seconds a step
waited in its read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": 200, "maxItems": 200}  # fmt: skip
VARIANTS = (
    "free",
    "read-view",
    "read-copy",
    "mask-fixed",
    "grammar-view",
    "grammar",
    "grammar-grouped",
)
WAITS: dict[str, list[float]] = {}


class Read:
    """Reads the token the step before sampled, as Constrained does, and nothing else."""

    def __init__(self, name: str, copy: bool, mask: bool = False):
        self.name, self.copy, self.mask, self.start, self.fed = name, copy, mask, None, 0

    def __call__(self, history, logits):
        import mlx.core as mx
        import numpy as np

        from node.decode import grammar

        n = history.shape[-1]
        if self.start is None:
            self.start = n
        part = history[self.start + self.fed :] if n > self.start + self.fed else None
        if part is not None and self.copy:
            part = grammar.own_copy(part)
        if part is not None:
            mx.async_eval(part)
        mx.async_eval(logits)
        if part is not None:
            began = time.perf_counter()
            self.fed += len(part.tolist())
            WAITS.setdefault(self.name, []).append(time.perf_counter() - began)
        if not self.mask:
            return logits
        words = np.full(((logits.shape[-1] + 31) // 32,), -1, dtype=np.int32)
        mask = grammar.device_mask(words, logits.shape[-1])
        return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))


def processor(name: str, grammar_text: str):
    from node.decode import grammar

    if name == "free":
        return None
    if name.startswith("read") or name == "mask-fixed":
        return Read(name, copy=name != "read-view", mask=name == "mask-fixed")
    return grammar.Constrained(grammar_text)  # grammar, grammar-view, grammar-grouped


def one_stream(model, prompt: list[int], name: str, grammar_text: str, tokens: int) -> float:
    """Decode tok/s of one stream (first token excluded: its prefill)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from node.decode import grammar

    view = name.endswith("view")
    real = grammar.own_copy
    if view:
        grammar.own_copy = lambda part: part
    try:
        proc = processor(name, grammar_text)
        steps = generate_step(mx.array(prompt), model, max_tokens=tokens,
                              sampler=make_sampler(temp=0.7),
                              logits_processors=[proc] if proc else None)  # fmt: skip
        next(steps)
        began, n = time.perf_counter(), 0
        for _ in steps:
            n += 1
        return n / (time.perf_counter() - began)
    finally:
        grammar.own_copy = real


def batch(model, prompts: list[list[int]], name: str, grammar_text: str, tokens: int) -> float:
    """Aggregate decode tok/s of len(prompts) streams in one BatchGenerator, from the step
    every stream had its first token."""
    from mlx_lm.generate import BatchGenerator, GenerationBatch
    from mlx_lm.sample_utils import make_sampler

    from node.decode import grammar
    from node.jobs.batch import use_grouped_step

    view = name.endswith("view")
    real, step = grammar.own_copy, GenerationBatch._step
    if view:
        grammar.own_copy = lambda part: part
    if name == "grammar-grouped" and not use_grouped_step():
        raise RuntimeError("this mlx-lm's GenerationBatch is not the one grouped_step knows")
    try:
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(prompts),
                             prefill_batch_size=len(prompts),
                             sampler=make_sampler(temp=0.7))  # fmt: skip
        procs = [processor(name, grammar_text) for _ in prompts]
        gen.insert(prompts, max_tokens=[tokens] * len(prompts),
                   logits_processors=[[p] if p else [] for p in procs])  # fmt: skip
        started: set[int] = set()
        began, n, done = 0.0, 0, 0
        while done < len(prompts):
            for r in gen.next_generated():
                if began:
                    n += 1
                started.add(r.uid)
                done += r.finish_reason is not None
            if not began and len(started) == len(prompts):
                began = time.perf_counter()
        gen.close()
        return n / (time.perf_counter() - began)
    finally:
        grammar.own_copy, GenerationBatch._step = real, step  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()

    from importlib.metadata import version

    import mlx.core as mx
    from mlx_lm import load

    from cluster.core.grammar import json_schema
    from node.decode import grammar

    model, tokenizer = load(str(args.model))[:2]
    vocab = model.args.vocab_size
    grammar.use_tokenizer(args.model, set(tokenizer.eos_token_ids), vocab)
    text = json_schema(SCHEMA)
    variants = args.variants.split(",")
    print(f"device {mx.default_device()}, mlx {version('mlx')}, vocabulary {vocab}",
          file=sys.stderr)  # fmt: skip
    rows = []
    for streams in [int(s) for s in args.streams.split(",")]:
        prompts = [[(7 * i + 13 * j) % 1000 + 100 for j in range(args.prompt_tokens)]
                   for i in range(streams)]  # fmt: skip
        results: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.repeat + 1):  # the first round warms (kernels, the matcher)
            for v in variants:
                WAITS.pop(v, None)
                if streams == 1:
                    got = one_stream(model, prompts[0], v, text, args.tokens)
                else:
                    got = batch(model, prompts, v, text, args.tokens)
                if r:
                    results[v].append(got)
                wait = statistics.mean(WAITS[v]) * 1000 if WAITS.get(v) else 0.0
                print(f"{streams} streams {v}: {got:.1f} tok/s"
                      + (f", read waited {wait:.2f} ms a step" if wait else "")
                      + (" (warm-up)" if not r else ""), file=sys.stderr)  # fmt: skip
        free = statistics.median(results["free"]) if "free" in results else None
        for v in variants:
            med = statistics.median(results[v])
            rows.append((streams, v, med, min(results[v]), max(results[v]),
                         med / free if free else None))  # fmt: skip
    print(f"| streams | variant | decode tok/s | vs free |  ({args.tokens} tokens, median of "
          f"{args.repeat} [min-max], {mx.default_device()})")  # fmt: skip
    print("|---|---|---|---|")
    for streams, v, med, lo, hi, ratio in rows:
        print(f"| {streams} | {v} | {med:.1f} [{lo:.1f}-{hi:.1f}] | "
              f"{'' if ratio is None else f'{ratio:.2f}x'} |")  # fmt: skip


if __name__ == "__main__":
    main()
