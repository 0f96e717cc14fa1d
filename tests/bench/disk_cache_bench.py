"""Time to first token of a long prompt after serve is started again, its prefix on disk.

For each mode: serve with the disk tier on an empty folder answers an N-token prompt (cold)
and is stopped; serve started again on the same folder answers the same prompt plus a new
turn (its prefix read from disk); a serve without the tier answers that second prompt too
(cold: the baseline, and the text the warm answer must equal). Each rank gets one BLAS thread
(OPENBLAS_NUM_THREADS=1). The model is tests/bench/stall.py's llama (hidden 576, 8 layers).

    python -m tests.bench.disk_cache_bench --prompt-tokens 8192 --modes pipeline,tensor
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tests.support.long_context import long_text
from tests.support.serving import fresh_serve, llama_576, post

TURN = " Now the next question, about what came before."


def first_token(port: int, model: str, prompt: str, max_tokens: int) -> dict:
    """A streamed completion: seconds to its first text, the text, the cached tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first, text, cached = None, "", None
    with post(port, "/v1/completions", body) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if choice.get("text") and first is None:
                    first = time.perf_counter() - start
                text += choice.get("text") or ""
            if event.get("usage"):
                cached = event["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    return {"ttft_s": first, "text": text, "cached": cached}


def served(model: Path, mode: str, ranks: int, disk: Path | None, prompt: str, n: int) -> dict:
    """A fresh serve answers ``prompt``, and stops (its drain writes what is left)."""
    flags = (
        [] if disk is None else ["--prompt-cache-disk-gb", "20", "--prompt-cache-dir", str(disk)]
    )
    with fresh_serve(model, mode, ranks, *flags) as port:
        return first_token(port, model.name, prompt, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--modes", default="pipeline,tensor")
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="mlx-cluster-disk-"))
    model = llama_576(base)
    prompt = long_text(model, args.prompt_tokens)
    print("| mode | ranks | cold: the prompt (s) | again, + a turn: from disk (s) | cached tokens "
          "| cold: prompt + turn (s) | disk / cold | same text |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        disk = base / f"disk-{mode}"
        cold = served(model, mode, args.ranks, disk, prompt, args.max_tokens)
        warm = served(model, mode, args.ranks, disk, prompt + TURN, args.max_tokens)
        baseline = served(model, mode, args.ranks, None, prompt + TURN, args.max_tokens)
        ratio = warm["ttft_s"] / baseline["ttft_s"]
        print(f"| {mode} | {args.ranks} | {cold['ttft_s']:.1f} | {warm['ttft_s']:.2f} | "
              f"{warm['cached']} | {baseline['ttft_s']:.1f} | {ratio:.3f} | "
              f"{warm['text'] == baseline['text']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
