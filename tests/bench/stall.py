"""What a long prompt does to the answers already streaming from `mlx-cluster serve`.

Two greedy streams decode; once both have sent tokens, a long prompt arrives (non-streaming,
one token asked). Printed per setting: the long prompt's time to its answer, the streams'
worst and median gap between tokens while it was being prefilled, and the tokens they got
meanwhile. Each setting starts serve afresh, one after the other, in the same run.

    python -m tests.bench.stall --mode pipeline -n 2 --prompt-tokens 9000 --max-stall 0,0.25

``--max-stall 0`` is serve's behaviour before it had a pace: prefill steps of --prefill-step
(2048) tokens whatever runs. Every rank gets one BLAS thread (OPENBLAS_NUM_THREADS=1), as a
host of its own would have its own cores. The default model is llama-shaped (hidden 576,
8 layers) with an EOS out of reach, so the streams run until they are closed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.support.long_context import long_text
from tests.support.serving import BIN, free_port, llama_576, post, stop, wait_up

STREAM_PROMPT = "Tell me about lists"


def stream(port: int, model: str, times: list[float], stop_flag: threading.Event, eos: int) -> None:
    """One streaming completion, its EOS out of reach (logit_bias); the arrival time of each
    token's event into ``times``."""
    body = {"model": model, "prompt": STREAM_PROMPT, "max_tokens": 30000, "temperature": 0,
            "stream": True, "logit_bias": {str(eos): -100}}  # fmt: skip
    with post(port, "/v1/completions", body) as r:
        for line in r:
            if stop_flag.is_set():
                return
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
            elif line.strip() and not line.startswith(b":"):
                print(f"stream: {line!r}", file=sys.stderr)
    print("stream: ended", file=sys.stderr)


def measure(
    model: str, mode: str, ranks: int, max_stall: float, prompt_tokens: int, log: str | None
) -> dict:
    port = free_port()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    argv = [str(BIN / "mlx-cluster"), "serve", "-n", str(ranks), "--mode", mode, "--model",
            model, "--port", str(port), "--max-stall", str(max_stall)]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w") if log else subprocess.DEVNULL,
                            start_new_session=True, env=env)  # fmt: skip
    name = Path(model).name
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    stop_flag = threading.Event()
    try:
        wait_up(port, proc)
        post(port, "/v1/completions", {"model": name, "prompt": "Warm up.", "max_tokens": 4})
        streams = [[], []]
        threads = [
            threading.Thread(target=stream, args=(port, name, t, stop_flag, eos), daemon=True)
            for t in streams
        ]
        for t in threads:
            t.start()
        while min(len(t) for t in streams) < 20:
            if not all(t.is_alive() for t in threads):
                raise RuntimeError("a stream ended before the long prompt was sent")
            time.sleep(0.05)
        sent = time.perf_counter()
        body = {"model": name, "prompt": long_text(Path(model), prompt_tokens), "max_tokens": 1,
                "temperature": 0}  # fmt: skip
        answer = json.loads(post(port, "/v1/completions", body).read())
        done = time.perf_counter()
        while not all(t[-1] > done for t in streams):  # each stream's next token after it
            if not all(t.is_alive() for t in threads):
                raise RuntimeError("a stream ended while the long prompt was answered")
            time.sleep(0.05)
        stop_flag.set()
        gaps, during = [], 0
        for times in streams:
            before, inside = [t for t in times if t < sent], [t for t in times if sent <= t]
            during += sum(1 for t in inside if t <= done)
            upto = [before[-1], *(t for t in inside if t <= done), min(t for t in inside
                                                                       if t > done)]  # fmt: skip
            gaps += [b - a for a, b in itertools.pairwise(upto)]
            worst = sorted(((b - a, a - sent) for a, b in itertools.pairwise(upto)), reverse=True)
            shown = ", ".join(f"{g:.2f} at {t:.1f}" for g, t in worst[:4])
            print(f"worst gaps (s, at s after the long prompt was sent): {shown}", file=sys.stderr)
        return {
            "mode": mode,
            "ranks": ranks,
            "max_stall": max_stall,
            "prompt_tokens": answer["usage"]["prompt_tokens"],
            "answer_s": done - sent,
            "worst_gap_s": max(gaps),
            "median_gap_s": statistics.median(gaps),
            "stream_tokens": during,
        }
    finally:
        stop_flag.set()
        stop([proc])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: llama-shaped, built here)")
    parser.add_argument("--mode", choices=["pipeline", "tensor"], default="pipeline")
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=9000)
    parser.add_argument("--max-stall", default="0,0.25", help="comma-separated settings")
    parser.add_argument("--log", help="serve's stderr to LOG.<setting>")
    args = parser.parse_args()
    model = args.model or str(llama_576(Path(tempfile.mkdtemp())))
    print("| mode | ranks | --max-stall | prompt tokens | its answer (s) | streams' worst gap (s) "
          "| median gap (s) | stream tokens meanwhile |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for stall in (float(x) for x in args.max_stall.split(",")):
        log = f"{args.log}.{stall:g}" if args.log else None
        r = measure(model, args.mode, args.ranks, stall, args.prompt_tokens, log)
        print(f"| {r['mode']} | {r['ranks']} | {r['max_stall']:g} | {r['prompt_tokens']} | "
              f"{r['answer_s']:.1f} | {r['worst_gap_s']:.2f} | {r['median_gap_s']:.3f} | "
              f"{r['stream_tokens']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
