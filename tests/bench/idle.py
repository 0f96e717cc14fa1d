"""What an idle rig costs, and what waking it costs: CPU seconds of each rank while serve
waits for requests and chat waits for the user, and a request's time to first token after a
rest against one on a server that just answered.

    python -m tests.bench.idle --idle 30 --modes pipeline,tensor --wakes 5

Each rank runs with one BLAS thread (OPENBLAS_NUM_THREADS=1), 2 ranks on this machine, the
llama-shaped model of the long-prompt measurements (hidden 576, 8 layers). CPU seconds come
from /proc (utime + stime) of each `python -m node run` process, over the idle window that
starts once the last answer is complete. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support.processes import cpu_seconds, ranks_below
from tests.support.serving import BIN, fresh_serve, llama_576


def idle_cpu(pids: list[int], seconds: float) -> list[float]:
    before = [cpu_seconds([p]) for p in pids]
    time.sleep(seconds)  # the measurement itself: the rig does nothing meanwhile
    return [cpu_seconds([p]) - b for p, b in zip(pids, before, strict=True)]


def first_token_s(port: int, model: str) -> float:
    """Seconds from sending a streamed greedy request to its first text."""
    body = {"model": model, "prompt": "Tell me about lists", "max_tokens": 4,
            "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    tic = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"text": ""' not in line:
                took = time.perf_counter() - tic
                r.read()
                return took
    raise RuntimeError("no text came")


def serve_row(model: Path, mode: str, idle: float, wakes: int, rests: list[float]) -> dict:
    with fresh_serve(model, mode, 2) as port:
        pids = ranks_below(os.getpid(), 2)  # the serve is this process's child
        first_token_s(port, model.name)
        cpu = idle_cpu(pids, idle)
        busy: list[float] = []
        woken: dict[float, list[float]] = {rest: [] for rest in rests}
        for _ in range(wakes):
            for rest in rests:
                first_token_s(port, model.name)
                busy.append(first_token_s(port, model.name))  # right after an answer
                time.sleep(rest)  # the rest itself
                woken[rest].append(first_token_s(port, model.name))
    return {"job": f"serve, {mode} 2", "cpu": cpu, "busy": busy, "woken": woken}


def chat_row(model: Path, mode: str, idle: float) -> dict:
    argv = [str(BIN / "mlx-cluster"), "chat", "-n", "2", "--mode", mode, "--model", str(model),
            "--max-tokens", "4"]  # fmt: skip
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, env=env)  # fmt: skip
    try:
        pids = ranks_below(proc.pid, 2)
        proc.stdin.write(b"Tell me about lists\n")
        proc.stdin.flush()
        line = b""
        while not line.endswith(b"\n"):  # the answer, then the newline chat ends it with
            line += os.read(proc.stdout.fileno(), 4096)
        time.sleep(1.0)  # the turn's bookkeeping after the text (cache agreement)
        cpu = idle_cpu(pids, idle)
    finally:
        proc.stdin.close()
        proc.wait(60)
    return {"job": f"chat, {mode} 2", "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=30.0, help="idle window (s)")
    parser.add_argument("--modes", default="pipeline,tensor")
    parser.add_argument("--wakes", type=int, default=5, help="rest/wake pairs per serve")
    parser.add_argument("--rest", default="10", help="rests before a wake (s), comma-separated")
    args = parser.parse_args()
    rests = [float(x) for x in args.rest.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = llama_576(Path(tmp))
        rows = []
        for mode in args.modes.split(","):
            rows.append(serve_row(model, mode, args.idle, args.wakes, rests))
            rows.append(chat_row(model, mode, args.idle))
    after = " / ".join(f"after {r:g} s rest" for r in rests)
    print(f"| job | CPU s over {args.idle:g} s idle (rank 0, rank 1) | first token: after an "
          f"answer / {after} (median ms) |")  # fmt: skip
    print("|---|---|---|")
    for r in rows:
        cpu = ", ".join(f"{c:.2f}" for c in r["cpu"])
        wake = "-"
        if "busy" in r:
            busy = statistics.median(r["busy"])
            woken = [statistics.median(w) for w in r["woken"].values()]
            wake = " / ".join([f"{busy * 1e3:.1f}", *(f"{w * 1e3:.1f}" for w in woken)])
        print(f"| {r['job']} | {cpu} | {wake} |")


if __name__ == "__main__":
    main()
