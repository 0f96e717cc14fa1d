"""Decode speed of running streams while long count_tokens calls arrive: whether rank 0's
tokenizing holds up the decode loop (issue: rank 0's batch thread never tokenizes).

    python -m tests.bench.tokenize_load [--cli PATH] [--streams 4] [--counts 20] [--tokens 16000]

Starts `serve` on the embedded model (2 ranks, pipeline), opens N greedy streams, measures
their decode rate for a quiet window, then sends the count_tokens calls (each a prompt of
about --tokens tokens, 4 at a time) and measures the rate while they run. Prints both rates,
their ratio and the worst gap between two tokens of one stream in each window.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(port: int, stamps: list[float], stop: threading.Event) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me about lists"}],
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    response = conn.getresponse()
    for line in response:
        if line.startswith(b"data: {") and b'"content"' in line:
            stamps.append(time.monotonic())
        if stop.is_set():
            break
    conn.close()


def count(port: int, text: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "default_model", "messages": [{"role": "user", "content": text}]}
    conn.request("POST", "/v1/messages/count_tokens", json.dumps(body),
                 {"x-api-key": "x", "Content-Type": "application/json"})  # fmt: skip
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return answer.get("input_tokens", -1)


def rate(stamps: list[list[float]], start: float, end: float) -> tuple[float, float]:
    """(tokens/s of all streams in [start, end], worst gap between two tokens of a stream)."""
    n = sum(1 for s in stamps for t in s if start <= t <= end)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if start <= b <= end]
    return n / (end - start), max(gaps, default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default="mlx-cluster")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--counts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16000)
    args = ap.parse_args()
    port = free_port()
    proc = subprocess.Popen(
        [args.cli, "serve", "--port", str(port)], stderr=subprocess.PIPE, text=True
    )
    for line in proc.stderr:
        if "serving" in line:
            break
    threading.Thread(target=lambda: list(proc.stderr), daemon=True).start()
    try:
        text = "lists and tuples are sequences " * (args.tokens // 5)
        print(f"count_tokens prompt: {count(port, text)} tokens")
        stop = threading.Event()
        stamps: list[list[float]] = [[] for _ in range(args.streams)]
        threads = [
            threading.Thread(target=stream, args=(port, s, stop), daemon=True) for s in stamps
        ]
        for t in threads:
            t.start()
        time.sleep(3)  # the streams are decoding
        quiet_start = time.monotonic()
        time.sleep(4)
        quiet_end = busy_start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: count(port, text), range(args.counts)))
        busy_end = time.monotonic()
        stop.set()
        quiet, quiet_gap = rate(stamps, quiet_start, quiet_end)
        busy, busy_gap = rate(stamps, busy_start, busy_end)
        print(f"{args.streams} streams, quiet: {quiet:.1f} tok/s (worst gap {quiet_gap:.2f} s)")
        print(
            f"while {args.counts} count_tokens of {args.tokens} tokens ran "
            f"({busy_end - busy_start:.1f} s): {busy:.1f} tok/s (worst gap {busy_gap:.2f} s), "
            f"{busy / quiet:.2f}x"
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
