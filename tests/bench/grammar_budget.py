"""What a hostile grammar costs the other clients of one serve: a client's greedy completion
alone against the same beside a stream of requests under the worst grammars we could make,
alternated in one run; and the worst gap between a streamed client's tokens while a grammar
that takes seconds to compile joins.

    python -m tests.bench.grammar_budget --runs 5

A 2-rank serve (pipeline, one BLAS thread per rank) of the embedded model, or --model. Each
hostile request runs until the server ends it (its grammar's counts or its time budget:
node.decode.grammar) and is sent again at once (after an error, once --backoff passed), so
the client has one beside it all along.
Prints a markdown table: the client's tokens/s alone and beside (median [min-max] of --runs),
the ratio of medians, and how the hostile requests ended; then the worst token gap while a
slow-to-build grammar joins, and how fast a 1 MiB body of escaped quotes is refused while
/health answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from tests.support.serving import fresh_serve

ROOT = Path(__file__).resolve().parents[2]
HOSTILE: dict[str, dict | None] = {
    "(free text: a second stream's own cost)": None,
    "(a 400 at the door each time: temperature -1)": {"temperature": -1},
    # the third review's: Earley items grow with every token
    "ambiguous Lark": {"grammar": 'start: x\nx: x x | x x x | "a" | "b" | "ab"\n'},
    "ambiguous, right-recursive": {"grammar": 'start: x\nx: "a" x | "b" x | "a" | "b" | x x\n'},
    # the lexer's states grow with every token (2^21 in the end)
    "regex (a|b)*a(a|b){20}": {"regex": "(a|b)*a(a|b){20}"},
    "string of maxLength 10000": {
        "json": {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 10000}},
            "required": ["a"],
        }  # fmt: skip
    },
}


def big(run: int) -> str:
    """A Lark grammar of 30,000 alternatives (~1 s to build), another for each run: a
    grammar whose answer failed is refused for a while, and each run must build its own."""
    return "start: x\nx: " + " | ".join(f'"w{i}z{run}"' for i in range(30_000)) + "\n"


def post(port: int, body: dict, stream: bool = False):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps({**body, "stream": stream}).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    return urllib.request.urlopen(req, timeout=600)


def client_tps(port: int, model: str, tokens: int) -> float:
    """The client's own greedy completion: tokens per second, request to last byte."""
    body = {"model": model, "prompt": "Tell me about lists", "max_tokens": tokens,
            "temperature": 0}  # fmt: skip
    tic = time.perf_counter()
    with post(port, body) as r:
        got = json.loads(r.read())
    return got["usage"]["completion_tokens"] / (time.perf_counter() - tic)


def worst_gap(port: int, model: str, tokens: int, during=None) -> float:
    """The longest wait between two streamed pieces of the client's answer (``during``
    starts once its first piece came)."""
    body = {"model": model, "prompt": "Tell me about lists", "max_tokens": tokens,
            "temperature": 0}  # fmt: skip
    gaps, last = [], None
    with post(port, body, stream=True) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            elif during is not None:
                threading.Thread(target=during, daemon=True).start()
            last = now
    return max(gaps)


class Hostile:
    """Requests under one grammar, one after another until stopped; how each ended."""

    def __init__(self, port: int, model: str, asked: dict | None, backoff: float):
        self.port, self.model, self.asked, self.backoff = port, model, asked, backoff
        self.ends: Counter = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        body = {"model": self.model, "prompt": "x", "max_tokens": 1000, "temperature": 1.0}
        if self.asked is not None and "temperature" in self.asked:
            body.update(self.asked)
        elif self.asked is not None:
            body["structured_outputs"] = self.asked
        while not self.stop.is_set():
            try:
                with post(self.port, body) as r:
                    self.ends[f"200 {json.loads(r.read())['choices'][0]['finish_reason']}"] += 1
            except urllib.error.HTTPError as e:
                message = json.loads(e.read())["error"]["message"]
                self.ends[f"{e.code} {why(message)}"] += 1
                self.stop.wait(self.backoff)  # a client retrying an error backs off

    def finish(self) -> Counter:
        self.stop.set()
        self.thread.join()
        return self.ends


def send(port: int, body: dict) -> None:
    try:
        post(port, body).read()
    except urllib.error.HTTPError as e:  # its grammar over its budget: measured all the same
        e.read()


def why(message: str) -> str:
    for words in ("budget", "Too many items", "too many states", "max is", "temperature"):
        if words in message:
            return words
    return message[:60]


def body_refused(port: int) -> tuple[int, float, float]:
    """The third review's 1 MiB body ('"' and '\\"' x 524,288, no closing quote: hours of a
    backtracking scan before): its status, seconds to the answer, and /health's seconds
    asked meanwhile."""
    import http.client

    evil = b'"' + b'\\"' * 524_288
    health: list[float] = []

    def ask_health() -> None:
        tic = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/health")
        conn.getresponse().read()
        health.append(time.perf_counter() - tic)

    asker = threading.Thread(target=ask_health)
    tic = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", evil, {"Content-Type": "application/json"})
    asker.start()
    status = conn.getresponse().status
    took = time.perf_counter() - tic
    asker.join()
    return status, took, health[0]


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "node" / "default_model")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--backoff", type=float, default=0.5,
                    help="seconds the hostile client waits after an error before it sends "
                    "again (0: a flood)")  # fmt: skip
    args = ap.parse_args()
    name = args.model.name
    rows = []
    with fresh_serve(args.model, "pipeline", 2) as port:
        for label, asked in HOSTILE.items():
            alone, beside = [], []
            for _ in range(args.runs):  # alternated: alone, then beside the hostile grammar
                alone.append(client_tps(port, name, args.tokens))
                hostile = Hostile(port, name, asked, args.backoff)
                time.sleep(0.3)  # the hostile request is under way before the client starts
                beside.append(client_tps(port, name, args.tokens))
                ends = hostile.finish()
            ratio = statistics.median(beside) / statistics.median(alone)
            rows.append(f"| {label} | {spread(alone)} | {spread(beside)} | {ratio:.2f}x | "
                        f"{', '.join(f'{k}: {v}' for k, v in sorted(ends.items()))} |")  # fmt: skip
        gaps_alone = [worst_gap(port, name, args.tokens) for _ in range(args.runs)]
        gaps_big = []
        for run in range(args.runs):
            joining = {"model": name, "prompt": "x", "max_tokens": 4,
                       "structured_outputs": {"grammar": big(run)}}  # fmt: skip
            gaps_big.append(worst_gap(port, name, args.tokens,
                                      lambda joining=joining: send(port, joining)))  # fmt: skip
        refused = [body_refused(port) for _ in range(args.runs)]
    print(f"client: greedy completion of {args.tokens} tokens, tok/s, median [min-max] of "
          f"{args.runs}; the hostile client waits {args.backoff:g} s after an error\n")  # fmt: skip
    print("| beside | alone | beside | ratio | the hostile requests ended |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nworst gap between the client's streamed tokens (ms), median [min-max] of "
          f"{args.runs}: alone {spread([g * 1000 for g in gaps_alone])}, while a Lark grammar "
          f"of 30,000 alternatives joins {spread([g * 1000 for g in gaps_big])}")  # fmt: skip

    print(f"\nthe 1 MiB body of escaped quotes: status {sorted({r[0] for r in refused})}, "
          f"answered in {spread([r[1] * 1000 for r in refused])} ms; /health asked meanwhile "
          f"answered in {spread([r[2] * 1000 for r in refused])} ms")  # fmt: skip


if __name__ == "__main__":
    main()
