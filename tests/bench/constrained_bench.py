"""Constrained decoding's cost under load: aggregate decode tokens/s of N concurrent streams
against a 2-rank serve, each stream under a JSON schema or free, in each mode, measured in the
same run (alternating rounds, median of --repeat), as a ratio. Also the matcher's own time
per mask for the model's vocabulary.

    python -m tests.bench.constrained_bench --streams 8 --max-tokens 64 --repeat 3

The model: a llama (hidden 512, 8 layers, 8 heads) with a 32,768-token byte-level BPE
vocabulary trained here on pydoc's topics and Python's own sources (the mask's work grows
with the vocabulary; a real model's is 32k to 256k), or --model. The schema asks for an array
of 40 integers, longer than --max-tokens, so that both kinds of stream decode the same number
of tokens. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": 40, "maxItems": 40}  # fmt: skip


def corpus(vocab: int = 32768) -> list[str]:
    """pydoc's topics and the text of Python's own modules, and for a vocabulary past 64k
    the installed packages' sources too: about 800 bytes of text per token (151,936 tokens,
    Qwen's vocabulary, from 120 MB)."""
    import sysconfig
    from pydoc_data.topics import topics

    texts = list(topics.values())
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    if vocab > 65536:
        paths = [*sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")),
                 *sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py"))]  # fmt: skip
    size = 0
    for f in paths:
        try:
            texts.append(f.read_text(errors="replace"))
        except OSError:
            continue
        size += len(texts[-1])
        if vocab > 65536 and size > vocab * 800:
            break
    return texts


def make_bench_model(out: Path, vocab: int) -> Path:
    from tests.support import tiny
    from tests.support.tiny import make_model
    from tests.support.tiny import train_tokenizer as real

    def bigger(o, vocab_size=512, chat_template=None, extra_special=(), corpus_=None, **kw):
        return real(o, vocab, chat_template, extra_special, corpus=corpus(vocab), **kw)

    tiny.train_tokenizer = bigger
    try:
        return make_model(out, "llama", seed=3, vocab_size=vocab, hidden_size=512,
                          intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=8, eos_token_id=10**6)  # fmt: skip
    finally:
        tiny.train_tokenizer = real


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def round_(port: int, model: str, streams: int, max_tokens: int, constrained: bool,
           first: int) -> float:  # fmt: skip
    """Aggregate tok/s of ``streams`` requests sent at once (distinct prompts: no cache)."""

    def one(i: int) -> int:
        body = {"model": model, "prompt": f"Question {first + i}: list numbers.",
                "max_tokens": max_tokens, "temperature": 0.7}  # fmt: skip
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "n", "schema": SCHEMA}}  # fmt: skip
        got = post(port, body)
        t = got.get("timings") or {}
        if t.get("predicted_ms"):  # this request's decode alone, its prefill left out
            DECODE.append(t["predicted_n"] / t["predicted_ms"] * 1000)
        return got["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(streams)))
    return tokens / (time.perf_counter() - start)


DECODE: list[float] = []  # each request's decode tokens/s (its stream's), of the last round


def mask_time(model_dir: Path, repeat: int = 200) -> float:
    """Seconds per mask of the matcher alone, mid-answer, for the model's vocabulary."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from cluster.core.grammar import json_schema

    tok = llguidance.LLTokenizer(str(model_dir / "tokenizer.json"))
    mask_time.vocab = tok.vocab_size
    m = llguidance.LLMatcher(tok, json_schema(SCHEMA))
    m.consume_tokens(tok.tokenize_str("[12, 345, 6"))
    bits = allocate_token_bitmask(1, tok.vocab_size)
    start = time.perf_counter()
    for _ in range(repeat):
        fill_next_token_bitmask(m, bits)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    from tests.support.serving import free_port, start, stop, wait_up

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default="pipeline,tensor")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--eight-b", type=Path, metavar="TOKENIZER_DIR",
                        help="a random Llama-3-8B-shaped bf16 model with this tokenizer "
                        "(a GPU host: tests/bench/gpu.py), made under --model")  # fmt: skip
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    if args.eight_b:
        from tests.bench.gpu import make_8b

        make_8b(Path(args.model), args.eight_b)
    model = Path(args.model) if args.model else make_bench_model(tmp / "bench", args.vocab)
    bin_ = shutil.which("mlx-cluster") or Path(sys.executable).parent / "mlx-cluster"
    rows = []
    for mode in args.modes.split(","):
        port = free_port()
        proc = start([str(bin_), "serve", "--model", str(model), "--mode", mode, "--port",
                      str(port), "--no-measure-links", "-n", str(args.ranks)])  # fmt: skip
        try:
            wait_up(port, proc)
            post(port, {"model": model.name, "prompt": "warm", "max_tokens": 4})
            post(port, {"model": model.name, "prompt": "warm", "max_tokens": 4,
                        "response_format": {"type": "json_object"}})  # fmt: skip
            free, constrained, first = [], [], 0
            streams: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeat):
                for kind, out in ((False, free), (True, constrained)):
                    DECODE.clear()
                    out.append(round_(port, model.name, args.streams, args.max_tokens, kind, first))
                    streams[kind].append(statistics.median(DECODE) if DECODE else 0.0)
                    first += args.streams
                    print(f"{mode} {'schema' if kind else 'free'}: {out[-1]:.1f} tok/s, each "
                          f"stream decoding at {streams[kind][-1]:.1f}",
                          file=sys.stderr)  # fmt: skip
            print(f"{mode} per-stream decode tok/s, median of rounds: free "
                  f"{statistics.median(streams[False]):.1f} {streams[False]}, schema "
                  f"{statistics.median(streams[True]):.1f} {streams[True]}")  # fmt: skip
            rows.append((mode, statistics.median(free), statistics.median(constrained),
                         min(free), max(free), min(constrained), max(constrained)))  # fmt: skip
        finally:
            stop([proc])
    per_mask = mask_time(model)
    print(f"| mode | free tok/s | JSON schema tok/s | ratio |  ({args.streams} streams x "
          f"{args.max_tokens} tokens, {args.ranks} ranks, median of {args.repeat} "
          "[min-max])")  # fmt: skip
    print("|---|---|---|---|")
    for mode, f, c, f0, f1, c0, c1 in rows:
        print(f"| {mode} | {f:.1f} [{f0:.1f}-{f1:.1f}] | {c:.1f} [{c0:.1f}-{c1:.1f}] | "
              f"{c / f:.2f}x |")  # fmt: skip
    print(f"\nllguidance: {per_mask * 1e6:.0f} us per mask, a vocabulary of "
          f"{mask_time.vocab} tokens")  # fmt: skip


if __name__ == "__main__":
    main()
