"""Prefill on one group, decode on another (`serve --prefill-groups`, issue 53) against one
group doing both, on the same ranks: N greedy streams decode; once each has sent tokens, long
prompts arrive one after another (non-streaming, one token asked). Per setting: the streams'
token gaps while the long prompts were under way (median, p99, worst), their tokens per
second then, each long prompt's time to its answer, and the handoffs' bytes and time. The
settings alternate (A B A B ...), each starting serve afresh, in the same run.

    python -m tests.bench.disagg --streams 8 --prompt-tokens 9100 --prompts 2 --repeat 2
    python -m tests.support.netrig up 2 --rtt 300us --rate 1gbit > rig.yaml   # root
    python -m tests.bench.disagg --hostfile rig.yaml --prompts 1 --repeat 1

With --hostfile (2 hosts of one rank each, as the namespace rig's) the ranks run there: the
pipeline group spans both hosts, and the handoff crosses the link between them.

Every rank gets one BLAS thread (OPENBLAS_NUM_THREADS=1), as a host of its own would have its
own cores. The default model is llama-shaped (hidden 576, 8 layers) with an EOS out of reach.
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
import urllib.error
import urllib.request
from pathlib import Path

from tests.bench.stall import stream
from tests.support.long_context import long_text
from tests.support.serving import BIN, free_port, llama_576, post, stop, wait_up

SPLIT = ["--replicas", "2", "--prefill-groups", "1"]
SETTINGS = {
    "one pipeline-2 group": ["--mode", "pipeline"],
    "1 prefill + 1 decode rank": [*SPLIT, "--disaggregate-min-tokens", "256"],
    # the same two groups, the long prompt prefilled where it decodes: what
    # --disaggregate-min-tokens chooses between (--settings split,local)
    "1 prefill + 1 decode rank, prefilled where it decodes": [
        *SPLIT, "--disaggregate-min-tokens", str(10**9)],
}  # fmt: skip
CHOICES = {"pipeline": "one pipeline-2 group", "split": "1 prefill + 1 decode rank",
           "local": "1 prefill + 1 decode rank, prefilled where it decodes"}  # fmt: skip


def measure(model: str, flags: list[str], streams: int, prompts: int, prompt_tokens: int,
            log: str | None) -> dict:  # fmt: skip
    port = free_port()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    argv = [str(BIN / "mlx-cluster"), "serve", "--model", model, "--port", str(port),
            "--no-measure-links", *flags]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=open(log, "a") if log else subprocess.DEVNULL,
                            start_new_session=True, env=env)  # fmt: skip
    name = Path(model).name
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    stop_flag = threading.Event()
    try:
        wait_up(port, proc)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # every group serving (a fleet answers once one does)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        break
            except urllib.error.HTTPError:  # 503 while a group starts
                pass
            time.sleep(0.2)
        post(port, "/v1/completions", {"model": name, "prompt": "Warm up.", "max_tokens": 4})
        times: list[list[float]] = [[] for _ in range(streams)]
        threads = [threading.Thread(target=stream, args=(port, name, t, stop_flag, eos),
                                    daemon=True) for t in times]  # fmt: skip
        for t in threads:
            t.start()
        while min(len(t) for t in times) < 20:
            if not all(t.is_alive() for t in threads):
                raise RuntimeError("a stream ended before the long prompts were sent")
            time.sleep(0.05)
        sent = time.perf_counter()
        answers, handoffs = [], []
        for i in range(prompts):
            text = f"Document {i}. " + long_text(Path(model), prompt_tokens)
            body = {"model": name, "prompt": text, "max_tokens": 1, "temperature": 0}
            began = time.perf_counter()
            answer = json.loads(post(port, "/v1/completions", body).read())
            answers.append(time.perf_counter() - began)
            t = answer.get("timings") or {}
            if "handoff_n" in t:
                handoffs.append((t["handoff_n"], t["handoff_bytes"], t["handoff_ms"]))
        done = time.perf_counter()
        while not all(t[-1] > done for t in times):
            if not all(t.is_alive() for t in threads):
                raise RuntimeError("a stream ended while the long prompts were answered")
            time.sleep(0.05)
        stop_flag.set()
        gaps, during = [], 0
        for ts in times:
            before, inside = [t for t in ts if t < sent], [t for t in ts if sent <= t]
            during += sum(1 for t in inside if t <= done)
            upto = [before[-1], *(t for t in inside if t <= done),
                    min(t for t in inside if t > done)]  # fmt: skip
            gaps += [b - a for a, b in itertools.pairwise(upto)]
        gaps.sort()
        return {"window_s": done - sent, "answers_s": answers, "median_gap": gaps[len(gaps) // 2],
                "p99_gap": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
                "worst_gap": gaps[-1], "stream_tps": during / (done - sent),
                "handoffs": handoffs}  # fmt: skip
    finally:
        stop_flag.set()
        stop([proc])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: llama-shaped, built here)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", default="9100", help="comma-separated: each in turn")
    parser.add_argument("--settings", default="pipeline,split", help="of " + ",".join(CHOICES))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--log", help="serve's stderr, appended to LOG")
    parser.add_argument("--hostfile", help="2 hosts (default: 2 ranks on this machine)")
    args = parser.parse_args()
    where = ["--hostfile", args.hostfile] if args.hostfile else ["-n", "2"]
    model = args.model or str(llama_576(Path(tempfile.mkdtemp())))
    for tokens in [int(t) for t in args.prompt_tokens.split(",")]:
        names = [CHOICES[c] for c in args.settings.split(",")]
        table(names, model, where, tokens, args)


def table(names: list[str], model: str, where: list[str], tokens: int, args) -> None:
    results: dict[str, list[dict]] = {k: [] for k in names}
    for _ in range(args.repeat):
        for name in names:
            r = measure(model, where + SETTINGS[name], args.streams, args.prompts, tokens,
                        args.log)  # fmt: skip
            results[name].append(r)
            print(f"{name}: {json.dumps(r)}", file=sys.stderr, flush=True)

    def med(name: str, key: str) -> str:
        values = [r[key] for r in results[name]]
        return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"

    print(f"| setting | streams' median gap (s) | p99 gap (s) | worst gap (s) | stream tok/s "
          f"meanwhile | long prompt's answer (s) | handoff (tokens, MB, ms) |  ({args.streams} "
          f"streams, {args.prompts} x {tokens}-token prompts, median of "
          f"{args.repeat} [min-max])")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in names:
        answers = [a for r in results[name] for a in r["answers_s"]]
        hand = [h for r in results[name] for h in r["handoffs"]]
        shown = (f"{hand[0][0]}, {statistics.median(h[1] for h in hand) / 1e6:.1f}, "
                 f"{statistics.median(h[2] for h in hand):.0f}") if hand else "-"  # fmt: skip
        print(f"| {name} | {med(name, 'median_gap')} | {med(name, 'p99_gap')} | "
              f"{med(name, 'worst_gap')} | {med(name, 'stream_tps')} | "
              f"{statistics.median(answers):.1f} [{min(answers):.1f}-{max(answers):.1f}] | "
              f"{shown} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
